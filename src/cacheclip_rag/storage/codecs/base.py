"""The protocol every chunk-cache codec implements, and the registry `StoreConfig.kv_codec` names.

A codec turns one layer's keys or values, [kv_heads, T, head_dim] in the storage dtype, into the
one tensor a record keeps for them, and back. It sees nothing else: the record around it (names,
checksums over the stored bytes, token ids) is `storage.record`'s. Each codec is one file in this
folder that registers itself; a store records its codec per namespace and never mixes them.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch

Kind = Literal["k", "v"]
"""Keys ("k") or values ("v"): a codec may treat them differently (KIVI quantizes keys per
channel and values per token)."""


class Codec(Protocol):
    name: str
    """What `StoreConfig.kv_codec` and records call it."""

    bits: float
    """Nominal bits per stored element, scales included (for docs and `cacheclip store stats`)."""

    layout: int
    """The version of its stored layout, kept in every record it writes: a record of another
    layout (written by an older release) is damage, rebuilt from its text, never misread."""

    def encode(self, kind: Kind, x: torch.Tensor) -> torch.Tensor:
        """x: [H, T, D] (the storage dtype) -> the stored tensor (any shape and dtype; contiguous)."""

    def decode(self, kind: Kind, stored: torch.Tensor, tokens: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """The stored tensor of `tokens` tokens back to [H, tokens, head_dim] in `dtype`."""

    def bound(self, kind: Kind, x: torch.Tensor) -> torch.Tensor:
        """[H, T, D] float32: the largest |decode(encode(x)) - x| this codec allows at each element
        (before the cast to the storage dtype), the bound its tests hold it to."""


_CODECS: dict[str, Codec] = {}
DEFAULT_CODEC = "bf16"
"""The codec a namespace whose records name none was written with (every store before codecs),
and the one a namespace written through a bare `KVStore` gets when its config says "auto"."""
AUTO = "auto"
"""`StoreConfig.kv_codec` "auto": an engine keeps the codec its model's caches already have in the
store, else takes `AUTO_CODEC`."""
AUTO_CODEC = "int8"
"""What "auto" gives a model's caches new to a store: `cacheclip bench store` measured int8 at
1.93x fewer bytes than bf16, its KL to full attention inside bf16's interval, and `bench ttft`
a cold read no slower than a bf16 store's before the codecs (docs/benchmarks.md, section 9)."""


def register(codec: Codec) -> None:
    _CODECS[codec.name] = codec


def check(name: str) -> str:
    """`name` if it is "auto" or a known codec; a ValueError naming it and the known ones otherwise."""
    if name != AUTO:
        get(name)
    return name


def get(name: str) -> Codec:
    """The codec called `name`; a ValueError naming it and the known ones otherwise."""
    try:
        return _CODECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown KV codec {name!r}; expected {AUTO!r} or one of {names()}") from None


def names() -> list[str]:
    return sorted(_CODECS)
