"""`cacheclip serve` for real: uvicorn on 127.0.0.1 with tiny models, spoken to by the `openai`
client, LangChain's ChatOpenAI and LlamaIndex's OpenAILike; concurrency, overload, disconnect,
bad bodies."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import CORPUS

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_rag.serving.server import BackgroundServer as Server
from cacheclip_rag.serving.server import create_app

QUESTION = "What is the code in the kitchen drawer?"


def _engine(cls, tiny_pair, path):
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4), top_k=3, packets=None)
    return cls(*tiny_pair, path, cfg)


@pytest.fixture(scope="module")
def served(tiny_pair, tmp_path_factory):
    engine = _engine(CacheClipEngine, tiny_pair, tmp_path_factory.mktemp("served"))
    server = Server(create_app(engine, max_active=2, max_waiting=8, default_max_tokens=8, model_name="tiny"))
    r = httpx.post(server.url + "/v1/documents", json={"documents": CORPUS}, timeout=60)
    assert r.status_code == 200
    engine.ids = r.json()["chunk_ids"]
    yield server, engine
    server.stop()
    engine.close()


def _openai(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_health_models_retrieve(served):
    server, engine = served
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["chunks"] == len(set(engine.ids)) and "cacheclip" in health["modes"]
    assert [m.id for m in _openai(server).models.list().data] == ["tiny"]
    hits = httpx.post(server.url + "/v1/retrieve", json={"query": QUESTION, "k": 2}).json()["data"]
    assert len(hits) == 2 and all(h["id"] in engine.ids and h["text"] for h in hits)
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "cacheclip-rag" in page.text


def test_openai_chat_equals_the_engine_streamed_or_not(served):
    server, engine = served
    client = _openai(server)
    expected = engine.chat([{"role": "user", "content": QUESTION}], max_new_tokens=8)
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}], max_tokens=8,
                                          temperature=0)
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.completion_tokens == expected.generated_tokens and resp.usage.prompt_tokens == expected.prompt_tokens
    meta = resp.model_extra["cacheclip"]
    assert meta["reused_chunk_ids"] == expected.chunk_ids and meta["cached_tokens"] > 0 and meta["ttft_s"] > 0
    assert meta["selection"] and all("recomputed" in c for c in meta["selection"])
    pieces, last = [], None
    for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                                max_tokens=8, stream=True):
        pieces.append(chunk.choices[0].delta.content or "")
        last = chunk
    assert "".join(pieces) == expected.text and last.model_extra["cacheclip"]["mode"] == "cacheclip"


def test_openai_completions_reuse_chunks_in_the_prompt(served):
    server, engine = served
    text = engine.chunk_texts(engine.ids[:2])
    prompt = f"Context:\n{text[0][1]}\n\n{text[1][1]}\n\nQuestion: {QUESTION}\nAnswer:"
    resp = _openai(server).completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                              extra_body={"mode": "cacheclip", "recompute_ratio": 0.5})
    expected = engine.generate(prompt, max_new_tokens=6, recompute_ratio=0.5)
    assert resp.choices[0].text == expected.text
    assert resp.model_extra["cacheclip"]["reused_chunk_ids"] == engine.ids[:2]


def test_langchain_chat_openai_and_llama_index_openai_like(served):
    from langchain_openai import ChatOpenAI
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    server, engine = served
    expected = engine.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
                           max_new_tokens=8, mode="reuse")
    chat = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="tiny", temperature=0, max_tokens=8,
                      extra_body={"mode": "reuse"})
    assert chat.invoke([("system", "Be brief."), ("human", QUESTION)]).content == expected.text
    assert "".join(c.content for c in chat.stream([("system", "Be brief."), ("human", QUESTION)])) == expected.text
    llm = OpenAILike(model="tiny", api_base=server.url + "/v1", api_key="unused", is_chat_model=True, max_tokens=8,
                     temperature=0, additional_kwargs={"extra_body": {"mode": "reuse"}})
    reply = llm.chat([ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content=QUESTION)])
    assert reply.message.content == expected.text


def test_eight_concurrent_streams_get_the_one_by_one_answers(served):
    server, engine = served
    questions = [f"{QUESTION} ({i})" for i in range(8)]
    one_by_one = [engine.chat([{"role": "user", "content": q}], max_new_tokens=8).text for q in questions]

    def stream(q):
        out = []
        for chunk in _openai(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}],
                                                             max_tokens=8, stream=True):
            out.append(chunk.choices[0].delta.content or "")
        return "".join(out)

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(stream, questions)) == one_by_one


@pytest.mark.parametrize("body, status, names", [
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": QUESTION}], "recompute_ratio": 1.5}, 400, "recompute_ratio"),
    ({"messages": [{"role": "user", "content": QUESTION}], "recompute_ratio": "most"}, 400, "recompute_ratio"),
    ({"messages": [{"role": "user", "content": QUESTION}], "recompute_ratio": "auto", "mode": "random"}, 400, "'auto'"),
    ({"messages": [{"role": "user", "content": QUESTION}], "mode": "nope"}, 400, "mode"),
    ({"messages": [{"role": "user", "content": QUESTION}], "max_tokens": "many"}, 400, "max_tokens"),
    ({"messages": [{"role": "robot", "content": QUESTION}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": "   "}]}, 400, "user message"),
    ({"messages": [{"role": "user", "content": QUESTION}], "chunk_ids": ["nope"]}, 400, "unknown chunk ids"),
    ({"messages": [{"role": "user", "content": QUESTION}], "bogus": 1}, 400, "bogus"),
    ({"messages": [{"role": "user", "content": QUESTION}], "aux_context": "all"}, 400, "aux_context"),
    ({"messages": [{"role": "user", "content": "x" * 1_000_000}]}, 413, "characters"),
])
def test_bad_bodies_get_4xx_naming_the_field_and_the_server_keeps_serving(served, body, status, names):
    server, _ = served
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status and names in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").json()["running"] == 0
    ok = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}],
                                                               "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


class _SlowStream:
    """A real AnswerStream whose pieces arrive slowly (so a test can act mid-stream)."""

    def __init__(self, stream, delay):
        self.stream, self.delay, self.produced = stream, delay, 0

    def __iter__(self):
        for piece in self.stream:
            time.sleep(self.delay)
            self.produced += 1
            yield piece

    def __getattr__(self, name):
        return getattr(self.stream, name)


class SlowEngine(CacheClipEngine):
    """The real engine, with each streamed piece delayed and the streams kept for inspection."""

    streams: list = []
    delay = 0.3

    def stream_chat(self, *args, **kwargs):
        stream = _SlowStream(super().stream_chat(*args, **kwargs), self.delay)
        self.streams.append(stream)
        return stream


@pytest.fixture()
def slow(tiny_pair, tmp_path):
    engine = _engine(SlowEngine, tiny_pair, tmp_path)
    engine.ingest(CORPUS, progress=False)
    engine.streams = []
    server = Server(create_app(engine, max_active=1, max_waiting=1, default_max_tokens=16))
    yield server, engine
    server.stop()
    engine.close()


def _start_stream(server, max_tokens=16):
    client = httpx.Client(timeout=60)
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens, "stream": True}
    response = client.send(client.build_request("POST", server.url + "/v1/chat/completions", json=body), stream=True)
    lines = response.iter_lines()
    assert json.loads(next(line for line in lines if line.startswith("data:"))[5:])["choices"][0]["delta"]["role"] == "assistant"
    return client, response


def test_overload_queues_then_503_then_recovers(slow):
    server, engine = slow
    first = _start_stream(server)  # runs
    queued = ThreadPoolExecutor(1).submit(httpx.post, server.url + "/v1/chat/completions",
                                          json={"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 1},
                                          timeout=60)
    for _ in range(100):
        if httpx.get(server.url + "/health").json()["waiting"] == 1:
            break
        time.sleep(0.05)
    busy = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}]})
    assert busy.status_code == 503 and "busy" in busy.json()["error"]["message"]
    first[1].close()
    first[0].close()
    assert queued.result().status_code == 200  # the queued one ran once the slot freed


def test_a_client_that_disconnects_frees_its_slot(slow):
    server, engine = slow
    client, response = _start_stream(server, max_tokens=16)
    response.close()
    client.close()
    for _ in range(100):
        if httpx.get(server.url + "/health").json()["running"] == 0:
            break
        time.sleep(0.05)
    assert httpx.get(server.url + "/health").json()["running"] == 0
    assert engine.streams[0].produced < 16  # generation stopped early, not run to the end
    ok = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}],
                                                               "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200


def test_http_ttft_bench_on_tiny_models(tiny_pair, tmp_path):
    """`bench http`'s runner: both paths measured on the same requests, same answers."""
    from cacheclip_bench import http

    engine = _engine(CacheClipEngine, tiny_pair, tmp_path)
    rows = http.run(engine, [120], [("cacheclip", 0.3), ("reuse", 0.0)], runs=2, max_new_tokens=3)
    assert [r.mode for r in rows] == ["cacheclip", "reuse"] and all(r.same_text for r in rows)
    assert all(r.engine_ttft > 0 and r.http_ttft > 0 for r in rows) and "HTTP/engine" in http.table(rows)
    engine.close()
