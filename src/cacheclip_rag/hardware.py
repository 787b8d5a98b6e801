"""What the hardware computes natively, decided once when a model is loaded.

bf16 halves memory and is fast where the hardware has bf16 arithmetic (CUDA GPUs from Ampere on,
x86 CPUs with AMX or AVX512-BF16). On a CPU without it, PyTorch emulates bf16 matmuls and a
2K-token prefill of the default primary took 120 s in bf16 against 21 s in float32 (one run, AVX2
machine): there "auto" computes in float32.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""The dtype names a config may give (besides "auto")."""

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
"""x86 CPU flags (as /proc/cpuinfo spells them) that mean native bf16 arithmetic."""


def _cpuinfo(fields: tuple[str, ...], cpuinfo: str | Path) -> str | None:
    """The first processor's value of the first of `fields` listed; None where the file is
    unreadable or has none of them."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in fields:
            return value.strip()
    return None


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags of the first processor listed; empty where the file is unreadable."""
    return frozenset((_cpuinfo(("flags", "Features"), cpuinfo) or "").split())


def native_bf16(device: str | torch.device = "cpu", flags: frozenset[str] | None = None) -> bool:
    """Whether `device` computes bf16 natively. flags: CPU flags to use instead of this machine's."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in BF16_CPU_FLAGS)


def resolve_device(name: str, cuda_available: bool | None = None) -> torch.device:
    """A configured device: "auto" is cuda:0 where CUDA is available, else the CPU. Asking for
    CUDA where there is none is a ValueError naming what was asked."""
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if name == "auto":
        return torch.device("cuda:0" if available else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not available:
        raise ValueError(f"device {name!r} asked for, but this machine has no CUDA GPU (use 'cpu' or 'auto')")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r}: only 'cpu' and 'cuda[:n]' are supported")
    return device


def resolve_dtype(name: str, device: str | torch.device = "cpu", flags: frozenset[str] | None = None) -> torch.dtype:
    """The compute dtype for a configured name: "auto" is bf16 where native (see `native_bf16`),
    float32 elsewhere; any other name is taken as given."""
    if name != "auto":
        return DTYPES[name]
    native = native_bf16(device, flags)
    chosen = torch.bfloat16 if native else torch.float32
    log.info("dtype auto on %s: %s (native bf16: %s)", device, str(chosen).removeprefix("torch."), native)
    return chosen


def describe(flags: frozenset[str] | None = None) -> str:
    """One line naming the bf16-relevant CPU flags, for benchmark tables and the demo."""
    flags = cpu_flags() if flags is None else flags
    present = [f for f in (*BF16_CPU_FLAGS, "avx512f", "avx2") if f in flags]
    return f"CPU flags: {' '.join(present) or 'none of avx2/avx512f/avx512_bf16/amx_bf16'}; native bf16: {native_bf16('cpu', flags)}"


def machine(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """What a measured row was measured on, for journals: the CPU model, its bf16-relevant flags
    and torch's thread count ("AMD EPYC; CPU flags: avx512_bf16 avx512f avx2; native bf16: True;
    2 threads"), and the GPU where CUDA is available. Rows of one machine compare; times across
    machines do not."""
    model = _cpuinfo(("model name", "Model", "Hardware"), cpuinfo) or "unknown CPU"
    gpu = f"; GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{model}; {describe(cpu_flags(cpuinfo))}; {torch.get_num_threads()} threads{gpu}"
