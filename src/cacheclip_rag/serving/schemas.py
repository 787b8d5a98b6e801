"""The request bodies of `cacheclip serve`'s routes (pydantic: a bad field is a 400 naming it),
and the size every request's text is held to."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Literal

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field

from ..request.options import RequestOptions

MAX_BODY_CHARS = 512_000
"""Request text over this many characters is refused (413) before any tokenization: four times
what fits the default primary's 32K-token context."""


OPENAI_FIELDS = {"max_new_tokens": ("max_tokens", "max_completion_tokens")}
"""`RequestOptions` fields an OpenAI body carries under its own names; every other field is a body
field of the same name (tests/serving/test_server.py checks that each one is)."""


class Options(BaseModel):
    """The fields both completion routes share (OpenAI's, then CacheClip's)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    stop: str | list[str] | None = None
    stream: bool = False
    seed: int | None = None
    # OpenAI fields accepted only at the value that means "nothing special" (the engine has no such knob).
    n: Literal[1] = 1
    top_p: Literal[1] | None = None
    frequency_penalty: Literal[0] | None = None
    presence_penalty: Literal[0] | None = None
    logprobs: Literal[False] | None = None
    # Bookkeeping fields clients send; ignored.
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    stream_options: dict | None = None
    # CacheClip's per-request options (`RequestOptions`; unset: its defaults), and which chunks.
    mode: str | None = None
    recompute_ratio: float | Literal["auto"] | None = None
    epic_tokens: int | None = None
    budget: str | None = None
    score_layers: list[int] | None = None
    aux_context: str | None = None
    chunk_ids: list[str] | None = None
    k: int | None = None
    retrieve: bool = True

    def new_tokens(self, default_max: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default_max

    def request_options(self, default_max: int) -> dict[str, Any]:
        """The engine's per-request options: every `RequestOptions` field the body sets (under its
        own name; max_new_tokens from OpenAI's max_tokens), the rest left to their defaults."""
        out: dict[str, Any] = {"max_new_tokens": self.new_tokens(default_max)}
        for f in fields(RequestOptions):
            if f.name in OPENAI_FIELDS:
                continue
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = value
        return out


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str | list[dict]

    def text(self) -> str:
        """The content as text (OpenAI's list-of-parts form: the text parts joined)."""
        if isinstance(self.content, str):
            return self.content
        parts = [p.get("text") for p in self.content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) != len(self.content) or not all(isinstance(p, str) for p in parts):
            raise ValueError("messages[].content: only text parts are supported")
        return "".join(parts)


class ChatBody(Options):
    messages: list[Message] = Field(min_length=1)


class CompletionBody(Options):
    prompt: str


class DocumentsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    documents: list[str | dict] = Field(min_length=1)
    split: bool = True
    packets: bool = False


class RetrieveBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1)
    k: int | None = Field(default=None, ge=1, le=1024)


def check_size(*texts: str) -> None:
    if sum(len(t) for t in texts) > MAX_BODY_CHARS:
        raise HTTPException(413, f"the request text is over {MAX_BODY_CHARS} characters (what the model's context could hold)")
