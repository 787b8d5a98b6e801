"""Sparse-query attention: exact causal-by-position attention (optionally within a sliding
window) for a scattered set of query rows.

Importable without a GPU and without Triton: `sparse_query_attention_ref` is the plain-torch
reference (every kernel test's oracle); `blocked_attention` is the engine's CPU path (sorted
rows in a few blocks, each over only the keys it can see); `sparse_query_attention`, the Triton
kernel, imports Triton when first called.
"""

from .blocked import BlockPlan, blocked_attention, default_kind
from .reference import causal_position_mask, sparse_query_attention_ref


def sparse_query_attention(q, k, v, q_pos, *, scale=None, return_lse=False, block_m=None, block_n=None, window=None):
    """Triton forward kernel; see `cacheclip_kernels.sparse_query` for the contract."""
    try:
        from .sparse_query import sparse_query_attention as kernel
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError("the Triton kernel needs `pip install triton` (a GPU build, or TRITON_INTERPRET=1 on CPU)") from err
    return kernel(q, k, v, q_pos, scale=scale, return_lse=return_lse, block_m=block_m, block_n=block_n, window=window)


__all__ = ["BlockPlan", "blocked_attention", "causal_position_mask", "default_kind", "sparse_query_attention", "sparse_query_attention_ref"]
