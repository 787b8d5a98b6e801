"""Scale-out over a shared Redis store: one process ingests, another answers from its caches
without encoding anything; an engine over Redis answers exactly as one over files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CORPUS

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig

WORKER = Path(__file__).parent.parent / "redis_worker.py"


def _worker(*args: str) -> dict:
    done = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_processes_share_one_redis(redis_store_url):
    first = _worker(redis_store_url, "ingest")
    assert first["encoded"] > 0  # primary and aux caches of every chunk, plus nothing else
    second = _worker(redis_store_url, "answer", json.dumps(first["ids"][:4]))
    assert second["encoded"] == 0, "the second process encoded caches the first one had stored"
    assert all(second[k] for k in ("full@1.0", "reuse@0.0", "cacheclip@0.5"))
    assert set(second["retrieved"]) <= set(first["ids"])


def test_an_engine_over_redis_answers_as_over_files(tiny_pair, tmp_path, redis_store_url):
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4))
    answers = []
    for where in (tmp_path / "files", redis_store_url):
        with CacheClipEngine(*tiny_pair, where, cfg) as engine:
            ids = engine.ingest(CORPUS, progress=False)[:4]
            engine.store.clear_memory()
            answers.append([engine.answer("What is the code?", chunk_ids=ids, mode=m, recompute_ratio=0.5,
                                          max_new_tokens=6) for m in ("reuse", "cacheclip", "cacheblend")])
    assert [(a.text, a.recomputed) for a in answers[0]] == [(a.text, a.recomputed) for a in answers[1]]


class _CountingEmbeds:
    """Counts the texts an index embeds (the real embedder still runs)."""

    def __init__(self, index):
        self.texts, self._embed = 0, index.embed
        index.embed = self

    def __call__(self, texts):
        self.texts += len(texts)
        return self._embed(texts)


@pytest.mark.parametrize("where", ["files", "redis"])
def test_a_chunk_ingested_by_one_engine_is_served_by_another_at_once(where, tiny_pair, tmp_path, request):
    """Two engines open on one store (as two `cacheclip serve` processes, or two replicas): what
    one ingests, the other retrieves, recognizes in a prompt and answers from with no restart,
    embedding nothing and encoding nothing again, and answering as the one that ingested."""
    location = tmp_path / "store" if where == "files" else request.getfixturevalue("redis_store_url")
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4), top_k=2, packets=None)
    with CacheClipEngine(*tiny_pair, location, cfg) as first, CacheClipEngine(*tiny_pair, location, cfg) as second:
        assert len(second.index) == 0
        embedded = _CountingEmbeds(second.index)
        ids = first.ingest(CORPUS[:3], progress=False)
        writes = second.store.stats.writes
        hits = second.retrieve("What is the code in the kitchen drawer?")
        assert {cid for cid, _ in hits} <= set(ids) and len(second.index) == len(set(ids))
        assert embedded.texts == 1  # the question only: the chunks' embeddings came from the store
        stuffed = "Context:\n" + first.chunk_texts(ids[:1])[0][1] + "\nWhat is the code?"
        mine, theirs = (e.generate(stuffed, max_new_tokens=4, recompute_ratio=0.5) for e in (first, second))
        assert theirs.chunk_ids == mine.chunk_ids == ids[:1] and theirs.text == mine.text
        assert ids[0] in second.cached_chunks()  # what it reports to a chunk-affinity router
        assert second.store.stats.writes == writes  # no cache encoded again
        more = second.ingest(CORPUS[3:5], progress=False)  # and the other way round
        assert {cid for cid, _ in first.retrieve(CORPUS[4][:60], k=5)} & set(more)
        assert second.answer("What is the code?", chunk_ids=more[:1], max_new_tokens=3).chunk_ids == more[:1]
