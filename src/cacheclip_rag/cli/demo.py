"""The small corpus and questions the package ships for `cacheclip demo`, the examples and tests.

Documents are {"title", "text"} objects (as `CacheClipEngine.ingest` takes them); questions are
{"question", "answers", "hops"} objects (hops: how many chunks the answer draws on), and
"context": "all" on a question asked over every chunk of the demo instead of the retrieved few:
about 4,400 tokens with the default chunking, long enough for reuse's saving to show (on the
short retrieved contexts of the other questions a full prefill is already cheap).
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


def demo_long_documents() -> list[dict]:
    """More documents about the demo's town (about 3,400 tokens), for the whole-corpus question.
    Apart from `demo_documents` so that tests ingesting the short corpus stay quick."""
    return _read("demo_long.jsonl")


def demo_questions() -> list[dict]:
    """Questions over the demo corpus with their expected answers."""
    return _read("demo_questions.jsonl")
