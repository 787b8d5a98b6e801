"""LangChain adapters: unit tests with the engine mocked, the standard retriever suite on a
tiny-model engine, and a real LCEL RAG chain on the default models."""

import asyncio
import threading

import pytest
from conftest import CORPUS
from fakes import FakeEngine
from langchain_cacheclip import CacheClipLLM, CacheClipRetriever
from langchain_core.callbacks import BaseCallbackHandler
from langchain_tests.integration_tests import RetrieversIntegrationTests


class Tokens(BaseCallbackHandler):
    def __init__(self):
        self.tokens = []

    def on_llm_new_token(self, token, **kwargs):
        self.tokens.append(token)


def test_invoke_passes_options_and_returns_metadata():
    engine = FakeEngine()
    llm = CacheClipLLM(engine=engine, recompute_ratio=0.3)
    result = llm.generate(["prompt one"], recompute_ratio=0.1, chunk_ids=["a", "b"], mode="reuse")
    gen = result.generations[0][0]
    assert gen.text == "Hello world"
    assert gen.generation_info["reused_chunk_ids"] == ["a", "b"] and gen.generation_info["cached_tokens"] == 8
    prompt, ids, opts = engine.calls[0]
    assert prompt == "prompt one" and ids == ["a", "b"]
    assert opts["recompute_ratio"] == 0.1 and opts["mode"] == "reuse" and opts["retrieve"] is True
    assert llm.invoke("x") == "Hello world"
    assert engine.calls[-1][2]["recompute_ratio"] == 0.3  # the instance default
    assert llm._llm_type == "cacheclip" and llm._identifying_params["primary"] == "fake-primary"


def test_unknown_option_is_refused():
    with pytest.raises(ValueError, match="unknown options"):
        CacheClipLLM(engine=FakeEngine()).invoke("x", ratio=0.5)


def test_stream_reaches_callbacks():
    handler = Tokens()
    llm = CacheClipLLM(engine=FakeEngine())
    chunks = list(llm.stream("q", config={"callbacks": [handler]}))
    assert "".join(chunks) == "Hello world"
    assert handler.tokens[:3] == ["Hel", "lo", " world"]
    handler2 = Tokens()
    llm.invoke("q", config={"callbacks": [handler2]})
    assert handler2.tokens == ["Hel", "lo", " world"]


def test_batch_runs_every_prompt():
    engine = FakeEngine()
    assert CacheClipLLM(engine=engine).batch(["a", "b", "c"]) == ["Hello world"] * 3
    assert sorted(c[0] for c in engine.calls) == ["a", "b", "c"]


def test_async_requests_overlap_and_stream():
    """Each request waits at a barrier until the other arrives: serialized requests would fail."""
    engine = FakeEngine(barrier=threading.Barrier(2, timeout=10))
    llm = CacheClipLLM(engine=engine)

    async def main():
        return await asyncio.gather(llm.ainvoke("a"), llm.ainvoke("b"))

    assert asyncio.run(main()) == ["Hello world", "Hello world"]

    async def stream():
        return [c async for c in CacheClipLLM(engine=FakeEngine()).astream("q")]

    assert "".join(asyncio.run(stream())) == "Hello world"


# ----- the standard retriever suite, on a tiny-model engine -----------------------------------


@pytest.fixture(scope="module")
def tiny_engine(tiny_pair, tmp_path_factory):
    from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig

    eng = CacheClipEngine(*tiny_pair, tmp_path_factory.mktemp("lc"), EngineConfig(chunk=ChunkConfig(chunk_tokens=16, overlap_tokens=2)))
    eng.ingest(CORPUS, progress=False)
    return eng


class TestCacheClipRetrieverStandard(RetrieversIntegrationTests):
    @pytest.fixture(autouse=True)
    def _engine(self, tiny_engine):
        self._tiny_engine = tiny_engine

    @property
    def retriever_constructor(self):
        return CacheClipRetriever

    @property
    def retriever_constructor_params(self):
        return {"engine": self._tiny_engine, "k": 2}

    @property
    def retriever_query_example(self):
        return "what is the code in the kitchen drawer?"


def test_retriever_documents_carry_chunk_ids(tiny_engine):
    docs = CacheClipRetriever(engine=tiny_engine, k=3).invoke("kitchen drawer code")
    assert len(docs) == 3
    for d in docs:
        assert d.id == d.metadata["chunk_id"] and tiny_engine.store.get_chunk(d.id).text == d.page_content


# ----- a real LCEL chain on the default models -------------------------------------------------


@pytest.mark.real_model
def test_lcel_rag_chain_reuses_chunks(real_engine):
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import PromptTemplate

    retriever = CacheClipRetriever(engine=real_engine, k=3)
    llm = CacheClipLLM(engine=real_engine, max_new_tokens=32)
    prompt = PromptTemplate.from_template("Use the context.\n\n{context}\n\nQuestion: {question}\nAnswer:")

    def format_docs(docs):
        return "\n\n".join(d.page_content for d in docs)

    question = "What is the access code of the Harbor Lab records vault?"
    chain = {"context": retriever | format_docs, "question": lambda q: q} | prompt | llm | StrOutputParser()
    assert "4721-9930" in chain.invoke(question)
    # The metadata shows the retrieved chunks were recognised in the prompt and reused.
    docs = retriever.invoke(question)
    result = llm.generate([prompt.format(context=format_docs(docs), question=question)])
    info = result.generations[0][0].generation_info
    assert info["reused_chunk_ids"] == [d.id for d in docs]
    assert info["cached_tokens"] > info["computed_tokens"]
