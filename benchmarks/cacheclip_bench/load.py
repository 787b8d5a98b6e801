"""`cacheclip bench load`: a bounded load generator against a server on this machine.

K users, each sending one request at a time, for at most T seconds and at most R requests in
all, drawn from a mix:

    chat      a question with stored chunk text pasted in its message (the server recognizes it)
    retrieve  a bare question; the server retrieves its chunks
    ingest    a new small document, ingested (checked retrievable when the load ends)

The corpus is `corpus(documents)`: generated notes, each a few sentences of prose around one
fact, ingested first. The chat and retrieve requests come from a pool of questions about them
(so chunks repeat across requests, as a RAG workload's do), each run alone first, one at a time, for its reference answer; under load every
answer is compared with its reference (greedy decoding: it must be the same text). Reported:
requests/s, client-side TTFT (first streamed token) p50/p95/p99 per kind, errors by kind, wrong
answers, lost ingests, and the memory-tier hit rate over the load (`GET /v1/stats`). Loopback
addresses only; it stops by itself at its bounds.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from cacheclip_rag.analysis import hit_rate, prose

LOOPBACK = ("127.0.0.1", "localhost", "::1")
KINDS = ("chat", "retrieve", "ingest")
MAX_USERS, MAX_SECONDS, MAX_REQUESTS = 64, 3600, 100_000


@dataclass(frozen=True)
class LoadConfig:
    """users: concurrent clients; seconds / requests: the bounds (whichever comes first); mix:
    kind -> weight; pool: distinct questions; context: chunks per question (the top `context`
    for it, stuffed into a chat request's message, or `k` of a bare question); max_tokens per
    answer; timeout per request (s)."""

    users: int = 4
    seconds: float = 60.0
    requests: int = 200
    mix: tuple[tuple[str, float], ...] = (("chat", 0.5), ("retrieve", 0.4), ("ingest", 0.1))
    pool: int = 8
    documents: int = 24
    context: int = 2
    max_tokens: int = 16
    timeout: float = 120.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name, top in (("users", MAX_USERS), ("requests", MAX_REQUESTS), ("pool", 1000), ("documents", 10_000),
                          ("context", 64), ("max_tokens", 4096)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise ValueError(f"{name} must be an integer in [1, {top}], got {value!r}")
        for name, top in (("seconds", MAX_SECONDS), ("timeout", MAX_SECONDS)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= top:
                raise ValueError(f"{name} must be a number of seconds in (0, {top}], got {value!r}")
        mix = dict(self.mix)
        if not mix or set(mix) - set(KINDS) or any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
            raise ValueError(f"mix must weigh kinds among {KINDS} with non-negative weights, some positive, got {self.mix!r}")


_NAMES = ("alder", "basalt", "cobalt", "dahlia", "ember", "falcon", "garnet", "heron", "indigo", "juniper", "kestrel",
          "lantern", "marble", "nutmeg", "orchid", "pepper", "quartz", "raven", "saffron", "thistle", "umber", "violet",
          "walrus", "yarrow", "zephyr", "acorn", "bramble", "cedar", "driftwood", "elm", "fennel", "granite", "hazel",
          "iris", "jasper", "kelp", "lichen", "maple", "nettle", "oyster", "pumice", "quince", "rosemary", "sorrel",
          "tamarind", "urchin", "vervain", "willow", "yew", "zinnia", "anchor", "beacon", "compass", "dune", "estuary",
          "fjord", "glacier", "harbor", "island", "jetty", "knoll", "lagoon", "meadow", "nebula", "oasis", "prairie")
"""Distinct words that name the notes' sites (a retriever tells notes apart by them, not by numbers)."""


def _site(i: int) -> str:
    """The i-th site's name: one word, then pairs of words (as many as the corpus needs)."""
    n = len(_NAMES)
    return _NAMES[i] if i < n else f"{_NAMES[(i // n - 1) % n]} {_NAMES[i % n]}"


def corpus(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """n (document, question) pairs: a note about one named site, prose around one fact, and a
    question only that note answers (the site's name is in both, so retrieval finds the note;
    `tests/eval/test_load.py` checks it does). Deterministic for (n, seed)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        site, code = f"the {_site(i)} depot", f"{rng.randrange(10_000):04d}-{rng.randrange(10_000):04d}"
        text = (f"Note on {site}\nThis note is about {site}. {prose(rng, 3)} The gate code of {site} is {code}. "
                f"{prose(rng, 3)} Visitors to {site} sign in at its gate.")
        out.append((text, f"What is the gate code of {site}?"))
    return out


def parse_mix(text: str) -> tuple[tuple[str, float], ...]:
    """"chat=0.5,retrieve=0.4,ingest=0.1" -> the mix."""
    try:
        pairs = [part.split("=") for part in text.split(",") if part.strip()]
        return tuple((k.strip(), float(v)) for k, v in pairs)
    except ValueError:
        raise ValueError(f"mix must look like chat=0.5,retrieve=0.4,ingest=0.1, got {text!r}") from None


def check_url(url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or parsed.hostname not in LOOPBACK:
        raise ValueError(f"bench load runs against a server on this machine (http://127.0.0.1:PORT), got {url!r}")
    return url.rstrip("/")


@dataclass
class Outcome:
    kind: str
    ok: bool
    ttft: float | None = None
    seconds: float = 0.0
    error: str | None = None
    wrong: bool = False
    at: float = 0.0
    """Seconds from the load's start to this request's start."""
    detail: str | None = None
    """A failed request's message (the start of the server's error body)."""


@dataclass
class LoadReport:
    url: str
    config: dict
    seconds: float
    outcomes: list[Outcome] = field(default_factory=list)
    ingested: int = 0
    lost_ingests: int = 0
    hit_rate: float | None = None
    """Chunk-cache reads (both models) served by the servers' memory tiers during the load."""
    primary_hit_rate: float | None = None
    """The same for the primary's caches alone: what chunk-affinity routing keeps in memory."""

    def summary(self) -> dict:
        done = [o for o in self.outcomes if o.ok]
        rows = {}
        for kind in KINDS:
            mine = [o for o in self.outcomes if o.kind == kind]
            ttfts = sorted(o.ttft for o in mine if o.ok and o.ttft is not None)
            rows[kind] = {"requests": len(mine), "ok": sum(o.ok for o in mine),
                          "wrong": sum(o.wrong for o in mine), **percentiles(ttfts)}
        return {"requests": len(self.outcomes), "ok": len(done), "seconds": self.seconds,
                "requests_per_s": len(done) / self.seconds if self.seconds else 0.0,
                "ttft": percentiles(sorted(o.ttft for o in done if o.ttft is not None)),
                "errors": dict(Counter(o.error for o in self.outcomes if o.error)),
                "wrong": sum(o.wrong for o in self.outcomes), "ingested": self.ingested,
                "lost_ingests": self.lost_ingests, "memory_hit_rate": self.hit_rate,
                "primary_memory_hit_rate": self.primary_hit_rate, "by_kind": rows}


def percentiles(sorted_values: list[float]) -> dict:
    if not sorted_values:
        return {"p50": None, "p95": None, "p99": None}

    def at(q: float) -> float:
        return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]

    return {"p50": statistics.median(sorted_values), "p95": at(0.95), "p99": at(0.99)}


class Client:
    """The bench's own async client for the server's OpenAI API (streamed answers, for TTFT)."""

    def __init__(self, url: str, api_key: str | None, admin_key: str | None, timeout: float):
        import httpx

        self.url = url
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.admin = {"Authorization": f"Bearer {admin_key}"} if admin_key else auth
        self.http = httpx.AsyncClient(base_url=url, headers=auth, timeout=timeout)

    async def ask(self, body: dict) -> tuple[str, float | None]:
        """The streamed answer's text and seconds to its first piece."""
        start, first, text = time.perf_counter(), None, []
        async with self.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                raise StatusError(r.status_code, (await r.aread()).decode(errors="replace")[:200])
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise StatusError(500, event["error"].get("message", "error event"))
                piece = event["choices"][0]["delta"].get("content")
                if piece:
                    first = first if first is not None else time.perf_counter() - start
                    text.append(piece)
        return "".join(text), first

    async def ingest(self, text: str) -> list[str]:
        r = await self.http.post("/v1/documents", json={"documents": [text]}, headers=self.admin)
        if r.status_code != 200:
            raise StatusError(r.status_code, r.text[:200])
        return r.json()["chunk_ids"]

    async def retrieve(self, query: str, k: int = 3) -> list[str]:
        r = await self.http.post("/v1/retrieve", json={"query": query, "k": k})
        if r.status_code != 200:
            raise StatusError(r.status_code, r.text[:200])
        return [hit["id"] for hit in r.json()["data"]]

    async def stats(self) -> dict:
        r = await self.http.get("/v1/stats")
        return r.json() if r.status_code == 200 else {}


class StatusError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def error_kind(err: BaseException) -> str:
    if isinstance(err, StatusError):
        return f"http_{err.status}"
    return type(err).__name__


async def _requests_pool(client: Client, cfg: LoadConfig) -> list[tuple[str, dict]]:
    """The (kind, body) pool of chat and retrieve requests, over the server's chunks."""
    rng = random.Random(cfg.seed)
    questions = [q for _, q in corpus(cfg.documents)]
    rng.shuffle(questions)
    pool = []
    for question in questions[: cfg.pool]:
        base = {"max_tokens": cfg.max_tokens, "temperature": 0}
        pool.append(("retrieve", {**base, "k": cfg.context, "messages": [{"role": "user", "content": question}]}))
        r = await client.http.post("/v1/retrieve", json={"query": question, "k": cfg.context})
        if r.status_code != 200:
            raise StatusError(r.status_code, r.text[:200])
        texts = [hit["text"] for hit in r.json()["data"]]
        content = "Context:\n" + "\n\n".join(texts) + f"\n\nQuestion: {question}"
        pool.append(("chat", {**base, "messages": [{"role": "user", "content": content}], "retrieve": False}))
    return pool


async def run(url: str, cfg: LoadConfig, *, api_key: str | None = None, admin_key: str | None = None,
              seed_corpus: bool = True, progress=None) -> LoadReport:
    """Ingest the corpus (chunks already stored are not encoded again), take the references one
    at a time, then the load."""
    client = Client(check_url(url), api_key, admin_key, cfg.timeout)
    try:
        if seed_corpus:
            docs = [text for text, _ in corpus(cfg.documents)]
            r = await client.http.post("/v1/documents", json={"documents": docs, "split": False}, headers=client.admin)
            if r.status_code != 200:
                raise ValueError(f"ingesting the load corpus failed: HTTP {r.status_code} {r.text[:200]}")
        pool = await _requests_pool(client, cfg)
        reference = {i: (await client.ask(body))[0] for i, (_, body) in enumerate(pool)}
        before = await client.stats()
        report = await _load(client, cfg, pool, reference, progress)
        after = await client.stats()
        during = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], int)}
        report.hit_rate, report.primary_hit_rate = hit_rate(during), hit_rate(during, "primary_")
        return report
    finally:
        await client.http.aclose()


async def _load(client: Client, cfg: LoadConfig, pool: list, reference: dict, progress) -> LoadReport:
    mix = dict(cfg.mix)
    kinds, weights = zip(*[(k, w) for k, w in mix.items() if w > 0])
    rng = random.Random(cfg.seed + 1)
    by_kind = {k: [i for i, (kind, _) in enumerate(pool) if kind == k] for k in ("chat", "retrieve")}
    report = LoadReport(client.url, asdict(cfg), 0.0)
    ingested: list[tuple[str, list[str]]] = []
    budget = {"left": cfg.requests}
    start = time.perf_counter()
    deadline = start + cfg.seconds

    async def one(kind: str) -> Outcome:
        t0 = time.perf_counter()
        try:
            if kind == "ingest":
                text = f"Load note {uuid.uuid4().hex[:12]}: the courier left parcel {rng.randrange(10**6):06d} " \
                       f"at the {rng.choice(['north', 'south', 'east', 'west'])} gate."
                ingested.append((text, await client.ingest(text)))
                return Outcome(kind, True, seconds=time.perf_counter() - t0)
            i = rng.choice(by_kind[kind])
            text, ttft = await client.ask(pool[i][1])
            return Outcome(kind, True, ttft, time.perf_counter() - t0, wrong=text != reference[i])
        except Exception as err:  # noqa: BLE001 - every failure is counted by kind
            return Outcome(kind, False, seconds=time.perf_counter() - t0, error=error_kind(err), detail=str(err)[:300])

    async def user() -> None:
        while budget["left"] > 0 and time.perf_counter() < deadline:
            budget["left"] -= 1
            kind = rng.choices(kinds, weights)[0]
            if kind != "ingest" and not by_kind[kind]:
                kind = "ingest"
            at = time.perf_counter() - start
            outcome = await one(kind)
            outcome.at = at
            report.outcomes.append(outcome)
            if progress:
                progress(kind)

    await asyncio.gather(*(user() for _ in range(cfg.users)))
    report.seconds = time.perf_counter() - start
    report.ingested = len(ingested)
    for text, ids in ingested:  # every ingested document must be retrievable afterwards
        try:
            found = await client.retrieve(text, k=3)
        except Exception:  # noqa: BLE001
            found = []
        report.lost_ingests += not set(ids) & set(found)
    return report


def table(report: LoadReport) -> str:
    s = report.summary()

    def ms(x):
        return "-" if x is None else f"{1000 * x:.0f}"

    lines = [f"{report.url}: {s['requests']} requests in {s['seconds']:.1f} s by {report.config['users']} users: "
             f"{s['requests_per_s']:.2f} answered/s",
             f"{'kind':<9} {'requests':>8} {'ok':>5} {'wrong':>5} {'TTFT p50 ms':>11} {'p95':>7} {'p99':>7}"]
    for kind, row in s["by_kind"].items():
        if row["requests"]:
            lines.append(f"{kind:<9} {row['requests']:>8} {row['ok']:>5} {row['wrong']:>5} {ms(row['p50']):>11} "
                         f"{ms(row['p95']):>7} {ms(row['p99']):>7}")
    t = s["ttft"]
    lines.append(f"{'all':<9} {s['requests']:>8} {s['ok']:>5} {s['wrong']:>5} {ms(t['p50']):>11} {ms(t['p95']):>7} "
                 f"{ms(t['p99']):>7}")
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    lines.append(f"errors: {s['errors'] or 'none'}; wrong answers: {s['wrong']}; ingested {s['ingested']}, lost "
                 f"{s['lost_ingests']}; memory-tier hit rate {pct(s['memory_hit_rate'])} (primary caches "
                 f"{pct(s['primary_memory_hit_rate'])})")
    return "\n".join(lines)


def write_json(report: LoadReport, path: str | Path) -> None:
    Path(path).write_text(json.dumps({"summary": report.summary(), "config": report.config,
                                      "outcomes": [asdict(o) for o in report.outcomes]}, indent=2))
