"""The plain engine on the embedded defaults: ingest the shipped corpus, answer one question
in cacheclip mode and once in full mode, and compare time to first token.

    .venv/bin/python examples/plain_engine.py
"""

import tempfile

from cacheclip_rag import CacheClipEngine
from cacheclip_rag.cli.demo import demo_documents


def main() -> None:
    docs = demo_documents()
    engine = CacheClipEngine.from_pretrained(store_dir=tempfile.mkdtemp(prefix="cacheclip-example-"))
    engine.ingest(docs)
    question = "Who is the captain of the boat that won the silver anchor in 2023?"
    fast = engine.answer(question, mode="cacheclip", recompute_ratio=0.2)
    full = engine.answer(question, chunk_ids=fast.chunk_ids, mode="full")
    print("answer:", fast.text)
    print("chunks reused:", fast.chunk_ids, f"({fast.cached_tokens} of {fast.prompt_tokens} prompt tokens from cache)")
    print(f"TTFT cacheclip {fast.timings['ttft']:.3f}s vs full {full.timings['ttft']:.3f}s")


if __name__ == "__main__":
    main()
