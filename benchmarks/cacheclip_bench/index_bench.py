"""`cacheclip bench index`: the chunk index at corpus sizes, on synthetic clustered embeddings.

For each size N and each kind (flat, IVF, HNSW): the time to build it (train + add), search
latency p50/p99 of one query at a time, recall@k against the flat index's top k (exact), and what
an ingest of `ingest` more chunks writes (a segment) against the size of the whole index on disk.

The vectors are unit-norm draws from a two-level mixture (topics, subtopics; dimension 384, as
the default embedder's): real embeddings cluster by topic, and uniform random vectors in 384
dimensions have no neighbourhoods for IVF or HNSW to find (the worst case, not a corpus).
Queries are fresh draws from the same mixture.
"""

from __future__ import annotations

import json
import logging
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from cacheclip_rag import IndexConfig
from cacheclip_rag.analysis import ChunkIndex

log = logging.getLogger(__name__)


def mixture(n: int, dim: int = 384, topics: int = 200, subtopics: int = 50, seed: int = 0) -> np.ndarray:
    """[n, dim] unit vectors drawn from a two-level mixture (the same one for every seed; seeds
    draw different points: corpus, queries, a later ingest): `topics` random directions, each
    with `subtopics` centres around it (topic + 0.8 x a random direction), each point a centre
    plus noise of about the centre's norm, normalized. Neighbours thus shade from the same
    subtopic through the same topic to the rest, as embeddings of related passages do."""
    fixed = np.random.default_rng(12345)
    topic = _unit(fixed.standard_normal((topics, dim)))
    centres = _unit(np.repeat(topic, subtopics, axis=0) + 0.8 * _unit(fixed.standard_normal((topics * subtopics, dim))))
    rng = np.random.default_rng(seed)
    out = np.empty((n, dim), np.float32)
    for start in range(0, n, 100_000):
        stop = min(n, start + 100_000)
        noise = rng.standard_normal((stop - start, dim)).astype(np.float32) / np.sqrt(dim)
        out[start:stop] = centres[rng.integers(0, len(centres), stop - start)] + noise
    return _unit(out)


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@dataclass
class IndexRow:
    size: int
    kind: str
    build_s: float
    p50_ms: float
    p99_ms: float
    recall: float
    k: int
    index_mb: float
    ingest: int
    ingest_written_mb: float


def measure(size: int, kinds: list[str], cfg: IndexConfig, queries: int = 200, k: int = 8, ingest: int = 1000,
            seed: int = 0) -> list[IndexRow]:
    """One row per kind at `size` vectors, the same vectors and queries for every kind, each
    through `ChunkIndex` as an engine uses it: built by one bulk add (trained, added, written),
    searched one query at a time, then an ingest of `ingest` more."""
    import faiss

    vectors = mixture(size, seed=seed)
    probes = mixture(queries, seed=seed + 1)
    exact = faiss.IndexFlatIP(vectors.shape[1])
    exact.add(vectors)
    truth = [{f"c{i}" for i in row} for row in exact.search(probes, k)[1]]
    del exact
    ids = [f"c{i}" for i in range(size)]
    extra = mixture(ingest, seed=seed + 2)
    rows = []
    for kind in kinds:
        with tempfile.TemporaryDirectory() as folder:
            index = ChunkIndex(folder, config=IndexConfig(**{**asdict(cfg), "kind": kind}))
            start = time.perf_counter()
            index.extend(ids, vectors)
            built = time.perf_counter() - start
            latencies, recalls = [], []
            for q, want in zip(probes, truth):
                start = time.perf_counter()
                hits = index.search_vectors(q[None], k)[0]
                latencies.append((time.perf_counter() - start) * 1000)
                recalls.append(len({cid for cid, _ in hits} & want) / k)
            on_disk = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
            before = index.bytes_written
            index.extend([f"new{i}" for i in range(ingest)], extra)
            written = index.bytes_written - before
        rows.append(IndexRow(size, kind, built, statistics.median(latencies), float(np.percentile(latencies, 99)),
                             float(np.mean(recalls)), k, on_disk / 2**20, ingest, written / 2**20))
        log.info("index %s at %d: %s", kind, size, rows[-1])
    return rows


def table(rows: list[IndexRow]) -> str:
    head = (f"{'vectors':>9} {'kind':<5} {'build s':>8} {'p50 ms':>7} {'p99 ms':>7} {'recall@k':>9} "
            f"{'index MB':>9} {'ingest':>6} {'written MB':>10} {'written/index':>13}")
    lines = [head]
    for r in rows:
        share = r.ingest_written_mb / r.index_mb if r.index_mb else float("nan")
        lines.append(f"{r.size:>9} {r.kind:<5} {r.build_s:>8.2f} {r.p50_ms:>7.3f} {r.p99_ms:>7.3f} "
                     f"{r.recall:>9.3f} {r.index_mb:>9.1f} {r.ingest:>6} {r.ingest_written_mb:>10.2f} {share:>13.4f}")
    return "\n".join(lines)


def write_json(rows: list[IndexRow], path: str, about: dict) -> None:
    Path(path).write_text(json.dumps({"about": about, "rows": [asdict(r) for r in rows]}, indent=2))
