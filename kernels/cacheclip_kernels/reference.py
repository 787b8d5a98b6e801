"""Plain-torch reference for sparse-query attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_position_mask(q_pos: torch.Tensor, n_keys: int, window: int | None = None) -> torch.Tensor:
    """Boolean mask [B, 1, M, N]: query m may see key j iff j <= q_pos[b, m], and, with a
    sliding window w, q_pos[b, m] - j < w (w keys: the row's own and the w - 1 before it)."""
    keys = torch.arange(n_keys, device=q_pos.device)[None, None, :]
    pos = q_pos[:, :, None]
    mask = keys <= pos
    if window is not None:
        mask &= pos - keys < window
    return mask[:, None]


def check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")


def sparse_query_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """out[b, h, m] = softmax(q[b, h, m] . K[b, h_kv, lo : q_pos[b, m] + 1]^T * scale) V, where
    lo = 0, or q_pos[b, m] - window + 1 with a sliding window.

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
    check_window(window)
    mask = causal_position_mask(q_pos, n, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=h != h_kv)
