"""The KV store: chunk texts and per-model chunk caches in a backend, with a memory tier in front.

What is stored (the bytes live in a `backends.KVBackend`: a folder, memory, or Redis)::

    manifest ("store")   format version and the fingerprints the store was built for
    texts                one chunk each: id, text, source, span
    kv / <namespace>     one cache per chunk: per-layer K/V, token ids, character offsets
    profile              the calibrated selection profile of the model pair

A namespace is a hex digest of (model fingerprint, shared-prefix token ids): a cache is valid
only for the model and prefix it was computed with. Stored names are hashes, so no chunk id or
model name ever becomes a path or a server key. Every backend writes atomically. Each cache
carries a checksum per tensor (XXH3-128; caches written before it carry sha256, still checked);
a cache that fails to parse or to match its checksums is removed and reported missing, and the
engine rebuilds it from the chunk's text. This checking is here, once, above every backend.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from .backends import KVBackend, Record, StoreUnavailableError, open_backend
from .backends.base import check_namespace
from .backends.files import FileBackend, atomic_write, hashed_name
from .chunking import Chunk
from .config import StoreConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass
class ChunkKV:
    """The KV cache of one text segment as prefilled after the shared prefix.

    keys, values: one tensor per layer, [kv_heads, T, head_dim], keys rotated for positions
        [start_pos, start_pos + T).
    token_ids: [T] int64.
    offsets: [T, 2] int64 character span of each token inside the segment's text.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    token_ids: torch.Tensor
    offsets: torch.Tensor
    start_pos: int

    def __post_init__(self) -> None:
        assert len(self.keys) == len(self.values) and self.keys, "one K and one V per layer"
        t = self.token_ids.shape[0]
        assert self.offsets.shape == (t, 2), f"offsets {tuple(self.offsets.shape)} for {t} tokens"
        assert all(k.shape[1] == t and v.shape[1] == t for k, v in zip(self.keys, self.values))

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in zip(self.keys, self.values))
        return kv + self.token_ids.numel() * 8 + self.offsets.numel() * 8

    def to(self, dtype: torch.dtype) -> ChunkKV:
        """The same cache with K/V in `dtype` (itself when they already are)."""
        if self.keys[0].dtype == dtype:
            return self
        return ChunkKV([k.to(dtype) for k in self.keys], [v.to(dtype) for v in self.values], self.token_ids,
                       self.offsets, self.start_pos)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"token_ids": self.token_ids, "offsets": self.offsets}
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            out[f"k.{layer}"] = k.contiguous()
            out[f"v.{layer}"] = v.contiguous()
        return out


@dataclass
class StoreStats:
    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    damaged: int = 0
    writes: int = 0


CHECKSUM = "xxh3_128"
"""The checksum new caches carry per tensor. It guards against damage (torn writes, bad disks,
truncation), not against someone who can write the store (who could rewrite the sums too), so
a fast non-cryptographic hash does: XXH3-128 reads ~10 GB/s where sha256 reads ~1.2 GB/s, and
every reuse request verifies each tensor it reads (~100 MB at 4K tokens for the default pair)."""

_HASHES = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
"""Checksum name (the metadata key of a record's sums) -> hash constructor. sha256: stores
written before XXH3 (format 1 either way: the record says which it carries)."""


def _tensor_sum(name: str, t: torch.Tensor, algorithm: str = CHECKSUM) -> str:
    digest = _HASHES[algorithm]()
    t = t.contiguous()
    digest.update(name.encode())
    digest.update(str(tuple(t.shape)).encode())
    digest.update(str(t.dtype).encode())
    digest.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # hashed in place, no copy
    return digest.hexdigest()[:32]


def _checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """One checksum per tensor, so a single layer can be read and verified without the others."""
    return {name: _tensor_sum(name, t) for name, t in tensors.items()}


class DamagedCacheError(ValueError):
    """A cache file failed to parse or to match its checksums."""



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
        self.stats = StoreStats()
        self._memory: OrderedDict[tuple[str, str], ChunkKV] = OrderedDict()
        self._memory_bytes = 0
        self._lock = threading.RLock()

    @property
    def location(self) -> str:
        return self.backend.location

    @property
    def root(self) -> Path | None:
        """The folder of a file store (None for other backends)."""
        return self.backend.root if isinstance(self.backend, FileBackend) else None

    def kv_path(self, namespace: str, key: str) -> Path:
        """The file of a cache in a file store."""
        if not isinstance(self.backend, FileBackend):
            raise ValueError(f"store {self.location} keeps no cache files")
        return self.backend.kv_path(namespace, key)

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
        """Record which model a namespace's caches belong to (for stats and verify)."""
        manifest = self.read_manifest()
        if manifest.get("namespaces", {}).get(namespace) == info:
            return
        manifest.setdefault("format", FORMAT_VERSION)
        manifest.setdefault("namespaces", {})[namespace] = info
        self.backend.put_doc("store", manifest)

    def write_profile(self, profile: dict) -> None:
        """Save a calibrated model-pair profile (see calibrate.py) with the store. Profiles of the
        same pair calibrated at other lengths are kept (one per length set: requests take the one
        nearest their length); one for the same pair at the same lengths is replaced."""
        def key(p: dict) -> tuple:
            return p.get("primary"), p.get("aux"), tuple(sorted(p.get("lengths") or ()))

        profiles = sorted([*(p for p in self.read_profiles() if key(p) != key(profile)), profile], key=profile_length)
        self.backend.put_doc("profile", {"profiles": profiles})

    def read_profiles(self, primary_fp: str | None = None, aux_fp: str | None = None) -> list[dict]:
        """The stored profiles, shortest calibration length first; with fingerprints, only those
        made for that pair. A store written before profiles were kept per length holds one."""
        try:
            doc = self.backend.get_doc("profile")
        except StoreUnavailableError:
            raise
        except ValueError as err:
            log.warning("profile of store %s is unreadable (%s); ignoring it", self.location, err)
            return []
        if doc is None:
            return []
        profiles = doc.get("profiles", [doc]) if isinstance(doc, dict) else []
        if primary_fp is not None:
            profiles = [p for p in profiles if p.get("primary") == primary_fp and p.get("aux") == aux_fp]
        return sorted(profiles, key=profile_length)

    # ----- inspection -----------------------------------------------------------------------

    def usage(self) -> dict:
        """Chunks and stored bytes per namespace."""
        texts = self.backend.texts()
        out = {"chunks": len(texts), "text_bytes": sum(len(json.dumps(d)) for _, d in texts if d), "namespaces": {}}
        names = self.read_manifest().get("namespaces", {})
        for ns in self.backend.namespaces():
            out["namespaces"][ns] = {**names.get(ns, {}), "caches": len(self.backend.list(ns)),
                                     "bytes": self.backend.nbytes(ns)}
        return out

    def verify(self) -> dict:
        """Check every cache (parse, names, every checksum) and every chunk text.

        Returns {"checked": n, "damaged": [(namespace, name, why)], "orphans": [...],
        "missing": {namespace: [chunk ids without a cache]}, "bad_texts": [names]}.
        Nothing is changed; `repair` (on the engine) heals what this finds.
        """
        report = {"checked": 0, "damaged": [], "orphans": [], "missing": {}, "bad_texts": []}
        on_demand = {ns for ns, info in self.read_manifest().get("namespaces", {}).items() if info.get("packets")}
        chunk_ids = set()
        for name, data in self.backend.texts():
            ok = isinstance(data, dict) and isinstance(data.get("id"), str) and isinstance(data.get("text"), str) \
                and name == self.backend.text_name(data["id"])
            if ok:
                chunk_ids.add(data["id"])
            else:
                report["bad_texts"].append(f"{name}: unreadable, or its name or text does not match")
        for ns in self.backend.namespaces():
            have = set()
            for name in self.backend.list(ns):
                report["checked"] += 1
                try:
                    record = self.backend.get_by_name(ns, name)
                    if record is None:
                        continue
                    key = record.meta.get("key", "")
                    reader = LayerReader(record, ns, key)
                    for i in range(reader.num_layers):
                        reader.layer(i)
                    reader.close()
                    if name != self.backend.name_of(key):
                        raise DamagedCacheError("stored name does not match its key")
                except StoreUnavailableError:
                    raise
                except (OSError, ValueError, KeyError) as err:
                    report["damaged"].append((ns, name, str(err)))
                    continue
                have.add(key)
                if key not in chunk_ids and not key.startswith("__"):
                    report["orphans"].append((ns, key))
            missing = sorted(chunk_ids - have)
            if missing and ns not in on_demand:  # packet caches are built on first use: absent is fine
                report["missing"][ns] = missing
        for where, name in self.backend.leftovers():
            report["damaged"].append((where, name, "leftover temporary file from an interrupted write"))
        return report

    def drop_leftovers(self) -> None:
        """Remove pieces of interrupted writes."""
        self.backend.drop_leftovers()

    # ----- chunk texts ----------------------------------------------------------------------

    def put_chunk(self, chunk: Chunk) -> None:
        if self.get_chunk(chunk.id) is not None:
            return
        data = {"id": chunk.id, "text": chunk.text, "source": chunk.source, "start": chunk.start, "end": chunk.end}
        self.backend.put_text(chunk.id, data)

    def get_chunk(self, chunk_id: str) -> Chunk | None:
        return _chunk(self.backend.get_text(chunk_id), chunk_id)

    def chunks(self) -> list[Chunk]:
        """Every stored chunk (unreadable texts are skipped with a warning)."""
        out = []
        for name, data in self.backend.texts():
            chunk = _chunk(data)
            if chunk is None:
                log.warning("skipping unreadable chunk text %s in %s", name, self.location)
            else:
                out.append(chunk)
        return out

    def chunk_ids(self) -> list[str]:
        return [c.id for c in self.chunks()]

    # ----- caches ---------------------------------------------------------------------------

    def put_kv(self, namespace: str, key: str, kv: ChunkKV) -> None:
        check_namespace(namespace)
        tensors = {name: t.detach().cpu().contiguous() for name, t in kv.tensors().items()}
        meta = {
            "format": str(FORMAT_VERSION),
            "key": key,
            "namespace": namespace,
            "start_pos": str(kv.start_pos),
            "num_layers": str(len(kv.keys)),
            CHECKSUM: json.dumps(_checksums(tensors), sort_keys=True),
        }
        self.backend.put(namespace, key, tensors, meta)
        with self._lock:
            self.stats.writes += 1
            self._remember((namespace, key), kv)

    def get_kv(self, namespace: str, key: str) -> ChunkKV | None:
        """The cache of `key`, or None when it is missing or was damaged (and is now removed)."""
        return self._lookup(namespace, key, whole=True)

    def open_layers(self, namespace: str, key: str) -> ChunkKV | LayerReader | None:
        """For layer-wise loading: the cache from the memory tier (all layers at hand), or a
        reader that loads and verifies one layer at a time, or None when it is missing or
        damaged (then removed). Token ids and offsets are read and verified at once."""
        return self._lookup(namespace, key, whole=False)

    def _lookup(self, namespace: str, key: str, whole: bool) -> ChunkKV | LayerReader | None:
        """Memory tier first, then the backend: read whole (and remembered) or opened for layers."""
        check_namespace(namespace)
        with self._lock:
            hit = self._memory.get((namespace, key))
            if hit is not None:
                self._memory.move_to_end((namespace, key))
                self.stats.memory_hits += 1
                return hit
        try:
            record = self.backend.get(namespace, key)
            if record is None:
                with self._lock:
                    self.stats.misses += 1
                return None
            reader = LayerReader(record, namespace, key)
            found = reader.read_all() if whole else reader
        except StoreUnavailableError:
            raise
        except (OSError, ValueError, KeyError) as err:
            self.discard(namespace, key, err)
            return None
        with self._lock:
            self.stats.disk_hits += 1
            if whole:
                self._remember((namespace, key), found)
        return found

    def cache_name(self, key: str) -> str:
        """The name a cache is stored under (as `verify` reports damaged ones)."""
        return self.backend.name_of(key)

    def discard(self, namespace: str, key: str, why: object) -> None:
        """Remove a damaged cache (it is rebuilt from the chunk text on next use)."""
        log.warning("cache of %r in %s (namespace %s) is damaged (%s); it will be rebuilt",
                    key, self.location, namespace[:12], why)
        self.backend.delete(namespace, key)
        with self._lock:
            self._memory.pop((namespace, key), None)
            self.stats.damaged += 1
            self.stats.misses += 1

    def remember(self, namespace: str, key: str, kv: ChunkKV) -> None:
        """Put a cache that was read layer by layer into the memory tier."""
        with self._lock:
            self._remember((namespace, key), kv)

    def _remember(self, mkey: tuple[str, str], kv: ChunkKV) -> None:
        size = kv.nbytes
        if size > self.cfg.memory_bytes:
            return
        old = self._memory.pop(mkey, None)
        if old is not None:
            self._memory_bytes -= old.nbytes
        self._memory[mkey] = kv
        self._memory_bytes += size
        while self._memory_bytes > self.cfg.memory_bytes:
            _, evicted = self._memory.popitem(last=False)
            self._memory_bytes -= evicted.nbytes

    def clear_memory(self) -> None:
        with self._lock:
            self._memory.clear()
            self._memory_bytes = 0

    @property
    def memory_bytes(self) -> int:
        return self._memory_bytes


def profile_length(profile: dict) -> float:
    """The context length a profile was calibrated at (the geometric mean of its lengths; a
    profile that names none counts as 2048, the calibration default)."""
    lengths = [n for n in profile.get("lengths") or () if isinstance(n, (int, float)) and n > 0] or [2048]
    return math.exp(sum(math.log(n) for n in lengths) / len(lengths))


def _chunk(data: dict | None, chunk_id: str | None = None) -> Chunk | None:
    try:
        if data is None or (chunk_id is not None and data.get("id") != chunk_id):
            return None
        return Chunk(data["id"], data["text"], data["source"], data["start"], data["end"])
    except (KeyError, TypeError, AttributeError):
        return None


class LayerReader:
    """Reads one stored cache layer by layer, verifying each tensor's checksum."""

    def __init__(self, record: Record, namespace: str, key: str):
        self._record = record
        meta = record.meta
        if meta.get("key") != key or meta.get("namespace") != namespace:
            raise DamagedCacheError(f"record holds {meta.get('key')!r}/{meta.get('namespace')!r}")
        self._algorithm = next((name for name in _HASHES if name in meta), None)
        if self._algorithm is None:
            raise DamagedCacheError(f"no checksums in its metadata (expected one of {sorted(_HASHES)})")
        try:
            self._sums = json.loads(meta[self._algorithm])
            self.num_layers = int(meta["num_layers"])
            self.start_pos = int(meta["start_pos"])
        except (KeyError, ValueError, TypeError) as err:
            raise DamagedCacheError(f"bad metadata ({err})") from err
        expected = {"token_ids", "offsets"} | {f"{kv}.{i}" for kv in "kv" for i in range(self.num_layers)}
        if record.names() != expected or set(self._sums) != expected:
            raise DamagedCacheError("tensor names do not match the metadata")
        self.token_ids = self._get("token_ids")
        self.offsets = self._get("offsets")

    def _get(self, name: str) -> torch.Tensor:
        try:
            tensor = self._record.tensor(name)
        except StoreUnavailableError:
            raise
        except (OSError, ValueError, KeyError) as err:
            raise DamagedCacheError(f"unreadable {name} ({err})") from err
        if _tensor_sum(name, tensor, self._algorithm) != self._sums[name]:
            raise DamagedCacheError(f"checksum mismatch in {name}")
        return tensor

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of layer i: [kv_heads, T, head_dim] each."""
        return self._get(f"k.{i}"), self._get(f"v.{i}")

    def read_all(self) -> ChunkKV:
        try:
            layers = [self.layer(i) for i in range(self.num_layers)]
        finally:
            self.close()
        return ChunkKV([k for k, _ in layers], [v for _, v in layers], self.token_ids, self.offsets, self.start_pos)

    def close(self) -> None:
        self._record.close()


__all__ = ["ChunkKV", "DamagedCacheError", "KVStore", "LayerReader", "StoreStats", "atomic_write", "hashed_name",
           "open_store"]
