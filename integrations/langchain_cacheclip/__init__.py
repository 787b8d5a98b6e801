"""LangChain adapters for cacheclip-rag: `CacheClipLLM` (a `BaseLLM`) and `CacheClipRetriever`."""

from .llms import CacheClipLLM
from .retrievers import CacheClipRetriever

__all__ = ["CacheClipLLM", "CacheClipRetriever"]
