"""The embedded default: a store in a folder.

    store.json, profile.json           named documents
    texts/<h>.json                     one chunk text (h = sha256 of the chunk id)
    kv/<namespace>/<h>.safetensors     one record: named tensors, string metadata
    index/                             the chunk index (FAISS), next to what it indexes

Every write goes to a temporary file in the same folder, is fsynced and renamed into place.
Bounded (`limit`, from `StoreConfig.max_bytes`), the folder holds at most that many bytes of
records: a read refreshes a record's modification time, and a write that takes the folder past
the bound drops the records least recently used (the oldest times, across every process sharing
the folder) until it holds 90% of it; the shared prefix is never dropped.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .base import PATH_SCHEME, PREFIX_KEY, check_namespace, hashed_name, register

log = logging.getLogger(__name__)

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


class FileRecord:
    """A safetensors file, memory-mapped; tensors are read one at a time."""

    def __init__(self, path: Path):
        try:
            self._fh = safe_open(str(path), framework="pt")
            self.meta = dict(self._fh.metadata() or {})
            self._names = set(self._fh.keys())
        except (SafetensorError, OSError) as err:
            raise ValueError(f"unreadable record {path}: {err}") from err
        self.path = path

    def names(self) -> set[str]:
        return set(self._names)

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self._fh.get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise ValueError(f"unreadable tensor {name} in {self.path}: {err}") from err

    def close(self) -> None:
        self._fh = None


LOW_WATER = 0.9
"""A bounded folder that overflows is brought down to this share of its bound, so that the scan
that finds the oldest records runs once per tenth of the bound written, not on every write."""


class FileBackend:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.location = str(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes: int | None = None
        self._held = 0
        """Bytes of records this process believes the folder holds (rescanned when it passes the bound)."""
        self._bound_lock = threading.Lock()

    # ----- the bound --------------------------------------------------------------------------

    def limit(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self._enforce()

    def _records(self) -> list[tuple[float, int, Path]]:
        """(modification time, size, path) of every record, the shared prefixes left out."""
        pinned = hashed_name(PREFIX_KEY) + ".safetensors"
        out = []
        for folder in (self.root / "kv").glob("*"):
            for entry in os.scandir(folder):
                if entry.name.endswith(".safetensors") and not entry.name.startswith("."):
                    try:
                        st = entry.stat()
                    except FileNotFoundError:  # dropped by another process meanwhile
                        continue
                    out.append((st.st_mtime, st.st_size, Path(entry.path), entry.name == pinned))
        return [(m, size, path) for m, size, path, is_prefix in out if not is_prefix]

    def _enforce(self) -> None:
        """Drop the least recently used records until the folder holds LOW_WATER of the bound."""
        with self._bound_lock:
            records = sorted(self._records(), key=lambda r: r[0])
            held = sum(size for _, size, _ in records)
            if held > self.max_bytes:
                target, dropped = int(self.max_bytes * LOW_WATER), 0
                for _, size, path in records:
                    if held <= target:
                        break
                    path.unlink(missing_ok=True)
                    held -= size
                    dropped += 1
                log.info("store %s: dropped %d least recently used caches to stay within %d bytes", self.location,
                         dropped, self.max_bytes)
            self._held = held

    def _touch(self, path: Path) -> None:
        if self.max_bytes is not None:
            try:
                os.utime(path)
            except FileNotFoundError:
                pass

    # ----- records ----------------------------------------------------------------------------

    def kv_path(self, namespace: str, key: str) -> Path:
        return self._path(namespace, self.name_of(key))

    def _path(self, namespace: str, name: str) -> Path:
        return self.root / "kv" / check_namespace(namespace) / f"{name}.safetensors"

    def name_of(self, key: str) -> str:
        return hashed_name(key)

    def put(self, namespace: str, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        path = self.kv_path(namespace, key)
        atomic_write(path, lambda p: save_file(tensors, p, metadata=meta))
        if self.max_bytes is not None and key != PREFIX_KEY:
            with self._bound_lock:
                self._held += path.stat().st_size
                over = self._held > self.max_bytes
            if over:
                self._enforce()

    def get(self, namespace: str, key: str) -> FileRecord | None:
        return self.get_by_name(namespace, self.name_of(key))

    def get_by_name(self, namespace: str, name: str) -> FileRecord | None:
        path = self._path(namespace, name)
        if not path.exists():
            return None
        self._touch(path)
        return FileRecord(path)

    def delete(self, namespace: str, key: str) -> None:
        self.kv_path(namespace, key).unlink(missing_ok=True)

    def list(self, namespace: str) -> list[str]:
        return sorted(p.stem for p in (self.root / "kv" / namespace).glob("*.safetensors"))

    def namespaces(self) -> list[str]:
        return sorted(p.name for p in (self.root / "kv").glob("*") if p.is_dir())

    def nbytes(self, namespace: str) -> int:
        return sum(p.stat().st_size for p in (self.root / "kv" / namespace).glob("*.safetensors"))

    # ----- texts ------------------------------------------------------------------------------

    def text_path(self, chunk_id: str) -> Path:
        return self.root / "texts" / f"{self.text_name(chunk_id)}.json"

    def text_name(self, chunk_id: str) -> str:
        return hashed_name(chunk_id)

    def put_text(self, chunk_id: str, data: dict) -> None:
        atomic_write(self.text_path(chunk_id), lambda p: Path(p).write_text(json.dumps(data, ensure_ascii=False)))

    def get_text(self, chunk_id: str) -> dict | None:
        return self._read_text(self.text_path(chunk_id), missing_ok=True)

    def texts(self) -> list[tuple[str, dict | None]]:
        return [(p.stem, self._read_text(p)) for p in sorted((self.root / "texts").glob("*.json"))]

    def text_count(self) -> int:
        return len(self.text_names())

    def text_names(self) -> list[str]:
        folder = self.root / "texts"
        if not folder.is_dir():
            return []
        return sorted(e.name[:-5] for e in os.scandir(folder) if e.name.endswith(".json") and not e.name.startswith("."))

    def get_text_by_name(self, name: str) -> dict | None:
        return self._read_text(self.root / "texts" / f"{name}.json", missing_ok=True)

    @staticmethod
    def _read_text(path: Path, missing_ok: bool = False) -> dict | None:
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            if not missing_ok:
                log.warning("chunk text file %s vanished", path)
            return None
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
            log.warning("chunk text file %s is unreadable (%s)", path, err)
            return None

    # ----- documents ----------------------------------------------------------------------------

    def put_doc(self, name: str, data: dict) -> None:
        atomic_write(self.root / f"{name}.json", lambda p: Path(p).write_text(json.dumps(data, indent=2)))

    def get_doc(self, name: str) -> dict | None:
        path = self.root / f"{name}.json"
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"store document {path} is unreadable: {err}") from err

    # ----- housekeeping -------------------------------------------------------------------------

    def leftovers(self) -> list[tuple[str, str]]:
        return [(p.parent.name, p.name) for p in self.root.rglob(".tmp-*")]

    def drop_leftovers(self) -> None:
        for tmp in self.root.rglob(".tmp-*"):
            tmp.unlink(missing_ok=True)

    def local_dir(self) -> Path:
        return self.root / "index"

    def close(self) -> None:
        pass


register(PATH_SCHEME, FileBackend)
