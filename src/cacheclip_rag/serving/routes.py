"""The routes of `cacheclip serve`, module-level functions over `app.state.serving`, and how an
error becomes OpenAI's error body."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse

from ..storage.store import hit_rate
from .admission import Serving
from .schemas import ChatBody, CompletionBody, DocumentsBody, RetrieveBody, check_size
from .streaming import complete


def _serving(request: Request) -> Serving:
    return request.app.state.serving


async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
    first = err.errors()[0] if err.errors() else {}
    field_name = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
    message = f"{field_name}: {first.get('msg', 'invalid')}"
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": field_name}}, 400)


async def http_error(request: Request, err: HTTPException) -> JSONResponse:
    kind = "server_busy" if err.status_code == 503 else "invalid_request_error"
    return JSONResponse({"error": {"message": str(err.detail), "type": kind}}, err.status_code)


router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatBody, request: Request):
    state = _serving(request)
    try:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    except ValueError as err:
        raise HTTPException(400, str(err)) from err
    check_size(*(m["content"] for m in messages))
    opts = body.request_options(state.default_max_tokens)
    return await complete(state, body, lambda: state.engine.stream_chat(
        messages, body.chunk_ids, retrieve=body.retrieve, k=body.k, **opts), "chat")


@router.post("/v1/completions")
async def completions(body: CompletionBody, request: Request):
    state = _serving(request)
    check_size(body.prompt)
    opts = body.request_options(state.default_max_tokens)
    return await complete(state, body, lambda: state.engine.stream_generate(
        body.prompt, body.chunk_ids, retrieve=body.retrieve, k=body.k, **opts), "text")


@router.get("/v1/models")
async def models(request: Request):
    served = _serving(request).served
    return {"object": "list", "data": [{"id": served, "object": "model", "created": 0, "owned_by": "cacheclip-rag"}]}


@router.post("/v1/documents")
async def documents(body: DocumentsBody, request: Request):
    state = _serving(request)
    check_size(*(d if isinstance(d, str) else str(d.get("text", "")) for d in body.documents))
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
    check_size(body.query)
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
