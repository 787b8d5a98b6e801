"""`ChatCacheClip`: the engine behind LangChain's `BaseChatModel` interface.

Messages go through the primary model's chat template (`CacheClipEngine.chat`): stored chunk
texts found in any message's content are reused from their caches (so a chain that stuffs
retrieved documents into a system or human message gets reuse), and a conversation holding none
is answered from the engine's own retrieval for its last message. Per-call options: any of
`cacheclip_rag.request.options.REQUEST_OPTIONS`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables.config import run_in_executor

from cacheclip_rag.serving.frameworks import EngineLLMFields, apieces

_ROLES = ((SystemMessage, "system"), (HumanMessage, "user"), (AIMessage, "assistant"))


def to_messages(messages: list[BaseMessage]) -> list[dict]:
    """LangChain messages as the engine's [{"role", "content"}]; other kinds (tools) are a ValueError."""
    out = []
    for i, message in enumerate(messages):
        role = next((r for cls, r in _ROLES if isinstance(message, cls)), None)
        if role is None:
            raise ValueError(f"message {i} is a {type(message).__name__}; ChatCacheClip takes system, human and AI messages")
        out.append({"role": role, "content": message.text if not isinstance(message.content, str) else message.content})
    return out


def _usage(answer) -> UsageMetadata:
    return UsageMetadata(input_tokens=answer.prompt_tokens, output_tokens=answer.generated_tokens,
                         total_tokens=answer.prompt_tokens + answer.generated_tokens)


class ChatCacheClip(EngineLLMFields, BaseChatModel):
    """A LangChain chat model that answers from reused chunk KV caches (CacheClip). Fields and
    `from_pretrained`: `cacheclip_rag.serving.frameworks.EngineLLMFields`.

    Example:
        chat = ChatCacheClip.from_pretrained(store_dir="store")
        chat.invoke([("system", "Context:\\n" + docs), ("human", "Which team built the sensor?")])
        chat.invoke("Which team built the sensor?", recompute_ratio=0.1)   # engine retrieval
    """

    @property
    def _llm_type(self) -> str:
        return "cacheclip-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"primary": self.engine.primary.lm.name, "aux": self.engine.aux.lm.name, "mode": self.mode,
                "recompute_ratio": self.recompute_ratio, "max_new_tokens": self.max_new_tokens}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any):
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_model_name"] = kwargs.get("model", self.engine.primary.lm.name)
        params["ls_max_tokens"] = kwargs.get("max_new_tokens", self.max_new_tokens)
        return params

    def _start(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]):
        return self.start_chat(to_messages(messages), kwargs, stop=stop)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        stream = self._start(messages, stop, kwargs)
        for piece in stream:
            if run_manager:
                run_manager.on_llm_new_token(piece)
        answer = stream.answer
        message = AIMessage(content=answer.text, response_metadata={**answer.metadata(), "model_name": self._llm_type},
                            usage_metadata=_usage(answer))
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        stream = self._start(messages, stop, kwargs)
        for piece in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        answer = stream.answer
        yield ChatGenerationChunk(message=AIMessageChunk(content="", usage_metadata=_usage(answer), chunk_position="last",
                                                         response_metadata=answer.metadata()))

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        """Each decoding step runs in a worker thread, so the event loop is never blocked."""
        stream = await run_in_executor(None, self._start, messages, stop, kwargs)
        async for piece in apieces(stream):
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager:
                await run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        answer = stream.answer
        yield ChatGenerationChunk(message=AIMessageChunk(content="", usage_metadata=_usage(answer), chunk_position="last",
                                                         response_metadata=answer.metadata()))

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        text, last = "", None
        async for chunk in self._astream(messages, stop, run_manager, **kwargs):
            text += chunk.message.content
            last = chunk.message
        message = AIMessage(content=text, response_metadata={**last.response_metadata, "model_name": self._llm_type},
                            usage_metadata=last.usage_metadata)
        return ChatResult(generations=[ChatGeneration(message=message)])
