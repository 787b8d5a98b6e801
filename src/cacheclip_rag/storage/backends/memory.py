"""An in-process store (`memory://name`): every engine of one process that names it shares it.
Nothing outlives the process; for tests, scratch work and ephemeral serving."""

from __future__ import annotations

import copy
import shutil
import tempfile
import threading
import weakref
from pathlib import Path

import torch

from .base import HeldRecord, hashed_name, register


MemoryRecord = HeldRecord


class MemoryBackend:
    _named: dict[str, MemoryBackend] = {}
    _named_lock = threading.Lock()

    def __init__(self, location: str = "memory://"):
        self.location = location
        self._records: dict[tuple[str, str], tuple[dict[str, torch.Tensor], dict[str, str]]] = {}
        self._texts: dict[str, dict] = {}
        self._docs: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._dir = Path(tempfile.mkdtemp(prefix="cacheclip-memory-store-"))
        # the folder (what an engine keeps beside its store, e.g. the chunk index) goes with the
        # store, at the latest when the process exits: nothing of a memory store outlives it
        weakref.finalize(self, shutil.rmtree, self._dir, True)

    @classmethod
    def named(cls, url: str) -> MemoryBackend:
        """The process-wide store of this URL (created on first use)."""
        with cls._named_lock:
            if url not in cls._named:
                cls._named[url] = cls(url)
            return cls._named[url]

    def name_of(self, key: str) -> str:
        return hashed_name(key)

    def put(self, namespace: str, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        record = ({n: t.detach().clone() for n, t in tensors.items()}, dict(meta))
        with self._lock:  # one assignment: readers see the old record or the new one
            self._records[(namespace, self.name_of(key))] = record

    def get(self, namespace: str, key: str) -> MemoryRecord | None:
        return self.get_by_name(namespace, self.name_of(key))

    def get_by_name(self, namespace: str, name: str) -> MemoryRecord | None:
        with self._lock:
            found = self._records.get((namespace, name))
        return MemoryRecord(*found) if found is not None else None

    def delete(self, namespace: str, key: str) -> None:
        with self._lock:
            self._records.pop((namespace, self.name_of(key)), None)

    def list(self, namespace: str) -> list[str]:
        with self._lock:
            return sorted(name for ns, name in self._records if ns == namespace)

    def namespaces(self) -> list[str]:
        with self._lock:
            return sorted({ns for ns, _ in self._records})

    def nbytes(self, namespace: str) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for (ns, _), (ts, _) in self._records.items() if ns == namespace
                       for t in ts.values())

    def text_name(self, chunk_id: str) -> str:
        return hashed_name(chunk_id)

    def put_text(self, chunk_id: str, data: dict) -> None:
        with self._lock:
            self._texts[self.text_name(chunk_id)] = copy.deepcopy(data)

    def get_text(self, chunk_id: str) -> dict | None:
        with self._lock:
            found = self._texts.get(self.text_name(chunk_id))
        return copy.deepcopy(found)

    def texts(self) -> list[tuple[str, dict | None]]:
        with self._lock:
            return [(name, copy.deepcopy(data)) for name, data in sorted(self._texts.items())]

    def text_count(self) -> int:
        with self._lock:
            return len(self._texts)

    def text_names(self) -> list[str]:
        with self._lock:
            return sorted(self._texts)

    def get_text_by_name(self, name: str) -> dict | None:
        with self._lock:
            return copy.deepcopy(self._texts.get(name))

    def put_doc(self, name: str, data: dict) -> None:
        with self._lock:
            self._docs[name] = copy.deepcopy(data)

    def get_doc(self, name: str) -> dict | None:
        with self._lock:
            return copy.deepcopy(self._docs.get(name))

    def leftovers(self) -> list[tuple[str, str]]:
        return []

    def drop_leftovers(self) -> None:
        pass

    def local_dir(self) -> Path:
        return self._dir

    def close(self) -> None:
        pass


register("memory", MemoryBackend.named)
