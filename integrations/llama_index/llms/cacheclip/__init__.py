"""LlamaIndex adapters for cacheclip-rag.

`CacheClipLLM` (a `CustomLLM`), `CacheClipEmbedding` (the engine's embedder, so an index needs
no other model), `chunk_nodes` / `ingest_nodes` (engine chunks <-> LlamaIndex nodes) and
`CacheClipQueryEngine` (hands node ids to the engine instead of recognising texts).
"""

from .base import (
    CacheClipEmbedding,
    CacheClipLLM,
    CacheClipQueryEngine,
    chunk_nodes,
    ingest_nodes,
)

__all__ = ["CacheClipEmbedding", "CacheClipLLM", "CacheClipQueryEngine", "chunk_nodes", "ingest_nodes"]
