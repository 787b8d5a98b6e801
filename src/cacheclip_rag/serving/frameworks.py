"""What the LangChain and LlamaIndex LLMs share: their fields, loading, and how a call starts.

Only the framework integrations under `integrations/` import this module (it needs pydantic, which both
frameworks bring); each adds its framework's methods on top and stays a thin translation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..engine import AnswerStream
from ..request.options import DEFAULTS, request_options

INSTANCE_OPTIONS = ("mode", "recompute_ratio", "max_new_tokens", "temperature")
"""The `RequestOptions` an LLM instance holds as fields (with their defaults there); every
per-call option (`request.REQUEST_OPTIONS`) can be given per call."""


class EngineLLMFields(BaseModel):
    """Per-instance defaults of an LLM adapter; every per-call option (`request.REQUEST_OPTIONS`)
    can override them."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: Any = Field(exclude=True, description="a cacheclip_rag.CacheClipEngine")
    mode: str = DEFAULTS.mode
    recompute_ratio: float | str = Field(default=DEFAULTS.recompute_ratio,
                                         description='a number in [0, 1], or "auto" (the selector decides per request)')
    max_new_tokens: int = DEFAULTS.max_new_tokens
    temperature: float = DEFAULTS.temperature
    k: int | None = Field(default=None, description="chunks to retrieve for a bare question (engine default when None)")
    retrieve: bool = Field(default=True, description="answer a prompt holding no stored chunk text from the engine's retrieval")

    @classmethod
    def from_pretrained(cls, primary: str | None = None, aux: str | None = None, store_dir: str = "cacheclip-store",
                        config=None, **kwargs: Any):
        """Load the engine (the embedded default models unless named) and wrap it."""
        from .. import DEFAULT_AUX, DEFAULT_PRIMARY, CacheClipEngine

        engine = CacheClipEngine.from_pretrained(primary=primary or DEFAULT_PRIMARY, aux=aux or DEFAULT_AUX,
                                                 store_dir=store_dir, config=config)
        return cls(engine=engine, **kwargs)

    def _defaults(self) -> dict[str, Any]:
        return {"k": self.k, **{name: getattr(self, name) for name in INSTANCE_OPTIONS}}

    def start(self, prompt: str, overrides: dict[str, Any], **fixed: Any) -> AnswerStream:
        """Stream the answer to a framework's finished prompt. overrides: per-call options (an unknown
        one is a ValueError); fixed: what the framework passes itself (LangChain's stop)."""
        opts = request_options(self._defaults(), overrides)
        return self.engine.stream_generate(prompt, opts.pop("chunk_ids", None), retrieve=self.retrieve, **fixed, **opts)

    def start_chat(self, messages: list[dict], overrides: dict[str, Any], **fixed: Any) -> AnswerStream:
        """Stream the answer to a conversation ([{"role", "content"}]) through the engine's chat
        path (chunk texts in the messages reused; retrieval when none, if `retrieve`)."""
        opts = request_options(self._defaults(), overrides)
        return self.engine.stream_chat(messages, opts.pop("chunk_ids", None), retrieve=self.retrieve, **fixed, **opts)


async def apieces(stream: AnswerStream) -> AsyncIterator[str]:
    """The stream's text pieces, each decoding step in a worker thread (contextvars copied), so
    the event loop is never blocked."""
    done = object()
    while (piece := await asyncio.to_thread(next, stream, done)) is not done:
        yield piece
