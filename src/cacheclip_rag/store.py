"""The KV store: chunk texts and per-model chunk caches on disk, with a memory tier in front.

Layout under the store root::

    store.json                         format version and the fingerprints the store was built for
    texts/<h>.json                     one chunk: id, text, source, span (h = sha256 of the id)
    kv/<namespace>/<h>.safetensors     one cache: per-layer K/V, token ids, character offsets

A namespace is a hex digest of (model fingerprint, shared-prefix token ids): a cache is valid
only for the model and prefix it was computed with. File names are hashes, so no chunk id or
model name ever becomes a path. Every write goes to a temporary file in the same folder and is
renamed into place, so a reader sees either the old file or the new one. Each cache file carries
a sha256 of its tensor bytes; a file that fails to parse or to match its checksum is removed and
reported missing, and the engine rebuilds it from the chunk's text.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .chunking import Chunk
from .config import StoreConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_HEX = re.compile(r"^[0-9a-f]{8,64}$")


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


def _tensor_sum(name: str, t: torch.Tensor) -> str:
    digest = hashlib.sha256()
    t = t.contiguous()
    digest.update(name.encode())
    digest.update(str(tuple(t.shape)).encode())
    digest.update(str(t.dtype).encode())
    digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def _checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """One sha256 per tensor, so a single layer can be read and verified without the others."""
    return {name: _tensor_sum(name, t) for name, t in tensors.items()}


class DamagedCacheError(ValueError):
    """A cache file failed to parse or to match its checksums."""


def _hashed_name(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:40]


def atomic_write(path: Path, write) -> None:
    """Write through a temporary file in the same folder, fsync, then rename into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class KVStore:
    """Chunk texts and chunk caches on disk, with an LRU memory tier bounded in bytes."""

    def __init__(self, root: str | os.PathLike, cfg: StoreConfig | None = None):
        self.root = Path(root)
        self.cfg = cfg or StoreConfig()
        self.root.mkdir(parents=True, exist_ok=True)
        self.stats = StoreStats()
        self._memory: OrderedDict[tuple[str, str], ChunkKV] = OrderedDict()
        self._memory_bytes = 0
        self._lock = threading.RLock()

    # ----- manifest -------------------------------------------------------------------------

    @property
    def manifest_path(self) -> Path:
        return self.root / "store.json"

    def read_manifest(self) -> dict:
        if not self.manifest_path.exists():
            return {}
        try:
            return json.loads(self.manifest_path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"store manifest {self.manifest_path} is unreadable: {err}") from err

    def bind_models(self, fingerprints: dict[str, str]) -> None:
        """Record which models this store serves, or refuse if it was built for others.

        fingerprints: role ("primary", "aux") -> model fingerprint.
        """
        manifest = self.read_manifest()
        if manifest.get("format", FORMAT_VERSION) != FORMAT_VERSION:
            raise ValueError(
                f"store {self.root} has format {manifest.get('format')!r}; this version reads {FORMAT_VERSION}"
            )
        known = manifest.get("models", {})
        for role, fp in fingerprints.items():
            if role in known and known[role] != fp:
                raise ValueError(
                    f"store {self.root} was built for a different {role} model (fingerprint "
                    f"{known[role]}); the loaded {role} model has fingerprint {fp}. Use another "
                    f"store_dir or the models it was built with."
                )
        if known != {**known, **fingerprints} or not manifest:
            data = {"format": FORMAT_VERSION, "models": {**known, **fingerprints}}
            atomic_write(self.manifest_path, lambda p: Path(p).write_text(json.dumps(data, indent=2)))

    def describe_namespace(self, namespace: str, info: dict) -> None:
        """Record which model a namespace's caches belong to (for stats and verify)."""
        manifest = self.read_manifest()
        if manifest.get("namespaces", {}).get(namespace) == info:
            return
        manifest.setdefault("format", FORMAT_VERSION)
        manifest.setdefault("namespaces", {})[namespace] = info
        atomic_write(self.manifest_path, lambda p: Path(p).write_text(json.dumps(manifest, indent=2)))

    @property
    def profile_path(self) -> Path:
        return self.root / "profile.json"

    def write_profile(self, profile: dict) -> None:
        """Save a calibrated model-pair profile (see calibrate.py) beside the caches."""
        atomic_write(self.profile_path, lambda p: Path(p).write_text(json.dumps(profile, indent=2)))

    def read_profile(self, primary_fp: str | None = None, aux_fp: str | None = None) -> dict | None:
        """The stored profile, or None; with fingerprints, only a profile made for that pair."""
        try:
            profile = json.loads(self.profile_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError) as err:
            log.warning("profile %s is unreadable (%s); ignoring it", self.profile_path, err)
            return None
        if primary_fp is not None and (profile.get("primary") != primary_fp or profile.get("aux") != aux_fp):
            return None
        return profile

    # ----- inspection -----------------------------------------------------------------------

    def usage(self) -> dict:
        """Chunks and bytes on disk per namespace (reads the file system only)."""
        texts = list((self.root / "texts").glob("*.json"))
        out = {"chunks": len(texts), "text_bytes": sum(p.stat().st_size for p in texts), "namespaces": {}}
        names = self.read_manifest().get("namespaces", {})
        for folder in sorted((self.root / "kv").glob("*")):
            files = list(folder.glob("*.safetensors"))
            out["namespaces"][folder.name] = {
                **names.get(folder.name, {}),
                "caches": len(files),
                "bytes": sum(p.stat().st_size for p in files),
            }
        return out

    def verify(self) -> dict:
        """Check every cache file (parse, names, every checksum) and every chunk text.

        Returns {"checked": n, "damaged": [(namespace, file)], "orphans": [...],
        "missing": {namespace: [chunk ids without a cache]}, "bad_texts": [files]}.
        Nothing is changed; `repair` (on the engine) heals what this finds.
        """
        report = {"checked": 0, "damaged": [], "orphans": [], "missing": {}, "bad_texts": []}
        chunk_ids = set()
        for path in sorted((self.root / "texts").glob("*.json")):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if path.name != f"{_hashed_name(data['id'])}.json" or not isinstance(data["text"], str):
                    raise ValueError("name or text does not match")
                chunk_ids.add(data["id"])
            except (OSError, ValueError, KeyError, TypeError) as err:
                report["bad_texts"].append(f"{path.name}: {err}")
        for folder in sorted((self.root / "kv").glob("*")):
            have = set()
            for path in sorted(folder.glob("*.safetensors")):
                report["checked"] += 1
                try:
                    with safe_open(str(path), framework="pt") as fh:
                        key = (fh.metadata() or {}).get("key", "")
                    reader = LayerReader(path, folder.name, key)
                    for i in range(reader.num_layers):
                        reader.layer(i)
                    reader.close()
                    if path.name != f"{_hashed_name(key)}.safetensors":
                        raise DamagedCacheError("file name does not match its key")
                except (SafetensorError, OSError, ValueError, KeyError) as err:
                    report["damaged"].append((folder.name, path.name, str(err)))
                    continue
                have.add(key)
                if key not in chunk_ids and not key.startswith("__"):
                    report["orphans"].append((folder.name, key))
            missing = sorted(chunk_ids - have)
            if missing:
                report["missing"][folder.name] = missing
        for tmp in self.root.rglob(".tmp-*"):
            report["damaged"].append((tmp.parent.name, tmp.name, "leftover temporary file from an interrupted write"))
        return report

    # ----- chunk texts ----------------------------------------------------------------------

    def _text_path(self, chunk_id: str) -> Path:
        return self.root / "texts" / f"{_hashed_name(chunk_id)}.json"

    def put_chunk(self, chunk: Chunk) -> None:
        path = self._text_path(chunk.id)
        if path.exists():
            return
        data = {"id": chunk.id, "text": chunk.text, "source": chunk.source, "start": chunk.start, "end": chunk.end}
        atomic_write(path, lambda p: Path(p).write_text(json.dumps(data, ensure_ascii=False)))

    def get_chunk(self, chunk_id: str) -> Chunk | None:
        path = self._text_path(chunk_id)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
            log.warning("chunk text file %s is unreadable (%s)", path, err)
            return None
        if data.get("id") != chunk_id:
            return None
        return Chunk(data["id"], data["text"], data["source"], data["start"], data["end"])

    def chunks(self) -> list[Chunk]:
        """Every stored chunk (unreadable text files are skipped with a warning)."""
        out = []
        for path in sorted((self.root / "texts").glob("*.json")):
            try:
                data = json.loads(path.read_text())
                out.append(Chunk(data["id"], data["text"], data["source"], data["start"], data["end"]))
            except (OSError, json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
                log.warning("skipping unreadable chunk text file %s", path)
        return out

    def chunk_ids(self) -> list[str]:
        return [c.id for c in self.chunks()]

    # ----- caches ---------------------------------------------------------------------------

    def kv_path(self, namespace: str, key: str) -> Path:
        if not _HEX.match(namespace):
            raise ValueError(f"store namespace must be a hex digest, got {namespace!r}")
        return self.root / "kv" / namespace / f"{_hashed_name(key)}.safetensors"

    def put_kv(self, namespace: str, key: str, kv: ChunkKV) -> None:
        tensors = {name: t.detach().cpu().contiguous() for name, t in kv.tensors().items()}
        meta = {
            "format": str(FORMAT_VERSION),
            "key": key,
            "namespace": namespace,
            "start_pos": str(kv.start_pos),
            "num_layers": str(len(kv.keys)),
            "sha256": json.dumps(_checksums(tensors), sort_keys=True),
        }
        atomic_write(self.kv_path(namespace, key), lambda p: save_file(tensors, p, metadata=meta))
        with self._lock:
            self.stats.writes += 1
            self._remember((namespace, key), kv)

    def get_kv(self, namespace: str, key: str) -> ChunkKV | None:
        """The cache of `key`, or None when it is missing or was damaged (and is now removed)."""
        return self._lookup(namespace, key, whole=True)

    def open_layers(self, namespace: str, key: str) -> ChunkKV | LayerReader | None:
        """For layer-wise loading: the cache from the memory tier (all layers at hand), or a
        reader that loads and verifies one layer at a time, or None when the file is missing or
        damaged (then removed). Token ids and offsets are read and verified at once."""
        return self._lookup(namespace, key, whole=False)

    def _lookup(self, namespace: str, key: str, whole: bool) -> ChunkKV | LayerReader | None:
        """Memory tier first, then the file: read whole (and remembered) or opened for layers."""
        with self._lock:
            hit = self._memory.get((namespace, key))
            if hit is not None:
                self._memory.move_to_end((namespace, key))
                self.stats.memory_hits += 1
                return hit
        path = self.kv_path(namespace, key)
        if not path.exists():
            with self._lock:
                self.stats.misses += 1
            return None
        try:
            found = self._read(path, namespace, key) if whole else LayerReader(path, namespace, key)
        except (SafetensorError, OSError, ValueError, KeyError) as err:
            self.discard(namespace, key, err)
            return None
        with self._lock:
            self.stats.disk_hits += 1
            if whole:
                self._remember((namespace, key), found)
        return found

    @staticmethod
    def _read(path: Path, namespace: str, key: str) -> ChunkKV:
        reader = LayerReader(path, namespace, key)
        try:
            layers = [reader.layer(i) for i in range(reader.num_layers)]
        finally:
            reader.close()
        return ChunkKV([k for k, _ in layers], [v for _, v in layers], reader.token_ids, reader.offsets, reader.start_pos)

    def discard(self, namespace: str, key: str, why: object) -> None:
        """Remove a damaged cache file (it is rebuilt from the chunk text on next use)."""
        path = self.kv_path(namespace, key)
        log.warning("cache file %s for %r is damaged (%s); it will be rebuilt", path, key, why)
        path.unlink(missing_ok=True)
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


class LayerReader:
    """Reads one cache file layer by layer (memory-mapped), verifying each tensor's checksum."""

    def __init__(self, path: Path, namespace: str, key: str):
        self._fh = safe_open(str(path), framework="pt")
        meta = self._fh.metadata() or {}
        if meta.get("key") != key or meta.get("namespace") != namespace:
            raise DamagedCacheError(f"file holds {meta.get('key')!r}/{meta.get('namespace')!r}")
        try:
            self._sums = json.loads(meta["sha256"])
            self.num_layers = int(meta["num_layers"])
            self.start_pos = int(meta["start_pos"])
        except (KeyError, ValueError, TypeError) as err:
            raise DamagedCacheError(f"bad metadata ({err})") from err
        expected = {"token_ids", "offsets"} | {f"{kv}.{i}" for kv in "kv" for i in range(self.num_layers)}
        if set(self._fh.keys()) != expected or set(self._sums) != expected:
            raise DamagedCacheError("tensor names do not match the metadata")
        self.token_ids = self._get("token_ids")
        self.offsets = self._get("offsets")
        self.path = path

    def _get(self, name: str) -> torch.Tensor:
        tensor = self._fh.get_tensor(name)
        if _tensor_sum(name, tensor) != self._sums[name]:
            raise DamagedCacheError(f"checksum mismatch in {name}")
        return tensor

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of layer i: [kv_heads, T, head_dim] each."""
        return self._get(f"k.{i}"), self._get(f"v.{i}")

    def close(self) -> None:
        self._fh = None
