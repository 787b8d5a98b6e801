"""The small corpus and questions the package ships for `cacheclip demo`, the examples and tests.

Documents are {"title", "text"} objects (as `CacheClipEngine.ingest` takes them); questions are
{"question", "answers", "hops"} objects (hops: how many chunks the answer draws on).
"""

from __future__ import annotations

import json
from importlib import resources


def _read(name: str) -> list[dict]:
    text = (resources.files("cacheclip_rag") / "data" / name).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def demo_documents() -> list[dict]:
    """The demo corpus: a few documents, each ingestible as is."""
    return _read("demo_corpus.jsonl")


def demo_questions() -> list[dict]:
    """Questions over the demo corpus with their expected answers."""
    return _read("demo_questions.jsonl")
