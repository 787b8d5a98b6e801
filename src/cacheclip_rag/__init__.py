"""cacheclip-rag: RAG that reuses precomputed chunk KV caches and recomputes only what matters."""

from .config import (
    ChunkConfig,
    EngineConfig,
    IndexConfig,
    ModelConfig,
    PromptConfig,
    SelectConfig,
    StoreConfig,
)
from .engine import CacheClipEngine
from .models.loading import DEFAULT_AUX, DEFAULT_PRIMARY
from .request.answer import Answer, AnswerStream
from .request.options import RequestOptions

__all__ = [
    "Answer",
    "AnswerStream",
    "CacheClipEngine",
    "ChunkConfig",
    "DEFAULT_AUX",
    "DEFAULT_PRIMARY",
    "EngineConfig",
    "IndexConfig",
    "ModelConfig",
    "PromptConfig",
    "RequestOptions",
    "SelectConfig",
    "StoreConfig",
]
__version__ = "0.1.0"
