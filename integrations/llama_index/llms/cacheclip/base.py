"""LlamaIndex classes over a `cacheclip_rag.CacheClipEngine`; they only adapt its interface."""

from __future__ import annotations

import asyncio
from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
)
from llama_index.core.base.response.schema import Response
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import BaseNode, MetadataMode, TextNode
from pydantic import ConfigDict, PrivateAttr

from cacheclip_rag.serving.frameworks import EngineLLMFields, apieces


class CacheClipLLM(EngineLLMFields, CustomLLM):
    """A LlamaIndex LLM answering from reused chunk KV caches (CacheClip).

    Chunk texts found in the prompt are reused (LlamaIndex's metadata header before a node's
    text is simply recomputed); a prompt with no stored chunk is answered from the engine's own
    retrieval. Chat goes through the primary's chat template (`CacheClipEngine.chat`): chunk
    texts in any message are reused, a conversation with none is answered from retrieval.
    """

    @classmethod
    def class_name(cls) -> str:
        return "CacheClipLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.engine.primary.lm.max_positions,
            num_output=self.max_new_tokens,
            model_name=f"cacheclip:{self.engine.primary.lm.name}+{self.engine.aux.lm.name}",
            is_chat_model=True,
        )

    def _start(self, prompt: str, kwargs: dict[str, Any]):
        return self.start(prompt, {key: v for key, v in kwargs.items() if key != "formatted"})

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        stream = self._start(prompt, kwargs)
        for _ in stream:
            pass
        return CompletionResponse(text=stream.answer.text, additional_kwargs=stream.answer.metadata())

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        stream = self._start(prompt, kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in stream:
                text += piece
                yield CompletionResponse(text=text, delta=piece)
            yield CompletionResponse(text=text, delta="", additional_kwargs=stream.answer.metadata())

        return gen()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Runs in a worker thread: the event loop stays free."""
        stream = await asyncio.to_thread(self._start, prompt, kwargs)
        await asyncio.to_thread(lambda: [None for _ in stream])
        return CompletionResponse(text=stream.answer.text, additional_kwargs=stream.answer.metadata())

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        stream = await asyncio.to_thread(self._start, prompt, kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async for piece in apieces(stream):
                text += piece
                yield CompletionResponse(text=text, delta=piece)
            yield CompletionResponse(text=text, delta="", additional_kwargs=stream.answer.metadata())

        return gen()


    # ----- chat: messages through the chat template ---------------------------------------

    def _start_chat(self, messages: list[ChatMessage], kwargs: dict[str, Any]):
        turns = []
        for i, m in enumerate(messages):
            role = getattr(m.role, "value", m.role)
            if role not in ("system", "user", "assistant"):
                raise ValueError(f"message {i} has role {role!r}; CacheClipLLM chats with system, user and assistant messages")
            turns.append({"role": role, "content": m.content or ""})
        return self.start_chat(turns, {key: v for key, v in kwargs.items() if key != "formatted"})

    @staticmethod
    def _reply(text: str, stream, delta: str | None = None, done: bool = False) -> ChatResponse:
        extra = stream.answer.metadata() if done else {}
        return ChatResponse(message=ChatMessage(role="assistant", content=text), delta=delta, additional_kwargs=extra)

    @llm_chat_callback()
    def chat(self, messages: list[ChatMessage], **kwargs: Any) -> ChatResponse:
        stream = self._start_chat(messages, kwargs)
        for _ in stream:
            pass
        return self._reply(stream.answer.text, stream, done=True)

    @llm_chat_callback()
    def stream_chat(self, messages: list[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        stream = self._start_chat(messages, kwargs)

        def gen() -> ChatResponseGen:
            text = ""
            for piece in stream:
                text += piece
                yield self._reply(text, stream, piece)
            yield self._reply(text, stream, "", done=True)

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: list[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Runs in a worker thread: the event loop stays free."""
        stream = await asyncio.to_thread(self._start_chat, messages, kwargs)
        await asyncio.to_thread(lambda: [None for _ in stream])
        return self._reply(stream.answer.text, stream, done=True)

    @llm_chat_callback()
    async def astream_chat(self, messages: list[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        stream = await asyncio.to_thread(self._start_chat, messages, kwargs)

        async def gen() -> ChatResponseAsyncGen:
            text = ""
            async for piece in apieces(stream):
                text += piece
                yield self._reply(text, stream, piece)
            yield self._reply(text, stream, "", done=True)

        return gen()


class CacheClipEmbedding(BaseEmbedding):
    """The engine's sentence-transformers embedder as a LlamaIndex embedding model."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    _engine: Any = PrivateAttr()

    def __init__(self, engine, **kwargs: Any):
        super().__init__(model_name=engine.config.embedder, **kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "CacheClipEmbedding"

    def _embed(self, texts: list[str]) -> list[list[float]]:
        return self._engine.index.embedder.encode(texts, normalize_embeddings=True, show_progress_bar=False).tolist()

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embed([query])[0]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embed([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embed(texts)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return await asyncio.to_thread(self._get_query_embedding, query)


def chunk_nodes(engine, chunk_ids: list[str] | None = None) -> list[TextNode]:
    """The engine's chunks as nodes whose id is the chunk id (build an index from these)."""
    chunks = engine.store.chunks() if chunk_ids is None else [engine.store.get_chunk(c) for c in chunk_ids]
    return [TextNode(id_=c.id, text=c.text, metadata={"source": c.source}) for c in chunks if c is not None]


def ingest_nodes(engine, nodes: list[BaseNode], progress: bool = False) -> list[str]:
    """Cache a pipeline's own nodes verbatim (their text, without the metadata header)."""
    docs = [{"text": n.get_content(metadata_mode=MetadataMode.NONE), "source": n.node_id} for n in nodes]
    return engine.ingest(docs, progress=progress, split=False)


class CacheClipQueryEngine(CustomQueryEngine):
    """Retrieve nodes, then answer with their ids: no recognition needed, order kept."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: BaseRetriever
    llm: CacheClipLLM

    def custom_query(self, query_str: str) -> Response:
        nodes = self.retriever.retrieve(query_str)
        engine = self.llm.engine
        ids = [n.node.node_id for n in nodes]
        unknown = [n.node for n in nodes if engine.store.get_chunk(n.node.node_id) is None]
        if unknown:  # nodes that are not engine chunks: cache their texts first
            known = dict(zip([n.node_id for n in unknown], ingest_nodes(engine, unknown)))
            ids = [known.get(i, i) for i in ids]
        answer = engine.answer(
            query_str,
            chunk_ids=ids,
            mode=self.llm.mode,
            recompute_ratio=self.llm.recompute_ratio,
            max_new_tokens=self.llm.max_new_tokens,
        )
        return Response(response=answer.text, source_nodes=nodes, metadata=answer.metadata())
