"""Scale-out over a shared Redis store: one process ingests, another answers from its caches
without encoding anything; an engine over Redis answers exactly as one over files."""

import json
import subprocess
import sys
from pathlib import Path

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig

from conftest import CORPUS

WORKER = Path(__file__).with_name("redis_worker.py")


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
