"""A chunk's text document as a store keeps it: the text, where it came from, and its retrieval
embedding beside it (so that another process sharing the store indexes it without embedding it
again)."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from .record import Chunk


@dataclass(frozen=True)
class Embedding:
    """A chunk's retrieval embedding as stored beside its text: the embedder's name and the
    normalized vector [D] (float32, little-endian, base64 in the text document)."""

    model: str
    vector: np.ndarray

    def to_dict(self) -> dict:
        raw = np.ascontiguousarray(self.vector, dtype="<f4").tobytes()
        return {"model": self.model, "dim": int(self.vector.size), "b64": base64.b64encode(raw).decode("ascii")}

    @classmethod
    def from_dict(cls, data) -> Embedding | None:
        try:
            vector = np.frombuffer(base64.b64decode(data["b64"], validate=True), dtype="<f4").astype(np.float32)
            if vector.size != int(data["dim"]) or not np.isfinite(vector).all():
                return None
            return cls(str(data["model"]), vector)
        except (KeyError, TypeError, ValueError):
            return None


def chunk_document(chunk: Chunk, embedding: Embedding | None = None, lazy: bool = False) -> dict:
    """The stored document of a chunk (lazy: its caches are built on first use)."""
    data = {"id": chunk.id, "text": chunk.text, "source": chunk.source, "start": chunk.start, "end": chunk.end}
    if embedding is not None:
        data["embedding"] = embedding.to_dict()
    if lazy:
        data["lazy"] = True
    return data


def parse_chunk(data: dict | None, chunk_id: str | None = None) -> Chunk | None:
    """The chunk a stored document holds (None when absent, unreadable, or of another id)."""
    try:
        if data is None or (chunk_id is not None and data.get("id") != chunk_id):
            return None
        return Chunk(data["id"], data["text"], data["source"], data["start"], data["end"])
    except (KeyError, TypeError, AttributeError):
        return None
