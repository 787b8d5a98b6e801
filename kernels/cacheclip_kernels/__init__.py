"""Sparse-query attention: exact causal-by-position attention for a scattered set of query rows.

Importable without a GPU. `sparse_query_attention_ref` is the plain-torch reference that the
engine uses on CPU and that every kernel is tested against.
"""

from .reference import sparse_query_attention_ref

__all__ = ["sparse_query_attention_ref"]
