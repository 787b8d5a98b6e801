"""Offline: documents into stored chunks, their caches for every model, and the chunk index;
and `repair`, which heals a store from its chunk texts. Apart from serving: nothing here runs on
the request path."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping

from tqdm.auto import tqdm

from ..config import ChunkConfig
from ..storage.record import Chunk
from ..storage.store import Embedding, KVStore
from .caches import ChunkCaches
from .chunking import chunk_id, split_document
from .index import ChunkIndex
from .recognize import ChunkMatcher

log = logging.getLogger(__name__)


class Ingestor:
    """Writes chunks into a store for a set of models (each a `ChunkCaches`), one ingest at a time.
    packets: the primary's KV Packet caches, built when an ingest asks (else on first use)."""

    def __init__(self, store: KVStore, index: ChunkIndex, matcher: ChunkMatcher, models: list[ChunkCaches],
                 chunking: ChunkConfig, packets: ChunkCaches | None = None):
        self.store, self.index, self.matcher, self.models, self.chunking = store, index, matcher, models, chunking
        self.packets = packets
        self._lock = threading.RLock()
        self._seen: set[str] = set()
        """Names of the stored chunk texts already in the matcher and the index."""

    def open_corpus(self) -> None:
        """Load the stored chunk texts into the prompt matcher and the chunk index."""
        self.catch_up()

    def catch_up(self) -> int:
        """Take in the chunks other processes sharing the store ingested since this one last
        looked: into the prompt matcher, and into the chunk index with the embeddings stored
        beside their texts (embedded here only when stored without one, or by another
        embedder). Cheap when nothing is new (one count); returns how many chunks were new."""
        if self.store.chunk_count() == len(self._seen):
            return 0
        with self._lock:
            opening = not self._seen
            new = [name for name in self.store.chunk_names() if name not in self._seen]
            stored, unembedded = [], []
            for name in new:
                found = self.store.get_chunk_by_name(name)
                if found is None:
                    log.warning("skipping unreadable chunk text %s in %s", name, self.store.location)
                    continue
                chunk, embedding = found
                self.matcher.add(chunk.id, chunk.text)
                if chunk.id not in self.index:
                    if embedding is not None and embedding.model == self.index.embedder_name:
                        stored.append((chunk.id, embedding.vector))
                    else:
                        unembedded.append((chunk.id, chunk.text))
            self.index.add_vectors(stored)
            if unembedded:
                log.info("embedding %d stored chunks that have no stored embedding from %s", len(unembedded),
                         self.index.embedder_name)
                self.index.add(unembedded)
            self._seen.update(new)
        if new and not opening:
            log.info("caught up with %d chunks ingested elsewhere into %s", len(new), self.store.location)
        return len(new)

    def ingest(self, documents: Iterable[str | Mapping], progress: bool = True, split: bool = True,
               packets: bool = False, lazy: bool = False) -> list[str]:
        """Chunk, cache (every model) and index documents; return chunk ids in document order.

        A document is a str or a mapping with "text" and optional "title" / "source". Caches
        already in the store are not recomputed. split=False takes each document as one chunk,
        verbatim: that is how a framework's own nodes become reusable chunks. packets: build the
        KV Packet caches too (a ValueError when the engine has no adapters). lazy: store and
        index the chunks without encoding their caches; the first request that uses a chunk
        encodes and stores them (so a corpus larger than a bounded store still answers).
        """
        if packets and lazy:
            raise ValueError("ingest with packets=True builds caches now; lazy=True builds none: choose one")
        if packets and self.packets is None:
            raise ValueError("ingest with packets needs KV Packet adapters for the primary model; none are loaded "
                             "(EngineConfig.packets)")
        models = self.models + ([self.packets] if packets else [])
        if isinstance(documents, (str, bytes, Mapping)):
            raise ValueError("documents must be a list of documents, not a single document")
        tokenizer = self.models[0].lm.tokenizer
        chunks: list[Chunk] = []
        for i, doc in enumerate(documents):
            text, source = document_text(doc, i)
            if split:
                chunks.extend(split_document(text, tokenizer, self.chunking, source))
            elif text.strip():
                chunks.append(Chunk(chunk_id(text), text, source, 0, len(text)))
            else:
                raise ValueError(f"document {source!r} is empty or whitespace only")
        if not chunks:
            raise ValueError("empty corpus: expected at least one non-empty document")
        with self._lock:
            unique = list({c.id: c for c in chunks}.values())
            fresh = [c for c in unique if c.id not in self.index]
            vectors = dict(zip((c.id for c in fresh), self.index.embed([c.text for c in fresh]))) if fresh else {}
            for chunk in tqdm(unique, desc="ingest", unit="chunk", disable=not progress):
                # The caches first, the text last: a text in the store tells other processes the chunk is ready.
                for caches in models if not lazy else ():
                    if not caches.has(chunk.id):
                        caches.encode(chunk.id, chunk.text)
                vector = vectors.get(chunk.id)
                self.store.put_chunk(chunk, Embedding(self.index.embedder_name, vector) if vector is not None else None,
                                     lazy=lazy)
                self.matcher.add(chunk.id, chunk.text)
                self._seen.add(self.store.chunk_name(chunk.id))
            self.index.add_vectors(list(vectors.items()))
        return [c.id for c in chunks]

    def repair(self, progress: bool = True) -> dict:
        """Re-encode every missing or damaged cache from its chunk text, drop leftovers of
        interrupted writes, re-index chunks the index lacks. Returns counts. Packet caches are
        built on demand, so only the damaged ones are re-encoded (a missing one is not damage)."""
        report = self.store.verify()
        self.store.drop_leftovers()
        rebuilt = 0
        chunks = self.store.chunks()
        damaged_packets = set()
        if self.packets is not None:
            damaged_packets = {name for ns, name, _ in report["damaged"] if ns == self.packets.namespace}
        # Caches a lazy ingest never built, or a bounded store dropped, are built on first use:
        # only those the verify found damaged are rebuilt here.
        on_demand = self.store.max_bytes is not None
        lazy = self.store.lazy_ids()
        damaged = {name for _, name, _ in report["damaged"]}
        with self._lock:
            for chunk in tqdm(chunks, desc="repair", unit="chunk", disable=not progress):
                if (on_demand or chunk.id in lazy) and self.store.cache_name(chunk.id) not in damaged:
                    continue
                for caches in self.models:
                    if not caches.has(chunk.id):
                        caches.encode(chunk.id, chunk.text)
                        rebuilt += 1
                if self.packets is not None and self.store.cache_name(chunk.id) in damaged_packets \
                        and not self.packets.has(chunk.id):
                    self.packets.encode(chunk.id, chunk.text)
                    rebuilt += 1
        self.store.clear_memory()
        with self._lock:
            self._seen.clear()  # re-read every text: re-index what the index lacks
        self.open_corpus()
        return {"checked": report["checked"], "damaged": len(report["damaged"]), "rebuilt": rebuilt, "chunks": len(chunks)}


def document_text(doc, i: int) -> tuple[str, str]:
    """(text, source) of the i-th document: a str, or a mapping with "text" and optional "title"
    (prepended as a line) and "source"."""
    if isinstance(doc, str):
        return doc, f"doc{i}"
    if isinstance(doc, Mapping):
        text = doc.get("text")
        if not isinstance(text, str):
            raise ValueError(f"document {i} must have a 'text' string, got {type(text).__name__}")
        title = doc.get("title")
        source = str(doc.get("source") or title or f"doc{i}")
        return (f"{title}\n{text}" if isinstance(title, str) and title else text), source
    raise ValueError(f"document {i} must be a str or a mapping with 'text', got {type(doc).__name__}")
