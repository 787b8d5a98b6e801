"""The store's memory tier: recently used chunk caches kept in process memory, LRU, bounded in bytes.

Per process and per engine (`StoreConfig.memory_bytes`); it sits in front of every backend, so a
hot chunk is read and verified from the backend once. Thread-safe: requests run concurrently.

An entry may hold a cache's first layers only (a *partial* entry): what a reader that stops early
read, the aux model's scoring pass, which needs its layers up to the deepest scoring layer and
no more. A partial entry serves reads of at most its layers, never a read of the whole cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .record import ChunkKV

Key = tuple[str, str]
"""(namespace, chunk key)."""


class MemoryTier:
    """An LRU map of caches whose total `ChunkKV.nbytes` stays within `capacity` bytes (a cache
    larger than the whole capacity is not kept); each entry whole or partial (its first layers)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[Key, tuple[ChunkKV, bool]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Key, layers: int | None = None) -> ChunkKV | None:
        """The cache, now the most recently used, or None. layers None: only a whole cache
        answers; an int: a partial entry with at least that many layers answers too (the caller
        reads its first `layers`)."""
        with self._lock:
            entry = self._items.get(key)
            if entry is None:
                return None
            kv, whole = entry
            if not whole and (layers is None or len(kv.keys) < layers):
                return None
            self._items.move_to_end(key)
            return kv

    def put(self, key: Key, kv: ChunkKV, whole: bool = True) -> None:
        """Keep `kv` (whole, or its first layers only), evicting the least recently used past
        capacity. A partial `kv` never replaces a whole entry or a partial one with more layers."""
        size = kv.nbytes
        if size > self.capacity:
            return
        with self._lock:
            held = self._items.get(key)
            if not whole and held is not None and (held[1] or len(held[0].keys) >= len(kv.keys)):
                self._items.move_to_end(key)
                return
            self._drop(key)
            self._items[key] = (kv, whole)
            self._bytes += size
            while self._bytes > self.capacity:
                _, (evicted, _) = self._items.popitem(last=False)
                self._bytes -= evicted.nbytes

    def keys(self) -> list[Key]:
        """What the tier holds, least recently used first."""
        with self._lock:
            return list(self._items)

    def pop(self, key: Key) -> None:
        with self._lock:
            self._drop(key)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _drop(self, key: Key) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._bytes -= old[0].nbytes
