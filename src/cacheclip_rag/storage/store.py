"""The KV store: chunk texts and per-model chunk caches in a backend, with a memory tier in front.

What is stored (the bytes live in a `backends.KVBackend`: a folder, memory, or Redis)::

    manifest ("store")   format version and the fingerprints the store was built for
    texts                one chunk each: id, text, source, span
    kv / <namespace>     one cache per chunk: per-layer K/V (as its codec keeps them: `codecs/`),
                         token ids, character offsets
    profile              the calibrated selection profile of the model pair

A namespace is a hex digest of (model fingerprint, shared-prefix token ids): a cache is valid
only for the model and prefix it was computed with. Stored names are hashes, so no chunk id or
model name ever becomes a path or a server key. A namespace holds chunk caches of one codec
(recorded in the manifest; a write or a record of another is refused); its shared prefix is
always kept as it is (bf16), since every request reads it. Every backend writes atomically. Each cache
carries a checksum per tensor (XXH3-128; caches written before it carry sha256, still checked);
a cache that fails to parse or to match its checksums is removed and reported missing, and the
engine rebuilds it from the chunk's text. This checking is here, once, above every backend.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import StoreConfig
from . import codecs, inspection
from . import profiles as profile_lib
from .backends import KVBackend, StoreUnavailableError, open_backend
from .backends.base import PREFIX_KEY, HeldRecord, check_namespace
from .memory_tier import MemoryTier
from .profiles import Profile
from .record import (
    FORMAT_VERSION,
    Chunk,
    ChunkKV,
    LayerReader,
    to_record,
)
from .texts import Embedding, chunk_document, parse_chunk

log = logging.getLogger(__name__)


@dataclass
class StoreStats:
    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    damaged: int = 0
    writes: int = 0


def hit_rate(counters: dict, prefix: str = "") -> float | None:
    """Memory-tier hits over all chunk-cache reads, from `CacheClipEngine.stats` counters (or
    differences of them); None before any read."""
    hits = counters.get(prefix + "memory_hits", 0)
    reads = hits + counters.get(prefix + "disk_hits", 0) + counters.get(prefix + "misses", 0)
    return hits / reads if reads else None


def open_store(location: str | os.PathLike, cfg: StoreConfig | None = None) -> KVStore:
    """A store named by a folder path or a URL (memory://name, redis://host:port/db)."""
    return KVStore(location, cfg)


class KVStore:
    """Chunk texts and chunk caches in a backend, with an LRU memory tier bounded in bytes.

    location: a folder path or a store URL (see `backends.open_backend`), or a backend.
    """

    def __init__(self, location: str | os.PathLike | KVBackend, cfg: StoreConfig | None = None):
        if isinstance(location, (str, os.PathLike)):
            self.backend = open_backend(location)
        else:
            self.backend = location
        self.cfg = cfg or StoreConfig()
        codecs.check(self.cfg.kv_codec)  # an unknown codec is refused by name before anything is written
        self._codecs: dict[str, str] = {}
        self.stats = StoreStats()
        self._by_namespace: dict[str, StoreStats] = {}
        self._memory = MemoryTier(self.cfg.memory_bytes)
        self._lock = threading.Lock()  # guards the stats
        self._apply_bound()

    def _apply_bound(self) -> None:
        """Keep to the manifest's bound on cached bytes, recording the config's first if it sets one."""
        bound = self.cfg.max_bytes
        if bound is not None:
            if not hasattr(self.backend, "limit"):
                raise ValueError(f"store {self.location} cannot be bounded with StoreConfig.max_bytes (a "
                                 f"{type(self.backend).__name__}); a Redis store takes ?max_bytes=N in its URL")
            manifest = self.read_manifest()
            if manifest.get("max_bytes") != bound:
                self.backend.put_doc("store", {**manifest, "format": manifest.get("format", FORMAT_VERSION),
                                               "max_bytes": bound})
        else:
            bound = self.read_manifest().get("max_bytes")
        if bound is not None and hasattr(self.backend, "limit"):
            self.backend.limit(int(bound))

    @property
    def max_bytes(self) -> int | None:
        """The bound on the bytes of caches this store holds (None: unbounded)."""
        return getattr(self.backend, "max_bytes", None)

    @property
    def location(self) -> str:
        return self.backend.location

    def index_dir(self) -> Path:
        """Where the chunk index (FAISS) is kept for this store."""
        return self.backend.local_dir()

    def close(self) -> None:
        self.backend.close()

    # ----- manifest -------------------------------------------------------------------------

    def read_manifest(self) -> dict:
        return self.backend.get_doc("store") or {}

    def bind_models(self, fingerprints: dict[str, str]) -> None:
        """Record which models this store serves, or refuse if it was built for others.

        fingerprints: role ("primary", "aux") -> model fingerprint.
        """
        manifest = self.read_manifest()
        if manifest.get("format", FORMAT_VERSION) != FORMAT_VERSION:
            raise ValueError(
                f"store {self.location} has format {manifest.get('format')!r}; this version reads {FORMAT_VERSION}"
            )
        known = manifest.get("models", {})
        for role, fp in fingerprints.items():
            if role in known and known[role] != fp:
                raise ValueError(
                    f"store {self.location} was built for a different {role} model (fingerprint "
                    f"{known[role]}); the loaded {role} model has fingerprint {fp}. Use another "
                    f"store or the models it was built with."
                )
        if known != {**known, **fingerprints} or not manifest:
            self.backend.put_doc("store", {**manifest, "format": FORMAT_VERSION, "models": {**known, **fingerprints}})

    def describe_namespace(self, namespace: str, info: dict) -> None:
        """Record which model a namespace's caches belong to and their codec (info["kv_codec"];
        absent: bf16). A namespace never changes codec: another one is refused."""
        manifest = self.read_manifest()
        known = manifest.get("namespaces", {}).get(namespace)
        if known == info:
            return
        if known is not None:
            have, want = known.get("kv_codec", codecs.DEFAULT_CODEC), info.get("kv_codec", codecs.DEFAULT_CODEC)
            if have != want:
                raise ValueError(f"store {self.location}: namespace {namespace[:12]} holds {have!r} caches; refusing "
                                 f"to describe it as {want!r} (a namespace never mixes codecs)")
        manifest.setdefault("format", FORMAT_VERSION)
        manifest.setdefault("namespaces", {})[namespace] = info
        self.backend.put_doc("store", manifest)

    def write_profile(self, new: Profile) -> None:
        """Save a calibrated model-pair profile with the store, beside those of the same pair
        calibrated at other lengths (`profile.merged`)."""
        self.backend.put_doc("profile", profile_lib.document(profile_lib.merged(self.read_profiles(), new)))

    def read_profiles(self, primary_fp: str | None = None, aux_fp: str | None = None) -> list[Profile]:
        """The stored profiles, shortest calibration length first; with fingerprints, only those
        made for that pair. An unreadable document is logged and read as none."""
        try:
            doc = self.backend.get_doc("profile")
        except StoreUnavailableError:
            raise
        except ValueError as err:
            log.warning("profile of store %s is unreadable (%s); ignoring it", self.location, err)
            return []
        profiles = profile_lib.parse(doc)
        if primary_fp is not None:
            profiles = [p for p in profiles if p.primary == primary_fp and p.aux == aux_fp]
        return profiles

    # ----- inspection -----------------------------------------------------------------------

    def usage(self) -> dict:
        """Chunks, the bound, and per namespace its caches, stored bytes, tokens and bytes per
        token (`inspection.usage`)."""
        return inspection.usage(self.backend, self.read_manifest(), self.max_bytes)

    def verify(self) -> dict:
        """Check every cache (parse, names, every checksum) and every chunk text; nothing is
        changed (`inspection.verify` says what the report holds; `repair` on the engine heals)."""
        return inspection.verify(self.backend, self.read_manifest(), self.max_bytes, self._record_codec)

    def drop_leftovers(self) -> None:
        """Remove pieces of interrupted writes."""
        self.backend.drop_leftovers()

    # ----- chunk texts ----------------------------------------------------------------------

    def put_chunk(self, chunk: Chunk, embedding: Embedding | None = None, lazy: bool = False) -> None:
        """Store a chunk's text (once), with its retrieval embedding beside it so that another
        process sharing the store indexes it without embedding it again. lazy: its caches are
        built on first use (verify does not count them missing; repair leaves them)."""
        if self.get_chunk(chunk.id) is not None:
            return
        self.backend.put_text(chunk.id, chunk_document(chunk, embedding, lazy))

    def lazy_ids(self) -> set[str]:
        """The chunks ingested lazily (caches built on first use)."""
        return {d["id"] for _, d in self.backend.texts() if isinstance(d, dict) and d.get("lazy") and "id" in d}

    def chunk_count(self) -> int:
        """How many chunk texts the store holds (cheap; shared stores are polled with it)."""
        return self.backend.text_count()

    def chunk_names(self) -> list[str]:
        """The stored names of every chunk text (`chunk_name`), without reading them."""
        return self.backend.text_names()

    def chunk_name(self, chunk_id: str) -> str:
        return self.backend.text_name(chunk_id)

    def get_chunk_by_name(self, name: str) -> tuple[Chunk, Embedding | None] | None:
        """The chunk stored under `name` and its embedding (None when it was stored without one or
        the stored one is unreadable); None when the text is absent or unreadable."""
        data = self.backend.get_text_by_name(name)
        chunk = parse_chunk(data)
        if chunk is None:
            return None
        return chunk, Embedding.from_dict(data.get("embedding"))

    def get_chunk(self, chunk_id: str) -> Chunk | None:
        return parse_chunk(self.backend.get_text(chunk_id), chunk_id)

    def chunks(self) -> list[Chunk]:
        """Every stored chunk (unreadable texts are skipped with a warning)."""
        out = []
        for name, data in self.backend.texts():
            chunk = parse_chunk(data)
            if chunk is None:
                log.warning("skipping unreadable chunk text %s in %s", name, self.location)
            else:
                out.append(chunk)
        return out

    def chunk_ids(self) -> list[str]:
        return [c.id for c in self.chunks()]

    # ----- caches ---------------------------------------------------------------------------

    def storage_dtype(self, compute: torch.dtype) -> torch.dtype:
        """The dtype this store keeps the caches of a model computing in `compute` in."""
        return self.cfg.storage_dtype(compute)

    def choose_codec(self, namespace_for: Callable[[str], str]) -> str:
        """The codec a model's caches are kept with here: the one place "auto" is resolved.
        namespace_for(codec) names the model's namespace under each codec (the codec is part of a
        namespace's name). A codec named in `StoreConfig.kv_codec` is that codec; "auto" is the
        codec of a namespace of this model the store already describes, else int8 where the
        storage dtype was left to the store and bf16 where one was asked for (kept as is). The
        caller records it with `describe_namespace`; `codec_of` reports it from then on."""
        if self.cfg.kv_codec != codecs.AUTO:
            return self.cfg.kv_codec
        described = self.read_manifest().get("namespaces", {})
        fresh = codecs.AUTO_CODEC if self.cfg.kv_dtype == "auto" else codecs.DEFAULT_CODEC
        return next((c for c in (fresh, *codecs.names()) if namespace_for(c) in described), fresh)

    def codec_of(self, namespace: str) -> str:
        """The codec a namespace's caches are kept with, as its manifest entry records it (absent
        there: bf16, as every store before codecs). A namespace no model described (records put
        through this API directly) is kept with the codec `StoreConfig.kv_codec` names, losslessly
        under "auto": a lossy codec is chosen only for a model's caches (`choose_codec`)."""
        codec = self._codecs.get(namespace)
        if codec is None:
            info = self.read_manifest().get("namespaces", {}).get(namespace)
            if info is None:
                return codecs.DEFAULT_CODEC if self.cfg.kv_codec == codecs.AUTO else self.cfg.kv_codec
            codec = self._codecs[namespace] = info.get("kv_codec", codecs.DEFAULT_CODEC)
        return codec

    def _record_codec(self, namespace: str, key: str) -> str:
        """The codec a record is kept with: its namespace's, but the shared prefix's always bf16
        (a few tokens every request reads: compressing it would save nothing and move them all)."""
        return codecs.DEFAULT_CODEC if key == PREFIX_KEY else self.codec_of(namespace)

    def put_kv(self, namespace: str, key: str, kv: ChunkKV, remember: bool = True) -> ChunkKV:
        """Store `kv` under `key` (atomically, encoded with the namespace's codec, with checksums
        of the stored bytes) and, unless `remember` is False, keep it whole in the memory tier.
        Returns the cache as a read will serve it: `kv` itself, or decoded from what a lossy
        codec stored (so that a request never depends on whether a cache came from memory)."""
        check_namespace(namespace)
        have = self.codec_of(namespace)
        if namespace not in self._codecs:
            self.describe_namespace(namespace, {**(self.read_manifest().get("namespaces", {}).get(namespace) or {}),
                                                "kv_codec": have})
            self._codecs[namespace] = have
        tensors, meta = to_record(kv, namespace, key, self._record_codec(namespace, key))
        self.backend.put(namespace, key, tensors, meta)
        self._count("writes", namespace=namespace)
        if self._record_codec(namespace, key) != codecs.DEFAULT_CODEC:
            kv = LayerReader(HeldRecord(tensors, meta), namespace, key, have).read_all()
        if remember:
            self._memory.put((namespace, key), kv)
        return kv

    def get_kv(self, namespace: str, key: str) -> ChunkKV | None:
        """The cache of `key`, or None when it is missing or was damaged (and is now removed)."""
        return self._lookup(namespace, key, whole=True)

    def open_layers(self, namespace: str, key: str, layers: int | None = None) -> ChunkKV | LayerReader | None:
        """For layer-wise loading: the cache from the memory tier (every layer at hand, or with
        `layers` set, at least the first `layers`), or a reader that loads and verifies one layer
        at a time, or None when it is missing or damaged (then removed). Token ids and offsets are
        read and verified at once."""
        return self._lookup(namespace, key, whole=False, layers=layers)

    def _lookup(self, namespace: str, key: str, whole: bool, layers: int | None = None) -> ChunkKV | LayerReader | None:
        """Memory tier first, then the backend: read whole (and remembered) or opened for layers."""
        check_namespace(namespace)
        hit = self._memory.get((namespace, key), layers)
        if hit is not None:
            self._count("memory_hits", namespace=namespace)
            return hit
        try:
            record = self.backend.get(namespace, key)
            if record is None:
                self._count("misses", namespace=namespace)
                return None
            reader = LayerReader(record, namespace, key, self._record_codec(namespace, key))
            found = reader.read_all() if whole else reader
        except StoreUnavailableError:
            raise
        except (OSError, ValueError, KeyError) as err:
            self.discard(namespace, key, err)
            return None
        self._count("disk_hits", namespace=namespace)
        if whole:
            self._memory.put((namespace, key), found)
        return found

    def cache_name(self, key: str) -> str:
        """The name a cache is stored under (as `verify` reports damaged ones)."""
        return self.backend.name_of(key)

    def discard(self, namespace: str, key: str, why: object) -> None:
        """Remove a damaged cache (it is rebuilt from the chunk text on next use)."""
        log.warning("cache of %r in %s (namespace %s) is damaged (%s); it will be rebuilt",
                    key, self.location, namespace[:12], why)
        self.backend.delete(namespace, key)
        self._memory.pop((namespace, key))
        self._count("damaged", "misses", namespace=namespace)

    def remember(self, namespace: str, key: str, kv: ChunkKV, whole: bool = True) -> None:
        """Put a cache that was read layer by layer into the memory tier: whole, or (whole False)
        its first layers only, which then serve reads of no more layers than it has."""
        self._memory.put((namespace, key), kv, whole)

    def clear_memory(self) -> None:
        self._memory.clear()

    def memory_keys(self, namespace: str) -> list[str]:
        """The keys (chunk ids) whose caches of `namespace` the memory tier holds now."""
        return [key for ns, key in self._memory.keys() if ns == namespace]

    @property
    def memory_bytes(self) -> int:
        return self._memory.nbytes

    def stats_of(self, namespace: str) -> StoreStats:
        """The counters of one namespace's caches (one model's), a copy."""
        with self._lock:
            return dataclasses.replace(self._by_namespace.get(namespace) or StoreStats())

    def _count(self, *names: str, namespace: str) -> None:
        with self._lock:
            mine = self._by_namespace.setdefault(namespace, StoreStats())
            for name in names:
                setattr(self.stats, name, getattr(self.stats, name) + 1)
                setattr(mine, name, getattr(mine, name) + 1)


__all__ = ["Embedding", "KVStore", "StoreStats", "open_store"]
