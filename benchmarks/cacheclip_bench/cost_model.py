"""What a request's recompute should cost, counted: its arithmetic share of a full prefill.

A reuse mode recomputes some rows through every layer; a full prefill computes them all. Counted
in multiply-accumulates of the matrix work (the projections q, k, v, o and the gated MLP, the
same for every row; attention, one QK and one AV product per key the row sees, causal and within
the layer's sliding window), the recompute's share of the full prefill's work is the limit its
measured share of TTFT could reach if nothing but arithmetic cost time. A row late in the prompt
sees more keys than an early one, so 20% of the rows cost more than 20% where they sit late (as
CacheClip's do) and less where they sit early. The logits of the last row, the same in both, are
left out; so are the aux model's selection and the loading of caches, stages of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    """The dimensions of a decoder that set its arithmetic: per layer the same projections and
    MLP; windows: each layer's sliding window (None: full attention)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]

    @classmethod
    def of(cls, lm) -> Shape:
        """The shape of a loaded model (`cacheclip_rag.analysis.LoadedModel`)."""
        cfg, fam = lm.model.config, lm.family
        return cls(hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, heads=cfg.num_attention_heads,
                   kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                   head_dim=fam.head_dim, windows=tuple(fam.window(layer) for layer in range(len(fam.layers))))

    @property
    def dense_per_row(self) -> int:
        """Per row and layer: q and o (hidden x heads x head_dim each), k and v (x kv_heads), the
        gated MLP (three hidden x intermediate matrices)."""
        attn = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        return attn + 3 * self.hidden * self.intermediate


def parts(shape: Shape, positions: torch.Tensor) -> tuple[float, float]:
    """(dense, attention) multiply-accumulates of computing the rows at sequence positions
    `positions` [R] through every layer: the projections and MLP, and attention over the keys at
    positions <= each row's own (within the layer's window)."""
    pos = positions.to(torch.float64)
    dense = float(len(shape.windows) * shape.dense_per_row * pos.numel())
    attention = 0.0
    for window in shape.windows:
        seen = pos + 1 if window is None else torch.clamp(pos + 1, max=window)
        attention += 2.0 * shape.heads * shape.head_dim * float(seen.sum())
    return dense, attention


def macs(shape: Shape, positions: torch.Tensor) -> float:
    """All multiply-accumulates of computing the rows at `positions` [R] (`parts` summed)."""
    return sum(parts(shape, positions))


def arithmetic_share(shape: Shape, rows: torch.Tensor, n_tokens: int) -> float:
    """The work of recomputing `rows` [R] (sequence positions) over a full prefill of n_tokens."""
    return macs(shape, rows) / macs(shape, torch.arange(n_tokens))


def shares(shape: Shape, rows: torch.Tensor, n_tokens: int) -> tuple[float, float]:
    """(dense, attention): each part of recomputing `rows` [R] over a full prefill of n_tokens;
    they sum to `arithmetic_share`."""
    whole = macs(shape, torch.arange(n_tokens))
    dense, attention = parts(shape, rows)
    return dense / whole, attention / whole
