"""Faults at small scale on the real server: the shared store (Redis) stops answering mid-service
and comes back. Requests while it is gone get a 503 naming the store, within the socket timeout;
service resumes without a restart; nothing in the store is damaged. (A killed Ray replica:
tests/serving/test_ray_serve.py; overload past the queue bound: tests/serving/test_server.py; ingests during a
load: tests/eval/test_load.py.)"""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import CORPUS, RedisServer

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_rag.serving.server import BackgroundServer, create_app

QUESTION = [{"role": "user", "content": "What is the code in the kitchen drawer?"}]


@pytest.fixture()
def redis():
    try:
        server = RedisServer()
    except (FileNotFoundError, ImportError) as err:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(err))
    yield server
    os.kill(server.proc.pid, signal.SIGCONT)
    server.stop()


def test_redis_gone_for_seconds_gives_503_naming_it_then_service_resumes(redis, tiny_pair):
    engine = CacheClipEngine(*tiny_pair, redis.url, EngineConfig(
        chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4), top_k=2, packets=None))
    server = BackgroundServer(create_app(engine, max_active=2, max_waiting=8, default_max_tokens=4))
    try:
        assert httpx.post(server.url + "/v1/documents", json={"documents": CORPUS}, timeout=60).status_code == 200
        body = {"messages": QUESTION, "max_tokens": 4}
        before = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        os.kill(redis.proc.pid, signal.SIGSTOP)  # Redis stops answering (its data stays)
        start = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            gone = list(pool.map(lambda _: httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60),
                                 range(3)))
        assert time.monotonic() - start < 30  # bounded by the store's socket timeout, no hang
        for r in gone:
            assert r.status_code == 503, r.text
            assert "store unavailable" in r.json()["error"]["message"] and str(redis.port) in r.json()["error"]["message"]
        os.kill(redis.proc.pid, signal.SIGCONT)
        after = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert after.status_code == 200
        assert after.json()["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]
        report = engine.store.verify()
        assert not report["damaged"] and not report["missing"]
    finally:
        server.stop()
        engine.close()
