"""Triton forward kernel for sparse-query attention.

    out[b, h, m] = softmax(q[b, h, m] . K[b, h // G, lo : pos[b, m] + 1]^T * scale) V[b, h // G, ...]

with lo = 0, or pos[b, m] - WINDOW + 1 on a sliding-window layer. q holds only the selected rows
(any positions, any order); K and V are the whole cache. Each program owns BLOCK_M query rows of
one (batch, head) and streams key blocks with an online softmax, stopping at the largest
position in its block (keys past it can be seen by no row) and, with a window, starting at the
block that holds its smallest position's first visible key.
The launcher sorts rows by position first so each block's largest position is as small as it
can be, which is where the skipped upper triangle comes from.

Three layers, as in Triton's fused-attention tutorial: `_sparse_query_fwd` (the kernel),
`_launch` (checks shapes, dtypes and strides, builds the grid) and `sparse_query_attention`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .reference import check_window


@triton.jit
def _sparse_query_fwd(
    Q, K, V, POS, OUT, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_pb, stride_pm,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    M, N, H, scale,
    WINDOW: tl.constexpr,  # sliding window in keys, 0 for none (a model has one or two values)
    GROUP: tl.constexpr,  # query heads per kv head (grouped-query attention)
    HEAD_DIM: tl.constexpr,  # tl.arange needs a compile-time power of two; launcher checks it
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per inner step
    DOT_FP32: tl.constexpr,  # upcast before tl.dot: fp32 inputs, and the interpreter's bf16 dot is wrong
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    h_kv = h // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < M

    pos = tl.load(POS + b * stride_pb + offs_m * stride_pm, mask=row_ok, other=-1)
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 is cheaper than exp; fold log2(e) into the scale

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    hi = tl.minimum(tl.max(pos, axis=0) + 1, N)  # keys past the block's largest position are never seen
    lo = 0
    if WINDOW > 0:  # keys before the smallest row's window are never seen either
        first = tl.min(tl.where(row_ok, pos, N), axis=0) - WINDOW + 1
        lo = tl.maximum(first, 0) // BLOCK_N * BLOCK_N
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < N
        k = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd, mask=col_ok[None, :], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=col_ok[:, None], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
        visible = (offs_n[None, :] <= pos[:, None]) & col_ok[None, :]
        if WINDOW > 0:
            visible = visible & (pos[:, None] - offs_n[None, :] < WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows that have seen nothing yet keep m = -inf; use 0 there so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if DOT_FP32:
            acc += tl.dot(p, v)
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(
        OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
        out.to(OUT.dtype.element_ty),
        mask=row_ok[:, None],
    )
    lse = (m_i + tl.math.log2(l_safe)) / 1.4426950408889634  # natural-log log-sum-exp of the scaled logits
    tl.store(LSE + b * stride_lb + h * stride_lh + offs_m * stride_lm, lse, mask=row_ok)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _launch(q, k, v, q_pos, scale, block_m, block_n, window=None):
    """Validate, sort rows by position, run the kernel, unsort. Returns (out, lse)."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [B,H,M,D], k and v [B,H_kv,N,D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, m, d = q.shape
    _, h_kv, n, _ = k.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    if h % h_kv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({h_kv})")
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim must be one of 16, 32, 64, 128, 256, got {d}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one of {_DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q_pos.shape != (b, m):
        raise ValueError(f"q_pos must be [B, M] = {(b, m)}, got {tuple(q_pos.shape)}")
    if not (q.device == k.device == v.device == q_pos.device):
        raise ValueError("q, k, v and q_pos must be on one device")
    if not q.is_cuda and not _interpreting():
        raise ValueError("the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 for testing on CPU)")
    check_window(window)
    if m and (int(q_pos.min()) < 0 or int(q_pos.max()) >= n):
        raise ValueError(f"q_pos must lie in [0, {n}), got [{int(q_pos.min())}, {int(q_pos.max())}]")

    # Sort rows by position so each block's largest position, where its key loop stops, is small.
    order = torch.argsort(q_pos, dim=1)
    pos_sorted = torch.gather(q_pos, 1, order).to(torch.int32).contiguous()
    q_sorted = torch.gather(q, 2, order[:, None, :, None].expand(b, h, m, d))
    out = torch.empty_like(q_sorted)
    lse = torch.empty((b, h, m), dtype=torch.float32, device=q.device)
    if m == 0:
        return out, lse
    scale = float(scale) if scale is not None else d**-0.5
    grid = (triton.cdiv(m, block_m), b * h)
    _sparse_query_fwd[grid](
        q_sorted, k, v, pos_sorted, out, lse,
        *q_sorted.stride(), *k.stride(), *v.stride(), *pos_sorted.stride(), *out.stride(), *lse.stride(),
        m, n, h, scale,
        WINDOW=window or 0, GROUP=h // h_kv, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_FP32=q.dtype == torch.float32 or _interpreting(),
    )
    inverse = torch.argsort(order, dim=1)
    out = torch.gather(out, 2, inverse[:, None, :, None].expand(b, h, m, d))
    lse = torch.gather(lse, 2, inverse[:, None, :].expand(b, h, m))
    return out, lse


def sparse_query_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
):
    """Exact causal-by-position attention for scattered query rows (see the module docstring).

    q: [B, H, M, D]; k, v: [B, H_kv, N, D]; q_pos: [B, M] int positions in [0, N); window: a
    sliding window (a row sees keys at distance < window), None for full causal attention.
    Returns out [B, H, M, D] (and lse [B, H, M] fp32 with return_lse).
    """
    if block_m is None:
        block_m = 64
    if block_n is None:
        block_n = 256 if _interpreting() else 64  # large blocks keep the interpreter fast
    out, lse = _launch(q, k, v, q_pos, scale, block_m, block_n, window)
    return (out, lse) if return_lse else out
