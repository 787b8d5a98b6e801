"""dtype "auto": bf16 only where the hardware computes it natively, decided from injected CPU flags."""

import pytest
import torch

from cacheclip_rag.config import ModelConfig
from cacheclip_rag.hardware import cpu_flags, describe, native_bf16, resolve_dtype

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512_vnni"}
AMX = AVX512 | {"amx_tile", "amx_bf16", "amx_int8"}
ZEN4 = AVX512 | {"avx512_bf16"}


@pytest.mark.parametrize("flags, expected", [(AVX2, torch.float32), (AVX512, torch.float32),
                                             (AMX, torch.bfloat16), (ZEN4, torch.bfloat16)])
def test_auto_is_bf16_only_with_native_bf16(flags, expected):
    assert resolve_dtype("auto", "cpu", flags) == expected
    assert ModelConfig().torch_dtype(flags) == expected


def test_explicit_dtype_is_taken_as_given():
    assert resolve_dtype("bfloat16", "cpu", AVX2) == torch.bfloat16
    assert ModelConfig(dtype="float32").torch_dtype(AMX) == torch.float32


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be 'auto'"):
        ModelConfig(dtype="int8")


def test_cpu_flags_parse_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()
    assert native_bf16("cpu", cpu_flags(info)) and not native_bf16("cpu", AVX2)
    assert "native bf16: False" in describe(AVX2)
