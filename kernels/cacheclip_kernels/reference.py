"""Plain-torch reference for sparse-query attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_position_mask(q_pos: torch.Tensor, n_keys: int) -> torch.Tensor:
    """Boolean mask [B, 1, M, N]: query m may see key j iff j <= q_pos[b, m]."""
    keys = torch.arange(n_keys, device=q_pos.device)
    return (keys[None, None, :] <= q_pos[:, :, None])[:, None]


def sparse_query_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """out[b, h, m] = softmax(q[b, h, m] . K[b, h_kv, :q_pos[b, m] + 1]^T * scale) V.

    q: [B, H, M, D] the selected rows only, in any order.
    k, v: [B, H_kv, N, D] the whole cache (H a multiple of H_kv, grouped-query attention).
    q_pos: [B, M] absolute positions of the rows, each in [0, N).
    Returns [B, H, M, D] in q's dtype.
    """
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [B,H,M,D] and k, v [B,H_kv,N,D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, m, d = q.shape
    h_kv, n = k.shape[1], k.shape[2]
    if h % h_kv or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} does not fit k {tuple(k.shape)} (heads must be a multiple of kv heads)")
    if q_pos.shape != (b, m):
        raise ValueError(f"q_pos must be [B, M] = {(b, m)}, got {tuple(q_pos.shape)}")
    mask = causal_position_mask(q_pos, n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=h != h_kv)
