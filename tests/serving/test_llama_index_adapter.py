"""LlamaIndex adapters: unit tests with the engine mocked, and a real query engine on the defaults."""

import asyncio
import threading

import pytest
from fakes import FakeEngine
from llama_index.core.llms import ChatMessage
from llama_index.llms.cacheclip import CacheClipLLM


def test_complete_passes_options_and_returns_metadata():
    engine = FakeEngine()
    llm = CacheClipLLM(engine=engine, recompute_ratio=0.25)
    resp = llm.complete("hello", chunk_ids=["x"], mode="reuse")
    assert resp.text == "Hello world"
    assert resp.additional_kwargs["reused_chunk_ids"] == ["x"]
    _, ids, opts = engine.calls[0]
    assert ids == ["x"] and opts["mode"] == "reuse" and opts["recompute_ratio"] == 0.25
    assert llm.metadata.context_window == 4096 and llm.metadata.num_output == 128
    with pytest.raises(ValueError, match="unknown options"):
        llm.complete("x", ratio=1)


def test_stream_complete_yields_deltas_then_metadata():
    out = list(CacheClipLLM(engine=FakeEngine()).stream_complete("q"))
    assert [r.delta for r in out] == ["Hel", "lo", " world", ""]
    assert out[-1].text == "Hello world" and out[-1].additional_kwargs["cached_tokens"] == 8


def test_chat_goes_through_the_chat_path():
    engine = FakeEngine()
    llm = CacheClipLLM(engine=engine)
    resp = llm.chat([ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="What is up?")],
                    mode="reuse")
    assert resp.message.content == "Hello world" and resp.additional_kwargs["mode"] == "reuse"
    assert engine.calls[0][0] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is up?"}]
    assert [r.delta for r in llm.stream_chat([ChatMessage(role="user", content="q")])] == ["Hel", "lo", " world", ""]
    with pytest.raises(ValueError, match="role 'tool'"):
        llm.chat([ChatMessage(role="tool", content="x")])

    async def achat():
        gen = await llm.astream_chat([ChatMessage(role="user", content="q")])
        return (await llm.achat([ChatMessage(role="user", content="q")])).message.content, [r.delta async for r in gen]

    assert asyncio.run(achat()) == ("Hello world", ["Hel", "lo", " world", ""])


def test_async_does_not_block_and_overlaps():
    engine = FakeEngine(barrier=threading.Barrier(2, timeout=10))
    llm = CacheClipLLM(engine=engine)

    async def main():
        return await asyncio.gather(llm.acomplete("a"), llm.acomplete("b"))

    assert [r.text for r in asyncio.run(main())] == ["Hello world"] * 2

    async def stream():
        gen = await CacheClipLLM(engine=FakeEngine()).astream_complete("q")
        return [r.delta async for r in gen]

    assert asyncio.run(stream()) == ["Hel", "lo", " world", ""]


@pytest.mark.real_model
def test_vector_store_query_engine_reuses_chunks(real_engine):
    from llama_index.core import VectorStoreIndex
    from llama_index.llms.cacheclip import (
        CacheClipEmbedding,
        CacheClipQueryEngine,
        chunk_nodes,
    )

    llm = CacheClipLLM(engine=real_engine, max_new_tokens=32)
    index = VectorStoreIndex(chunk_nodes(real_engine), embed_model=CacheClipEmbedding(real_engine))
    question = "Who is the mayor of Valdmark?"

    # Stock query engine: the prompt LlamaIndex builds (template, metadata headers) is recognised.
    # A chat model to LlamaIndex: its QA prompt arrives as chat messages.
    streams = []
    original = real_engine.stream_chat

    def spy(*args, **kwargs):
        streams.append(original(*args, **kwargs))
        return streams[-1]

    real_engine.stream_chat = spy
    try:
        response = index.as_query_engine(llm=llm, similarity_top_k=2).query(question)
    finally:
        del real_engine.stream_chat
    assert "Ingrid Halvorsen" in str(response)
    answer = streams[-1].answer
    assert answer.chunk_ids == [n.node.node_id for n in response.source_nodes]
    assert answer.cached_tokens > answer.computed_tokens

    # Our query engine hands node ids straight to the engine.
    qe = CacheClipQueryEngine(retriever=index.as_retriever(similarity_top_k=2), llm=llm)
    ours = qe.query(question)
    assert "Ingrid Halvorsen" in str(ours)
    assert ours.metadata["reused_chunk_ids"] == [n.node.node_id for n in ours.source_nodes]

    # The chat path in a stock chat engine over the index: retrieved context goes into the system
    # message, where the engine finds the chunk texts and reuses their caches.
    chat_engine = index.as_chat_engine(chat_mode="context", llm=llm, similarity_top_k=2)
    real_engine.stream_chat = spy
    try:
        reply = chat_engine.chat(question)
    finally:
        del real_engine.stream_chat
    assert "Ingrid Halvorsen" in str(reply)
    assert streams[-1].answer.chunk_ids and streams[-1].answer.cached_tokens > streams[-1].answer.computed_tokens
