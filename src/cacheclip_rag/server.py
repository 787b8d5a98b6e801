"""`cacheclip serve`: the engine behind an OpenAI-compatible HTTP API, and a web page (issue 18).

    POST /v1/chat/completions   messages through the primary's chat template
    POST /v1/completions        a finished prompt (stored chunk texts in it are reused)
    GET  /v1/models             the one model served
    POST /v1/documents          ingest {"documents": [text | {"title", "text"}, ...]} -> chunk ids
    POST /v1/retrieve           {"query", "k"} -> [{"id", "score", "text"}]
    GET  /health                liveness and load
    GET  /                      the web page (static; talks to the API above)

Both completion routes take the OpenAI fields (model, max_tokens, temperature, stop, stream,
seed) and CacheClip's per-request options as extra body fields (mode, recompute_ratio,
chunk_ids, k, retrieve, budget, score_layers, aux_context); every response carries a `cacheclip` object with
the reuse metadata (chunks reused, tokens cached and computed, effective fraction, timings) and,
for the page, the recomputed character spans of each chunk. Streaming is server-sent events in
OpenAI's chunk format, ending with `data: [DONE]`.

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
from importlib import resources
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .answer import Answer, AnswerStream
from .engine import CacheClipEngine
from .backends.base import StoreUnavailableError

log = logging.getLogger(__name__)

MAX_BODY_CHARS = 512_000
"""Request text over this many characters is refused (413) before any tokenization: four times
what fits the default primary's 32K-token context."""


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
    # CacheClip's per-request options.
    mode: str | None = None
    recompute_ratio: float | None = None
    chunk_ids: list[str] | None = None
    k: int | None = None
    retrieve: bool = True
    budget: str | None = None
    score_layers: list[int] | None = None
    aux_context: str | None = None

    def new_tokens(self, default_max: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default_max

    def request_options(self, default_max: int) -> dict[str, Any]:
        """The engine's per-request options (unset ones left to its defaults)."""
        out: dict[str, Any] = {"max_new_tokens": self.new_tokens(default_max), "temperature": self.temperature}
        for name in ("mode", "recompute_ratio", "budget", "score_layers", "aux_context", "seed"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.stop is not None:
            out["stop"] = self.stop
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


def create_app(engine: CacheClipEngine, *, max_active: int = 2, max_waiting: int = 8, default_max_tokens: int = 256,
               model_name: str | None = None) -> FastAPI:
    """The HTTP app over one engine (which it does not close)."""
    pool = ThreadPoolExecutor(max_workers=max_active + 1, thread_name_prefix="cacheclip-serve")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="cacheclip-rag", version="1", docs_url="/docs", lifespan=lifespan)
    gate = Gate(max_active, max_waiting)
    served = model_name or engine.primary.lm.name
    app.state.gate, app.state.engine = gate, engine

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        field = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
        message = f"{field}: {first.get('msg', 'invalid')}"
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": field}}, 400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException) -> JSONResponse:
        kind = "server_busy" if err.status_code == 503 else "invalid_request_error"
        return JSONResponse({"error": {"message": str(err.detail), "type": kind}}, err.status_code)

    async def in_thread(fn: Callable, *args) -> Any:
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        except StoreUnavailableError as err:  # a ValueError too: caught first
            raise HTTPException(503, f"store unavailable: {err}") from err
        except ValueError as err:
            raise HTTPException(400, str(err)) from err

    def check_size(*texts: str) -> None:
        if sum(len(t) for t in texts) > MAX_BODY_CHARS:
            raise HTTPException(413, f"the request text is over {MAX_BODY_CHARS} characters (what the model's context could hold)")

    async def complete(body: Options, start: Callable[[], AnswerStream], kind: str) -> Any:
        """Run one completion (streamed or not) inside a gate slot."""
        await gate.enter()
        max_new = body.new_tokens(default_max_tokens)
        try:
            stream = await in_thread(start)
        except BaseException:
            gate.leave()
            raise
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if not body.stream:
            try:
                answer = await in_thread(stream.collect)
            finally:
                gate.leave()
            choice = {"index": 0, "finish_reason": _finish_reason(answer, max_new)}
            if kind == "chat":
                choice["message"] = {"role": "assistant", "content": answer.text}
            else:
                choice["text"] = answer.text
            return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
                    "model": served, "choices": [choice], "usage": _usage(answer),
                    "cacheclip": _metadata(answer, stream.trace)}
        # Generation starts now, on a worker thread, and frees the slot when it ends, whether or
        # not the client ever reads the stream; a client that goes away sets `stop`.
        queue: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(pool, _produce, stream, queue, stop, loop)
        future.add_done_callback(lambda _: gate.leave())
        return StreamingResponse(_events(stream, queue, stop, rid, created, kind, max_new),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(stream: AnswerStream, queue: asyncio.Queue, stop: threading.Event, rid: str, created: int,
                      kind: str, max_new: int) -> AsyncIterator[str]:
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

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody):
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as err:
            raise HTTPException(400, str(err)) from err
        check_size(*(m["content"] for m in messages))
        opts = body.request_options(default_max_tokens)
        return await complete(body, lambda: engine.stream_chat(messages, body.chunk_ids, retrieve=body.retrieve,
                                                               k=body.k, **opts), "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        check_size(body.prompt)
        opts = body.request_options(default_max_tokens)
        return await complete(body, lambda: engine.stream_generate(body.prompt, body.chunk_ids, retrieve=body.retrieve,
                                                                   k=body.k, **opts), "text")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served, "object": "model", "created": 0, "owned_by": "cacheclip-rag"}]}

    @app.post("/v1/documents")
    async def documents(body: DocumentsBody):
        check_size(*(d if isinstance(d, str) else str(d.get("text", "")) for d in body.documents))
        await gate.enter()
        try:
            ids = await in_thread(lambda: engine.ingest(body.documents, progress=False, split=body.split,
                                                        packets=body.packets))
        finally:
            gate.leave()
        return {"object": "list", "chunk_ids": ids, "chunks": len(set(ids))}

    @app.post("/v1/retrieve")
    async def retrieve(body: RetrieveBody):
        check_size(body.query)
        hits = await in_thread(engine.retrieve, body.query, body.k)
        chunks = {cid: text for cid, text in await in_thread(engine.chunk_texts, [cid for cid, _ in hits])}
        return {"object": "list", "data": [{"id": cid, "score": score, "text": chunks[cid]} for cid, score in hits]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": served, "aux": engine.aux.lm.name, "running": gate.running,
                "waiting": gate.queued, "max_active": gate.active, "max_waiting": gate.waiting,
                "chunks": len(engine.index), "modes": list(engine.modes())}

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return (resources.files("cacheclip_rag") / "web" / "index.html").read_text()

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
