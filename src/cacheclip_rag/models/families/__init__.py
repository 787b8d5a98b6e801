"""Model families, one adapter file each, keyed by transformers' `config.model_type`.

To support a new family: write a file here with a `Family` subclass that overrides what differs
from the Llama layout (`families/base.py`), and add it to `FAMILIES` below. Tests run the
correctness oracles over a tiny random model of every family (the `tiny_lm` fixture in
`tests/conftest.py`, used by tests/request/test_recompute.py, test_kernel.py, test_aux_scoring.py, test_packets.py).
"""

from __future__ import annotations

from torch import nn

from .base import FULL, SLIDING, Family, Rope
from .gemma3 import Gemma3
from .llama import Llama
from .mistral import Mistral
from .qwen2 import Qwen2
from .qwen3 import Qwen3

FAMILIES: dict[str, type[Family]] = {t: cls for cls in (Llama, Qwen2, Qwen3, Mistral, Gemma3) for t in cls.model_types}


def supported() -> list[str]:
    return sorted(FAMILIES)


def for_model(model: nn.Module, name: str = "model") -> Family:
    """The family adapter driving `model`; ValueError naming the supported types otherwise."""
    model_type = getattr(model.config, "model_type", None)
    cls = FAMILIES.get(model_type)
    if cls is None:
        raise ValueError(f"{name} is a {model_type!r} model; supported types are {supported()}")
    return cls(model)


__all__ = ["FAMILIES", "FULL", "SLIDING", "Family", "Rope", "for_model", "supported"]
