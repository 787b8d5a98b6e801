"""LangChain adapters for cacheclip-rag: `CacheClipLLM` (a `BaseLLM`), `ChatCacheClip` (a
`BaseChatModel`) and `CacheClipRetriever`."""

from .chat_models import ChatCacheClip
from .llms import CacheClipLLM
from .retrievers import CacheClipRetriever

__all__ = ["CacheClipLLM", "CacheClipRetriever", "ChatCacheClip"]
