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

The parts: `schemas.py` (request bodies), `admission.py` (the gate, what routes share),
`streaming.py` (one completion, whole or streamed), `routes.py` (the routes, over
`app.state.serving`), `background.py` (a server on a thread); this module builds the app.
Requests run on worker threads, at most `max_active` at once; up to `max_waiting` more wait,
and beyond that a request gets 503 at once. A client that disconnects mid-stream stops its
generation at the next token and frees its slot. Bad input is a 400 naming the field.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError

from ..engine import CacheClipEngine
from ..request.options import DEFAULTS
from .access import Keys, RequireKeys
from .admission import Gate, Serving
from .background import BackgroundServer
from .routes import http_error, invalid, router


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
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)
    app.include_router(router)
    if keys is not None and keys.enabled:
        app.add_middleware(RequireKeys, keys=keys)
    return app


def serve(engine: CacheClipEngine, host: str = "127.0.0.1", port: int = 8000, **limits) -> None:
    """Run the app with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(create_app(engine, **limits), host=host, port=port, log_level="info")


__all__ = ["BackgroundServer", "create_app", "serve"]
