"""An ordinary LangChain LCEL RAG chain with CacheClip swapped in as the LLM.

    .venv/bin/python examples/langchain_lcel_app.py

The chain is the textbook `retriever | format_docs | prompt | llm`; nothing in it knows about
chunk ids. The LLM recognises the retrieved chunk texts inside the formatted prompt and reuses
their KV caches. The same prompt is then answered in `full` mode to compare time to first token.
"""

import tempfile

from langchain_cacheclip import CacheClipLLM, CacheClipRetriever
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate

from cacheclip_rag.cli.demo import demo_documents


def main() -> None:
    llm = CacheClipLLM.from_pretrained(store_dir=tempfile.mkdtemp(prefix="cacheclip-lc-"), max_new_tokens=48)
    llm.engine.ingest(demo_documents())
    retriever = CacheClipRetriever(engine=llm.engine, k=3)
    prompt = PromptTemplate.from_template(
        "Answer from the context.\n\nContext:\n{context}\n\nQuestion: {question}\nAnswer:"
    )

    def format_docs(docs):
        return "\n\n".join(d.page_content for d in docs)

    chain = {"context": retriever | format_docs, "question": lambda q: q} | prompt | llm | StrOutputParser()
    question = "Which team built the Orion sensor?"
    print("answer:", chain.invoke(question))

    # The metadata of the same call shows what was reused, and full mode on the same prompt.
    text = prompt.format(context=format_docs(retriever.invoke(question)), question=question)
    info = llm.generate([text]).generations[0][0].generation_info
    full = llm.generate([text], mode="full").generations[0][0].generation_info
    print("reused chunk ids:", info["reused_chunk_ids"])
    print(f"prompt tokens from cache: {info['cached_tokens']}, computed: {info['computed_tokens']}")
    print(f"TTFT cacheclip {info['timings']['ttft']:.3f}s vs full {full['timings']['ttft']:.3f}s")


if __name__ == "__main__":
    main()
