"""`cacheclip bench http`: time to first token through the HTTP server against the engine's own.

The engine is served on 127.0.0.1 (`cacheclip_rag.serving.server`, one request at a time) in this
process; for each length a synthetic context is ingested, then the same question over the same
chunks runs alternately in-process (`engine.stream`, wall time to the first text piece) and over
HTTP (a streaming `/v1/chat/completions` with `chunk_ids`, wall time to the first content event
at the client), run after run, so drift hits both alike. Reported: the medians and their ratio.
Both are warm (the memory tier holds the caches): the difference is what HTTP, JSON and SSE add.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from cacheclip_rag import CacheClipEngine
from cacheclip_rag.analysis import BackgroundServer, create_app, needle_context

from .needle import ratio_text


@dataclass
class HttpRow:
    length: int
    mode: str
    ratio: float
    runs: int
    engine_ttft: float
    """Median seconds to the first text piece, in-process."""
    http_ttft: float
    """Median seconds to the first content event, over HTTP."""
    http_vs_engine: float
    same_text: bool
    """The HTTP answer equals the in-process one on every run (greedy)."""


def _engine_ttft(engine: CacheClipEngine, question: str, ids: list[str], opts: dict) -> tuple[float, str]:
    start = time.perf_counter()
    stream = engine.stream(question, chunk_ids=ids, **opts)
    pieces = iter(stream)
    first = next(pieces, "")
    ttft = time.perf_counter() - start
    return ttft, first + "".join(pieces)


def _http_ttft(client: httpx.Client, url: str, question: str, ids: list[str], opts: dict) -> tuple[float, str]:
    body = {"messages": [{"role": "user", "content": question}], "chunk_ids": ids, "stream": True,
            "max_tokens": opts["max_new_tokens"], "mode": opts["mode"], "recompute_ratio": opts["recompute_ratio"]}
    start = time.perf_counter()
    ttft, text = None, ""
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            delta = json.loads(line[5:])["choices"][0].get("delta", {})
            if "content" in delta and "role" not in delta:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                text += delta["content"] or ""
    return ttft if ttft is not None else float("nan"), text


def run(engine: CacheClipEngine, lengths: list[int], modes: list[tuple[str, float]], runs: int = 5,
        seed: int = 1234, max_new_tokens: int = 8) -> list[HttpRow]:
    server = BackgroundServer(create_app(engine, max_active=1, max_waiting=0, default_max_tokens=max_new_tokens))
    rows: list[HttpRow] = []
    try:
        with httpx.Client(timeout=600) as client:
            for length in lengths:
                context, question, _ = needle_context(engine.primary.lm.tokenizer, length, seed + length)
                ids = engine.ingest([context], progress=False)
                for mode, ratio in modes:
                    opts = {"mode": mode, "recompute_ratio": ratio, "max_new_tokens": max_new_tokens}
                    _engine_ttft(engine, question, ids, opts)  # warm-up: caches into the memory tier
                    _http_ttft(client, server.url, question, ids, opts)
                    own, http, same = [], [], True
                    for _ in range(runs):
                        t, text = _engine_ttft(engine, question, ids, opts)
                        h, http_text = _http_ttft(client, server.url, question, ids, opts)
                        own.append(t)
                        http.append(h)
                        same = same and text == http_text
                    e, w = statistics.median(own), statistics.median(http)
                    rows.append(HttpRow(length, mode, ratio, runs, e, w, w / e if e else float("nan"), same))
    finally:
        server.stop()
    return rows


def table(rows: list[HttpRow]) -> str:
    head = f"{'len':>5} {'mode':<20} {'runs':>4} {'engine TTFT':>11} {'HTTP TTFT':>10} {'HTTP/engine':>11} {'same text':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        label = r.mode if r.mode in ("full", "reuse", "packet") else f"{r.mode}@{ratio_text(r.ratio)}"
        lines.append(f"{r.length:>5} {label:<20} {r.runs:>4} {r.engine_ttft:>10.3f}s {r.http_ttft:>9.3f}s "
                     f"{r.http_vs_engine:>11.3f} {'yes' if r.same_text else 'NO':>9}")
    return "\n".join(lines)


def write_json(rows: list[HttpRow], path: str | Path) -> None:
    Path(path).write_text(json.dumps([asdict(r) for r in rows], indent=2))
