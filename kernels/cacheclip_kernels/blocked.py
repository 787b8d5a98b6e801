"""Sparse-query attention on the CPU at about the cost of the keys each row can see.

The reference scores every selected row against every key and masks the future away, so M rows
cost M x N whatever their positions (one fused SDPA call with a boolean mask does not skip
masked blocks). Here the rows, sorted by position, are cut into a few blocks; each block is one
fused SDPA call over only the keys up to its last row (and, on a sliding-window layer, from its
first row's window start). Measured on a 2-core CPU, 4K keys and 20% of the rows: 0.29 of a
dense causal prefill's attention against 0.42 for the single masked call. The plan (blocks, key
ranges, masks) depends only on the rows, so a layer loop builds it once per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .reference import check_window


@dataclass(frozen=True)
class Block:
    rows: slice
    lo: int  # first key any row of the block can see
    hi: int  # one past the last
    mask: torch.Tensor  # [1, 1, rows, hi - lo] bool


@dataclass(frozen=True)
class BlockPlan:
    """How M rows at sorted positions attend to N keys, in `blocks` of consecutive rows."""

    n_keys: int
    window: int | None
    blocks: tuple[Block, ...]

    @classmethod
    def build(cls, positions: torch.Tensor, n_keys: int, window: int | None = None, blocks: int | None = None) -> BlockPlan:
        """positions: [M] ascending, in [0, n_keys). blocks: how many (default: one per 128
        rows, at most 8: fewer calls cost less overhead, more skip more keys)."""
        check_window(window)
        if positions.dim() != 1:
            raise ValueError(f"positions must be [M], got {tuple(positions.shape)}")
        m = int(positions.numel())
        if m and (int(positions[0]) < 0 or int(positions[-1]) >= n_keys or bool((positions[1:] < positions[:-1]).any())):
            raise ValueError(f"positions must be ascending in [0, {n_keys})")
        count = max(1, min(8, m // 128)) if blocks is None else blocks
        bounds = [round(i * m / count) for i in range(count + 1)]
        out = []
        for start, stop in zip(bounds, bounds[1:]):
            if stop <= start:
                continue
            p = positions[start:stop]
            hi = int(p[-1]) + 1
            lo = 0 if window is None else max(0, int(p[0]) - window + 1)
            keys = torch.arange(lo, hi, device=positions.device)[None, :]
            mask = keys <= p[:, None]
            if window is not None:
                mask &= p[:, None] - keys < window
            out.append(Block(slice(start, stop), lo, hi, mask[None, None]))
        return cls(n_keys, window, tuple(out))


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, *, scale: float | None = None) -> torch.Tensor:
    """`sparse_query_attention_ref` for batch 1 and rows at the plan's sorted positions.

    q: [1, H, M, D]; k, v: [1, H_kv, N, D]. Returns [1, H, M, D].
    """
    if q.shape[0] != 1 or k.shape[2] != plan.n_keys:
        raise ValueError(f"blocked attention takes batch 1 and the plan's {plan.n_keys} keys; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    gqa = q.shape[1] != k.shape[1]
    parts = [
        F.scaled_dot_product_attention(q[:, :, b.rows], k[:, :, b.lo : b.hi], v[:, :, b.lo : b.hi], attn_mask=b.mask,
                                       scale=scale, enable_gqa=gqa)
        for b in plan.blocks
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
