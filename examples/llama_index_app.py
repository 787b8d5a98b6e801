"""A LlamaIndex VectorStoreIndex query engine with CacheClip as the LLM.

    .venv/bin/python examples/llama_index_app.py

The index is built from the engine's chunks (as nodes whose ids are chunk ids) with the engine's
own embedder, so nothing else needs a model. The stock `as_query_engine` path works through
chunk recognition; `CacheClipQueryEngine` hands the node ids over directly.
"""

import tempfile

from llama_index.core import VectorStoreIndex
from llama_index.llms.cacheclip import (
    CacheClipEmbedding,
    CacheClipLLM,
    CacheClipQueryEngine,
    chunk_nodes,
)

from cacheclip_rag.cli.demo import demo_documents


def main() -> None:
    llm = CacheClipLLM.from_pretrained(store_dir=tempfile.mkdtemp(prefix="cacheclip-li-"), max_new_tokens=48)
    engine = llm.engine
    engine.ingest(demo_documents())
    index = VectorStoreIndex(chunk_nodes(engine), embed_model=CacheClipEmbedding(engine))
    question = "Who is the captain of the Skarv?"

    print("stock query engine:", index.as_query_engine(llm=llm, similarity_top_k=2).query(question))

    response = CacheClipQueryEngine(retriever=index.as_retriever(similarity_top_k=2), llm=llm).query(question)
    meta = response.metadata
    full = engine.answer(question, chunk_ids=meta["reused_chunk_ids"], mode="full")
    print("CacheClipQueryEngine:", response)
    print("reused chunk ids:", meta["reused_chunk_ids"])
    print(f"prompt tokens from cache: {meta['cached_tokens']}, computed: {meta['computed_tokens']}")
    print(f"TTFT cacheclip {meta['timings']['ttft']:.3f}s vs full {full.timings['ttft']:.3f}s")


if __name__ == "__main__":
    main()
