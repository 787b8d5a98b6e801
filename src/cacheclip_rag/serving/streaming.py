"""One completion, answered whole or streamed: the worker thread decoding into the event loop,
OpenAI's response and server-sent chunk formats, and the reuse metadata every response carries."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from ..request.answer import Answer, AnswerStream
from .admission import Serving
from .schemas import Options

log = logging.getLogger(__name__)


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


def produce(stream: AnswerStream, queue: asyncio.Queue, stop: threading.Event, loop: asyncio.AbstractEventLoop) -> None:
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


def metadata(answer: Answer, trace: list[dict]) -> dict:
    meta = answer.metadata()
    meta["ttft_s"] = answer.timings.get("ttft")
    meta["selection"] = selection_spans(trace)
    return meta


def usage(answer: Answer) -> dict:
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.generated_tokens,
            "total_tokens": answer.prompt_tokens + answer.generated_tokens}


def finish_reason(answer: Answer, max_new: int) -> str:
    return "length" if answer.generated_tokens >= max_new else "stop"


async def complete(state: Serving, body: Options, start: Callable[[], AnswerStream], kind: str) -> Any:
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
        choice = {"index": 0, "finish_reason": finish_reason(answer, max_new)}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": answer.text}
        else:
            choice["text"] = answer.text
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
                "model": state.served, "choices": [choice], "usage": usage(answer),
                "cacheclip": metadata(answer, stream.trace)}
    # Generation starts now, on a worker thread, and frees the slot when it ends, whether or
    # not the client ever reads the stream; a client that goes away sets `stop`.
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(state.pool, produce, stream, queue, stop, loop)
    future.add_done_callback(lambda _: state.gate.leave())
    chunks = events(state.served, stream, queue, stop, rid, created, kind, max_new)
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def events(served: str, stream: AnswerStream, queue: asyncio.Queue, stop: threading.Event, rid: str,
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
                yield event(None, finish_reason(item, max_new), usage=usage(item),
                            cacheclip=metadata(item, stream.trace))
                break
            else:
                yield "data: " + json.dumps({"error": {"message": str(item), "type": "server_error"}}) + "\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        stop.set()  # a client gone mid-stream: generation stops at its next token
