"""The engine: a thin facade over the stages of a request and the offline ingest.

    request/prepare.py (Prepared, its selector looked up once) -> request/execute.py (the
    selector's Plan, the cache assembled and recomputed: Executed) -> request/answer.py
    (decode.py's tokens, then the Answer)

The engine holds only long-lived things (models with their prompt frames, the store, the chunk
index, the prompt matcher, one aux worker thread). Everything about one request lives in the
`Prepared` value made per call, so concurrent requests never share mutable state.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import selectors  # noqa: F401  (registers the built-in methods)
from .config import EngineConfig
from .corpus import packets as packet_lib
from .corpus.caches import ChunkCaches
from .corpus.index import ChunkIndex
from .corpus.ingest import Ingestor
from .corpus.recognize import ChunkMatcher
from .models import loading as model_lib
from .models import lora
from .models.loading import LoadedModel
from .request.profile_source import ProfileSource
from .request import selector as registry
from .request.answer import Answer, AnswerStream
from .request.prepare import Prepared, Preparer
from .storage.backends.memory import MemoryBackend
from .storage.store import open_store

log = logging.getLogger(__name__)

WARM_UP_DOCUMENTS = (
    "The lighthouse keeper wrote the tide tables by hand every evening, and the harbour master "
    "copied them into the ledger kept in the blue cabinet by the door.",
    "The ledger in the blue cabinet lists the ships that came in each week, their cargo, and the "
    "name of the pilot who brought each one past the sandbank at low water.",
)
WARM_UP_QUESTION = "Where is the ledger with the tide tables kept?"
"""`warm_up`'s request: two short chunks that read each other, never stored in the caller's store."""

__all__ = ["Answer", "AnswerStream", "CacheClipEngine"]


class CacheClipEngine:
    """Chunk-cache reuse with CacheClip selective recompute behind a small API.

    store_dir: a folder (the embedded default) or a store URL such as redis://host:6379/0.
    """

    def __init__(self, primary: LoadedModel, aux: LoadedModel, store_dir: str | Path, config: EngineConfig | None = None):
        self._config = config or EngineConfig()
        self.store = open_store(store_dir, self.config.store)
        self.store.bind_models({"primary": primary.fingerprint, "aux": aux.fingerprint})
        self.primary = ChunkCaches.open(primary, self.store, self.config.prompt, "primary")
        # The aux caches keep the layers scoring reads (asked at each encode: a profile written
        # later can need deeper ones); `self.profiles` is set below, before anything is encoded.
        self.aux = ChunkCaches.open(aux, self.store, self.config.prompt, "aux", depth=lambda: self.profiles.aux_depth())
        adapters = packet_lib.resolve_adapters(self.config.packets, primary)
        self.packets = ChunkCaches.open(primary, self.store, self.config.prompt, "packets", adapters) if adapters else None
        """The primary's KV Packet caches (None without adapters): the packet modes' namespace."""
        self.index = ChunkIndex(self.store.index_dir(), self.config.embedder, self.config.index)
        self.matcher = ChunkMatcher()
        self._ingestor = Ingestor(self.store, self.index, self.matcher, [self.primary, self.aux], self.config.chunk,
                                  packets=self.packets)
        self.profiles = ProfileSource(self.store, primary, aux, self.config.select)
        """The pair's calibrated profiles (the store's, else the shipped ones), read once: what
        selection settings a request of some length takes (`profiles.settings(n_tokens)`)."""
        self._preparer = Preparer(self.store, self._ingestor, self.primary, self.aux, self.config, self.profiles,
                                  packets=self.packets)
        # One worker runs aux selection beside the primary loading (CacheClip's CPU/GPU split).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cacheclip-aux")
        self._ingestor.open_corpus()

    @property
    def config(self) -> EngineConfig:
        """The settings this engine opened with (fixed: its store, index and request preparer are
        built from them)."""
        return self._config

    @config.setter
    def config(self, value: EngineConfig) -> None:
        raise AttributeError("an engine's config is fixed when it opens; open another engine with the new config "
                             "(the loaded models can be shared: CacheClipEngine(engine.primary.lm, engine.aux.lm, "
                             "store_dir, config))")

    @classmethod
    def from_pretrained(
        cls,
        primary: str = model_lib.DEFAULT_PRIMARY,
        aux: str = model_lib.DEFAULT_AUX,
        store_dir: str | Path = "cacheclip-store",
        config: EngineConfig | None = None,
        primary_adapter: str | Path | None = None,
        warm_up: bool = False,
    ) -> CacheClipEngine:
        """Load both models (embedded default names, local folders or cached hub ids) and open the
        store (a folder or a URL). primary_adapter: a LoRA folder from `cacheclip train lora`
        merged into the primary (the tuned primary; same as `config.model.primary_adapter`).
        warm_up: run `warm_up()` before returning, so that the first answer is as fast as the next
        (a server's or a demo's; a one-shot command would pay it for nothing)."""
        config = config or EngineConfig()
        if primary_adapter is not None:
            config = dataclasses.replace(config, model=dataclasses.replace(config.model, primary_adapter=str(primary_adapter)))
        primary_lm = model_lib.load(primary, config.model, "primary")
        if config.model.primary_adapter is not None:
            primary_lm = lora.apply(primary_lm, config.model.primary_adapter, copy=False)
        engine = cls(primary_lm, model_lib.load(aux, config.model, "aux"), store_dir, config)
        if warm_up:
            engine.warm_up()
        return engine

    def warm_up(self, modes: Iterable[str] = ("full", "cacheclip")) -> float:
        """Do the one-time work a first request would pay (the threads' and kernels' first use,
        the first touch of the weights) on a short request of its own, through every stage a
        request runs (encode, store, load, aux selection, recompute, decode), in a scratch store
        in memory that goes with it: this engine's store, index and answers are untouched.
        Returns the seconds it took."""
        start = time.perf_counter()
        with CacheClipEngine(self.primary.lm, self.aux.lm, MemoryBackend(), self.config) as scratch:
            ids = scratch.ingest(list(WARM_UP_DOCUMENTS), progress=False)
            for mode in modes:
                scratch.answer(WARM_UP_QUESTION, chunk_ids=ids, mode=mode, recompute_ratio=0.2, max_new_tokens=2)
        seconds = time.perf_counter() - start
        log.info("warmed up in %.2f s (%s)", seconds, ", ".join(modes))
        return seconds

    def close(self) -> None:
        """Stop the aux worker and close the store's connections (the engine is unusable after)."""
        self._pool.shutdown()
        self.store.close()

    def __enter__(self) -> CacheClipEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----- offline --------------------------------------------------------------------------

    def ingest(self, documents: Iterable[str | Mapping], progress: bool = True, split: bool = True,
               packets: bool = False, lazy: bool = False) -> list[str]:
        """Chunk, cache (primary and aux) and index documents; return chunk ids in document order.

        A document is a str or a mapping with "text" and optional "title" / "source". Chunks
        already in the store are not recomputed. split=False takes each document as one chunk,
        verbatim: that is how a framework's own nodes become reusable chunks. packets=True also
        builds the chunks' KV Packet caches now (else the packet modes build them on first use).
        lazy=True stores and indexes the chunks without encoding their caches: the first request
        that uses a chunk encodes them (for a corpus larger than a bounded store).
        """
        return self._ingestor.ingest(documents, progress=progress, split=split, packets=packets, lazy=lazy)

    def repair(self, progress: bool = True) -> dict:
        """Heal the store: re-encode every missing or damaged cache from its chunk text, drop
        leftovers of interrupted writes, re-index chunks the index lacks. Returns counts."""
        return self._ingestor.repair(progress=progress)

    # ----- online ---------------------------------------------------------------------------

    def retrieve(self, question: str, k: int | None = None) -> list[tuple[str, float]]:
        """Top-k chunk ids for a question from the chunk index, with cosine scores."""
        return self._preparer.retrieve(question, k)

    def chunk_texts(self, chunk_ids: list[str]) -> list[tuple[str, str]]:
        """[(id, text)] of stored chunks, in the given order; an unknown id is a ValueError."""
        return self._preparer.chunk_texts(chunk_ids)

    def prepare(self, question: str | None = None, chunk_ids: list[str] | None = None, *, prompt: str | None = None,
                k: int | None = None, **options) -> Prepared:
        """A request made ready to run, without running it: its layout, its chunk caches (primary
        and aux) and its aux query, for analysis (calibration, benches) and for running it with
        `run`. Give a question (chunk ids or retrieval) or a finished prompt; options as `answer`."""
        if (question is None) == (prompt is None):
            raise ValueError("give exactly one of question or prompt")
        if prompt is not None:
            return self._preparer.prompt(prompt, chunk_ids, **options)
        return self._preparer.question(question, chunk_ids, k=k, **options)

    def run(self, prepared: Prepared) -> AnswerStream:
        """Run a prepared request (once): stream its text; `.answer` is set at the end."""
        return AnswerStream(prepared, self._pool)

    def answer(self, question: str, chunk_ids: list[str] | None = None, **kwargs) -> Answer:
        """Answer a question from the given chunks (their order kept) or the top-k retrieved.

        kwargs: k (chunks to retrieve when chunk_ids is None), and the per-request options of
        `cacheclip_rag.request.options.RequestOptions`: mode (any registered selector: `modes()`),
        recompute_ratio, max_new_tokens, temperature, stop, epic_tokens, seed, budget ("keep",
        the default, or "paper"), score_layers. An unknown or invalid option is a ValueError.
        """
        return self.stream(question, chunk_ids, **kwargs).collect()

    def stream(self, question: str, chunk_ids: list[str] | None = None, **kwargs) -> AnswerStream:
        """Like `answer`, yielding the text as it is generated; `.answer` is set at the end."""
        return self.run(self._preparer.question(question, chunk_ids, **kwargs))

    def generate(
        self, prompt: str, chunk_ids: list[str] | None = None, *, retrieve: bool = False, k: int | None = None, **kwargs
    ) -> Answer:
        """Answer a prompt that already holds chunk texts (as a RAG framework builds it).

        Every stored chunk whose text appears in the prompt (any template, order, separators) is
        reused from its cache; the rest of the prompt is recomputed. With chunk_ids, only those
        chunks are looked for and each must be present; if none is, the prompt is taken as the
        question and those chunks are placed before it. With retrieve=True, a prompt holding no
        stored chunk is treated as a bare question: the top-k chunks are retrieved and answered
        from. kwargs as for `answer`.
        """
        return self.stream_generate(prompt, chunk_ids, retrieve=retrieve, k=k, **kwargs).collect()

    def stream_generate(
        self, prompt: str, chunk_ids: list[str] | None = None, *, retrieve: bool = False, k: int | None = None, **kwargs
    ) -> AnswerStream:
        """Like `generate`, yielding text pieces as they are decoded; `.answer` is set at the end."""
        return self.run(self._preparer.generate(prompt, chunk_ids, retrieve, k, kwargs))

    def chat(self, messages: list[dict], chunk_ids: list[str] | None = None, *, retrieve: bool = True,
             k: int | None = None, **kwargs) -> Answer:
        """Answer a conversation ([{"role": "system" | "user" | "assistant", "content": str}], the
        last from the user) through the primary's chat template. Stored chunk texts in any message
        are reused from their caches; a conversation with none is answered from the top-k chunks
        retrieved for its last message (retrieve=False: from nothing). kwargs as for `answer`."""
        return self.stream_chat(messages, chunk_ids, retrieve=retrieve, k=k, **kwargs).collect()

    def stream_chat(self, messages: list[dict], chunk_ids: list[str] | None = None, *, retrieve: bool = True,
                    k: int | None = None, **kwargs) -> AnswerStream:
        """Like `chat`, yielding text pieces as they are decoded; `.answer` is set at the end."""
        return self.run(self._preparer.chat(messages, chunk_ids, retrieve, k, kwargs))

    def info(self) -> dict:
        """What a health check reports: the models, the chunks indexed, the modes."""
        return {"model": self.primary.lm.name, "aux": self.aux.lm.name, "chunks": len(self.index),
                "modes": list(self.modes())}

    def stats(self) -> dict:
        """This process's store counters: chunk-cache reads served from the memory tier, from the
        store, and misses (encoded), and cache writes; `primary_*`: the same for the primary's
        caches alone, the ones chunk-affinity routing keeps in a replica's memory tier (the aux
        reads, and keeps in memory, only its layers up to the deepest scoring layer)."""
        s, p = self.store.stats, self.store.stats_of(self.primary.namespace)
        return {"memory_hits": s.memory_hits, "disk_hits": s.disk_hits, "misses": s.misses, "writes": s.writes,
                "primary_memory_hits": p.memory_hits, "primary_disk_hits": p.disk_hits, "primary_misses": p.misses}

    def cached_chunks(self) -> list[str]:
        """The chunks whose primary caches are in this process's memory tier (what a request over
        them finds without reading the store): what chunk-affinity routing prefers."""
        return self.store.memory_keys(self.primary.namespace)

    @staticmethod
    def modes() -> tuple[str, ...]:
        """Every mode a request may name: the registered selectors."""
        return registry.modes()
