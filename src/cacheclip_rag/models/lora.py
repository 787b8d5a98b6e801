"""Concatenation-aware LoRA for the primary model ("Fine-Tuning a KV Cache Concatenation-Aware Model or
Recomputing KV Caches? Why Not Both?", Tachibana, Miyashita and Deguchi).

The fine-tune-plus-recompute paper tunes the model so that chunks encoded without seeing each
other still read well when concatenated (Block-attention's training), then recomputes a few
rows on top. Here the tuning is a LoRA (through `peft`) on the attention and MLP projections,
trained label-free by `train.train_lora`; this module attaches it for training, saves it, and
loads it for serving, merged into the weights (no per-token cost).

A saved adapter is a folder: peft's `adapter_config.json` and `adapter_model.safetensors`, plus
`cacheclip.json` recording the base model, its weights fingerprint and the sha256 of both peft
files. Loading checks all of them; a tuned model's fingerprint is the base fingerprint combined
with that sha256, so its caches never share a namespace with the base model's.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from .loading import EMBEDDED, LoadedModel

log = logging.getLogger(__name__)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections LoRA adapts (attention and MLP of every layer)."""
FILES = ("adapter_config.json", "adapter_model.safetensors")
META = "cacheclip.json"
KIND = "cacheclip-concat-lora"
SHIPPED_DIR = Path(__file__).parent.parent / "data" / "lora"
SHIPPED: dict[str, tuple[str, str]] = {
    # `cacheclip train lora --out DIR --samples 96 --held-out 6 --epochs 1 --batch 2 --length 768
    # --chunk-tokens 256 --lr 4e-4` (float32, 2,876 s on 2 AVX2 cores): held-out block-attention KL
    # 0.0822 -> 0.0646. Stored in bf16. docs/training.md.
    "qwen2.5-coder-0.5b-instruct": ("qwen2.5-coder-0.5b-instruct-lora",
                                    "3747141b8d9a1b6101b428de8fa8a6ed10edfe7682739668b61352f8995dc031"),
}
"""Embedded model name -> (adapter folder in the package, the peft files' pinned sha256);
`primary_adapter="shipped"` selects it. Reproduce with the command in `docs/training.md`."""


def attach(lm: LoadedModel, rank: int, alpha: int, seed: int = 0):
    """Wrap `lm.model` with fresh trainable LoRA layers (B = 0: the model is unchanged until
    trained); returns the peft model. `lm.model` and its family now run through the LoRA layers."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(TARGETS), bias="none")
    return get_peft_model(lm.model, config)


def files_digest(folder: Path) -> str:
    """sha256 over the peft files of an adapter folder, in a fixed order."""
    digest = hashlib.sha256()
    for name in FILES:
        digest.update(name.encode())
        digest.update((folder / name).read_bytes())
    return digest.hexdigest()


def save(peft_model, folder: str | Path, lm: LoadedModel, extra: dict, dtype: torch.dtype = torch.bfloat16) -> str:
    """Write the adapter folder (peft files + cacheclip.json); returns the files' sha256 (the pin).
    The LoRA matrices are stored in `dtype` (bf16 halves the file; they are upcast on merge)."""
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    peft_model.save_pretrained(folder)
    weights = folder / FILES[1]
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(weights).items()}
    save_file(tensors, weights.with_suffix(".tmp"), metadata={"format": "pt"})
    weights.with_suffix(".tmp").replace(weights)
    sha = files_digest(folder)
    meta = {"kind": KIND, "model": lm.name, "fingerprint": lm.fingerprint, "sha256": sha, **extra}
    tmp = folder / f".{META}.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(folder / META)
    return sha


def check(folder: str | Path, name: str, fingerprint: str) -> dict:
    """The adapter folder's metadata, after checking that it is complete, undamaged and made for
    this base model (an embedded model's name pins its weights, so its adapters serve it in any
    dtype; another model must match the fingerprint). A ValueError names the folder and what was
    expected."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter {str(folder)!r}: no such folder (expected one written by `cacheclip train lora`)")
    missing = [n for n in (*FILES, META) if not (folder / n).is_file()]
    if missing:
        raise ValueError(f"LoRA adapter {str(folder)!r} lacks {missing}: expected {[*FILES, META]}")
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"LoRA adapter {str(folder)!r}: {META} is unreadable ({err})") from err
    if not isinstance(meta, dict) or meta.get("kind") != KIND:
        raise ValueError(f"LoRA adapter {str(folder)!r}: {META} is not of kind {KIND!r}")
    sha = files_digest(folder)
    if sha != meta.get("sha256"):
        raise ValueError(f"LoRA adapter {str(folder)!r}: its files hash to {sha}, {META} records {meta.get('sha256')!r} "
                         "(damaged or edited)")
    if meta.get("fingerprint") != fingerprint and not (name in EMBEDDED and meta.get("model") == name):
        raise ValueError(f"LoRA adapter {str(folder)!r} was trained for {meta.get('model')!r} "
                         f"(fingerprint {meta.get('fingerprint')!r}); this model is {name!r} ({fingerprint!r})")
    return meta


def merged(model, folder: str | Path):
    """The base `model` with the adapter's LoRA merged into its weights (a plain model again)."""
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    except (RuntimeError, ValueError, KeyError) as err:  # shapes or module names of another model
        raise ValueError(f"LoRA adapter {str(folder)!r} does not fit this model: {err}") from err


def tuned_fingerprint(base: str, sha: str) -> str:
    """A tuned model's fingerprint: the base one combined with the adapter files' hash."""
    return hashlib.sha256(f"{base}+lora:{sha}".encode()).hexdigest()[:32]


def resolve(spec: str | Path, lm: LoadedModel) -> Path:
    """The adapter folder a config names: "shipped" the package's LoRA for `lm` (an embedded
    model; its files must match their pin), else a folder path (checked by `check`)."""
    if str(spec) != "shipped":
        return Path(spec)
    if lm.name not in SHIPPED:
        raise ValueError(f"no LoRA adapter ships for {lm.name!r} (shipped: {sorted(SHIPPED)}); train one with "
                         "`cacheclip train lora --out DIR` and give its folder")
    folder_name, pinned = SHIPPED[lm.name]
    folder = SHIPPED_DIR / folder_name
    if not all((folder / n).is_file() for n in (*FILES, META)):
        raise ValueError(f"{folder}: the shipped LoRA adapter is missing from the installed package (expected "
                         f"sha256 {pinned}); reinstall it")
    actual = files_digest(folder)
    if actual != pinned:
        raise ValueError(f"{folder}: the shipped LoRA adapter hashes to {actual}, pinned {pinned}; reinstall the package")
    return folder


def tuned_name(base: str, sha: str) -> str:
    """A tuned model's name: the base name and the first 12 hex digits of its adapter's hash
    (for an embedded base and a pinned adapter, the name pins the weights)."""
    return f"{base}+lora-{sha[:12]}"


def apply(lm: LoadedModel, folder: str | Path, copy: bool = True) -> LoadedModel:
    """`lm` tuned by the adapter in `folder` ("shipped": the package's, see `resolve`; checked,
    then merged): a new LoadedModel named by `tuned_name` whose fingerprint includes the adapter's
    hash. copy=False merges into lm's own weights (a freshly loaded model nobody else holds)."""
    import copy as copy_lib

    folder = resolve(folder, lm)
    meta = check(folder, lm.name, lm.fingerprint)
    model = merged(copy_lib.deepcopy(lm.model) if copy else lm.model, folder).eval()
    tuned = LoadedModel(name=tuned_name(lm.name, meta["sha256"]), model=model, tokenizer=lm.tokenizer,
                        fingerprint=tuned_fingerprint(lm.fingerprint, meta["sha256"]))
    log.info("tuned %s with LoRA %s (sha256 %s)", lm.name, folder, meta["sha256"][:12])
    return tuned
