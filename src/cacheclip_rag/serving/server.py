"""`cacheclip serve`: the engine behind an OpenAI-compatible HTTP API, and a web page.

    POST /v1/chat/completions   messages through the primary's chat template
    POST /v1/completions        a finished prompt (stored chunk texts in it are reused)
    GET  /v1/models             the one model served
    POST /v1/documents          ingest {"documents": [text | {"title", "text"}, ...]} -> chunk ids
    POST /v1/retrieve           {"query", "k"} -> [{"id", "score", "text"}]
    GET  /v1/stats              store counters (memory-tier hits, store reads, misses)
    GET  /health                liveness and load
    GET  /                      the web page (static; talks to the API above)

Both completion routes take the OpenAI fields (model, max_tokens, temperature, stop, stream,
seed) and CacheClip's per-request options (`request.RequestOptions`) as extra body fields, with
chunk_ids, k and retrieve; every response carries a `cacheclip` object with
the reuse metadata (chunks reused, tokens cached and computed, effective fraction, timings) and,
for the page, the recomputed character spans of each chunk. Streaming is server-sent events in
OpenAI's chunk format, ending with `data: [DONE]`.

With keys (`access.Keys`: an API key to ask, an admin key to also ingest), every route but
/health and the page needs `Authorization: Bearer <key>` (401 / 403 otherwise, `access.py`).

The routes are module-level functions over `app.state.serving` (`create_app` builds it).
Requests run on worker threads, at most `max_active` at once; up to `max_waiting` more wait,
and beyond that a request gets 503 at once. A client that disconnects mid-stream stops its
generation at the next token and frees its slot. Bad input is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from importlib import resources
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..engine import CacheClipEngine
from ..request.answer import Answer, AnswerStream
from ..request.options import DEFAULTS, RequestOptions
from ..storage.backends.base import StoreUnavailableError
from ..storage.store import hit_rate
from .access import Keys, RequireKeys

log = logging.getLogger(__name__)

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


class Gate:
    """At most `active` requests run; up to `waiting` more queue; beyond that, 503."""

    def __init__(self, active: int, waiting: int):
        self.active, self.waiting = active, waiting
        self._sem: asyncio.Semaphore | None = None
        self.running = 0
        self.queued = 0

    async def enter(self) -> None:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.active)
        if self._sem.locked():
            if self.queued >= self.waiting:
                raise HTTPException(503, f"server busy: {self.active} requests running and {self.queued} waiting; retry later")
            self.queued += 1
            try:
                await self._sem.acquire()
            finally:
                self.queued -= 1
        else:
            await self._sem.acquire()
        self.running += 1

    def leave(self) -> None:
        self.running -= 1
        self._sem.release()


def selection_spans(trace: list[dict]) -> list[dict]:
    """Per chunk of a CacheClip request: its text and the character spans whose tokens were
    recomputed (merged), for the page's heat map."""
    out = []
    for entry in trace:
        offsets, mask = entry["primary_offsets"], entry["recomputed"]
        spans: list[list[int]] = []
        for (start, end), hit in zip(offsets.tolist(), mask.tolist()):
            if not hit or end <= start:
                continue
            if spans and start <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], end)
            else:
                spans.append([start, end])
        out.append({"chunk_id": entry["chunk_id"], "text": entry["text"], "recomputed": spans})
    return out


def _produce(stream: AnswerStream, queue: asyncio.Queue, stop: threading.Event, loop: asyncio.AbstractEventLoop) -> None:
    """Worker thread: decode the stream into the event loop's queue until it ends or `stop`."""
    try:
        for piece in stream:
            if stop.is_set():
                return
            loop.call_soon_threadsafe(queue.put_nowait, ("piece", piece))
        loop.call_soon_threadsafe(queue.put_nowait, ("done", stream.answer))
    except Exception as err:  # noqa: BLE001 - reported to the client as an error event
        log.exception("generation failed")
        loop.call_soon_threadsafe(queue.put_nowait, ("error", err))


def _metadata(answer: Answer, trace: list[dict]) -> dict:
    meta = answer.metadata()
    meta["ttft_s"] = answer.timings.get("ttft")
    meta["selection"] = selection_spans(trace)
    return meta


def _usage(answer: Answer) -> dict:
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.generated_tokens,
            "total_tokens": answer.prompt_tokens + answer.generated_tokens}


def _finish_reason(answer: Answer, max_new: int) -> str:
    return "length" if answer.generated_tokens >= max_new else "stop"


@dataclass
class Serving:
    """What the routes share, kept on `app.state.serving`: the engine, the gate, the worker
    threads, the model name answered with, and the default max_tokens."""

    engine: CacheClipEngine
    gate: Gate
    pool: ThreadPoolExecutor
    served: str
    default_max_tokens: int

    async def in_thread(self, fn: Callable, *args) -> Any:
        """fn(*args) on a worker thread; the engine's ValueError is a 400, a store outage a 503."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        except StoreUnavailableError as err:  # a ValueError too: caught first
            raise HTTPException(503, f"store unavailable: {err}") from err
        except ValueError as err:
            raise HTTPException(400, str(err)) from err


def _serving(request: Request) -> Serving:
    return request.app.state.serving


def _check_size(*texts: str) -> None:
    if sum(len(t) for t in texts) > MAX_BODY_CHARS:
        raise HTTPException(413, f"the request text is over {MAX_BODY_CHARS} characters (what the model's context could hold)")


async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
    first = err.errors()[0] if err.errors() else {}
    field_name = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
    message = f"{field_name}: {first.get('msg', 'invalid')}"
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": field_name}}, 400)


async def _http_error(request: Request, err: HTTPException) -> JSONResponse:
    kind = "server_busy" if err.status_code == 503 else "invalid_request_error"
    return JSONResponse({"error": {"message": str(err.detail), "type": kind}}, err.status_code)


async def _complete(state: Serving, body: Options, start: Callable[[], AnswerStream], kind: str) -> Any:
    """Run one completion (streamed or not) inside a gate slot."""
    await state.gate.enter()
    max_new = body.new_tokens(state.default_max_tokens)
    try:
        stream = await state.in_thread(start)
    except BaseException:
        state.gate.leave()
        raise
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    if not body.stream:
        try:
            answer = await state.in_thread(stream.collect)
        finally:
            state.gate.leave()
        choice = {"index": 0, "finish_reason": _finish_reason(answer, max_new)}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": answer.text}
        else:
            choice["text"] = answer.text
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
                "model": state.served, "choices": [choice], "usage": _usage(answer),
                "cacheclip": _metadata(answer, stream.trace)}
    # Generation starts now, on a worker thread, and frees the slot when it ends, whether or
    # not the client ever reads the stream; a client that goes away sets `stop`.
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(state.pool, _produce, stream, queue, stop, loop)
    future.add_done_callback(lambda _: state.gate.leave())
    events = _events(state.served, stream, queue, stop, rid, created, kind, max_new)
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(served: str, stream: AnswerStream, queue: asyncio.Queue, stop: threading.Event, rid: str,
                  created: int, kind: str, max_new: int) -> AsyncIterator[str]:
    """The server-sent events of one streamed completion, in OpenAI's chunk format."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def event(delta: str | None, finish: str | None = None, **extra) -> str:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if kind == "chat":
            choice["delta"] = {"content": delta} if delta is not None else {}
        else:
            choice["text"] = delta or ""
        return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": served,
                                      "choices": [choice], **extra}) + "\n\n"

    try:
        if kind == "chat":
            yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": served, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}) + "\n\n"
        while True:
            what, item = await queue.get()
            if what == "piece":
                yield event(item)
            elif what == "done":
                yield event(None, _finish_reason(item, max_new), usage=_usage(item),
                            cacheclip=_metadata(item, stream.trace))
                break
            else:
                yield "data: " + json.dumps({"error": {"message": str(item), "type": "server_error"}}) + "\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        stop.set()  # a client gone mid-stream: generation stops at its next token


router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatBody, request: Request):
    state = _serving(request)
    try:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    except ValueError as err:
        raise HTTPException(400, str(err)) from err
    _check_size(*(m["content"] for m in messages))
    opts = body.request_options(state.default_max_tokens)
    return await _complete(state, body, lambda: state.engine.stream_chat(
        messages, body.chunk_ids, retrieve=body.retrieve, k=body.k, **opts), "chat")


@router.post("/v1/completions")
async def completions(body: CompletionBody, request: Request):
    state = _serving(request)
    _check_size(body.prompt)
    opts = body.request_options(state.default_max_tokens)
    return await _complete(state, body, lambda: state.engine.stream_generate(
        body.prompt, body.chunk_ids, retrieve=body.retrieve, k=body.k, **opts), "text")


@router.get("/v1/models")
async def models(request: Request):
    served = _serving(request).served
    return {"object": "list", "data": [{"id": served, "object": "model", "created": 0, "owned_by": "cacheclip-rag"}]}


@router.post("/v1/documents")
async def documents(body: DocumentsBody, request: Request):
    state = _serving(request)
    _check_size(*(d if isinstance(d, str) else str(d.get("text", "")) for d in body.documents))
    await state.gate.enter()
    try:
        ids = await state.in_thread(lambda: state.engine.ingest(body.documents, progress=False, split=body.split,
                                                                packets=body.packets))
    finally:
        state.gate.leave()
    return {"object": "list", "chunk_ids": ids, "chunks": len(set(ids))}


@router.post("/v1/retrieve")
async def retrieve(body: RetrieveBody, request: Request):
    state = _serving(request)
    _check_size(body.query)
    hits = await state.in_thread(state.engine.retrieve, body.query, body.k)
    chunks = dict(await state.in_thread(state.engine.chunk_texts, [cid for cid, _ in hits]))
    return {"object": "list", "data": [{"id": cid, "score": score, "text": chunks[cid]} for cid, score in hits]}


@router.get("/health")
async def health(request: Request):
    state = _serving(request)
    gate, info = state.gate, state.engine.info()  # cheap: no model runs
    return {"status": "ok", "model": state.served, "aux": info["aux"], "running": gate.running,
            "waiting": gate.queued, "max_active": gate.active, "max_waiting": gate.waiting,
            "chunks": info["chunks"], "modes": info["modes"]}


@router.get("/v1/stats")
async def stats(request: Request):
    """The engine's (or replicas') store counters: how often a request's caches came from memory."""
    counters = _serving(request).engine.stats()
    return {**counters, "memory_hit_rate": hit_rate(counters), "primary_memory_hit_rate": hit_rate(counters, "primary_")}


@router.get("/", response_class=HTMLResponse)
async def page():
    return (resources.files("cacheclip_rag.serving") / "web" / "index.html").read_text()


def create_app(engine: CacheClipEngine, *, max_active: int = 2, max_waiting: int = 8,
               default_max_tokens: int = DEFAULTS.max_new_tokens, model_name: str | None = None,
               keys: Keys | None = None) -> FastAPI:
    """The HTTP app over one engine (which it does not close). keys: the bearer keys required
    (`access.Keys`; None or empty: none)."""
    pool = ThreadPoolExecutor(max_workers=max_active + 1, thread_name_prefix="cacheclip-serve")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="cacheclip-rag", version="1", docs_url="/docs", lifespan=lifespan)
    app.state.serving = Serving(engine, Gate(max_active, max_waiting), pool, model_name or engine.info()["model"],
                                default_max_tokens)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http_error)
    app.include_router(router)
    if keys is not None and keys.enabled:
        app.add_middleware(RequireKeys, keys=keys)
    return app


def serve(engine: CacheClipEngine, host: str = "127.0.0.1", port: int = 8000, **limits) -> None:
    """Run the app with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(create_app(engine, **limits), host=host, port=port, log_level="info")


class BackgroundServer:
    """The app served by uvicorn on a daemon thread (tests and `bench http`); `stop()` ends it.
    port 0 picks a free port; `url` is where it listens once started."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
        import socket

        import uvicorn

        if port == 0:
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="cacheclip-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
