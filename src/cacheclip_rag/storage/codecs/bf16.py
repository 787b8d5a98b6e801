"""`bf16`: each layer's K and V as they are, in the storage dtype (`StoreConfig.kv_dtype`: bf16
for float32 models, else the compute dtype). The format of every store written before codecs."""

from __future__ import annotations

import torch

from .base import Kind, register


class Plain:
    name = "bf16"
    bits = 16.0
    layout = 1

    def encode(self, kind: Kind, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous()

    def decode(self, kind: Kind, stored: torch.Tensor, tokens: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        if stored.dim() != 3 or stored.shape[1:] != (tokens, head_dim):
            raise ValueError(f"stored tensor {tuple(stored.shape)} for {tokens} tokens of head_dim {head_dim}")
        return stored if stored.dtype == dtype else stored.to(dtype)

    def bound(self, kind: Kind, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(x.shape)


register(Plain())
