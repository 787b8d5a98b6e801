"""`CacheClipLLM`: the engine behind LangChain's `BaseLLM` interface.

LangChain hands an LLM only the final prompt string. The engine finds the stored chunk texts in
it and reuses their caches (any prompt template works); a prompt with no stored chunk is taken as
a bare question and answered from the engine's own top-k retrieval, so one object can be a whole
RAG pipeline. Per-call options: any of `cacheclip_rag.request.options.REQUEST_OPTIONS` (`recompute_ratio`,
`mode`, `chunk_ids`, `k`, `budget`, `score_layers`, ...).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models.llms import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from langchain_core.runnables.config import run_in_executor

from cacheclip_rag.serving.frameworks import EngineLLMFields, apieces


class CacheClipLLM(EngineLLMFields, BaseLLM):
    """A LangChain LLM that answers from reused chunk KV caches (CacheClip). Fields and
    `from_pretrained`: `cacheclip_rag.serving.frameworks.EngineLLMFields`.

    Example:
        llm = CacheClipLLM.from_pretrained(store_dir="store")
        chain = retriever | format_docs | prompt | llm       # chunks recognised in the prompt
        llm.invoke("What is ...?")                           # bare question: engine retrieval
        llm.invoke(prompt, recompute_ratio=0.1, chunk_ids=[...])
    """

    @property
    def _llm_type(self) -> str:
        return "cacheclip"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "primary": self.engine.primary.lm.name,
            "aux": self.engine.aux.lm.name,
            "mode": self.mode,
            "recompute_ratio": self.recompute_ratio,
            "max_new_tokens": self.max_new_tokens,
        }

    def _start(self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]):
        return self.start(prompt, kwargs, stop=stop)

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        generations = []
        for prompt in prompts:
            stream = self._start(prompt, stop, kwargs)
            for piece in stream:
                if run_manager:
                    run_manager.on_llm_new_token(piece)
            generations.append([Generation(text=stream.answer.text, generation_info=stream.answer.metadata())])
        return LLMResult(generations=generations, llm_output={"model": self._llm_type})

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        stream = self._start(prompt, stop, kwargs)
        for piece in stream:
            chunk = GenerationChunk(text=piece)
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=stream.answer.metadata())

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        generations = []
        for prompt in prompts:
            text, info = "", {}
            async for chunk in self._astream(prompt, stop, run_manager, **kwargs):
                text += chunk.text
                info = chunk.generation_info or info
            generations.append([Generation(text=text.strip(), generation_info=info)])
        return LLMResult(generations=generations, llm_output={"model": self._llm_type})

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        """Each decoding step runs in a worker thread, so the event loop is never blocked."""
        stream = await run_in_executor(None, self._start, prompt, stop, kwargs)
        async for piece in apieces(stream):
            chunk = GenerationChunk(text=piece)
            if run_manager:
                await run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=stream.answer.metadata())
