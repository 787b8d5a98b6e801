"""The store's memory tier: recently used chunk caches kept in process memory, LRU, bounded in bytes.

Per process and per engine (`StoreConfig.memory_bytes`); it sits in front of every backend, so a
hot chunk is read and verified from the backend once. Thread-safe: requests run concurrently.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .record import ChunkKV

Key = tuple[str, str]
"""(namespace, chunk key)."""


class MemoryTier:
    """An LRU map of caches whose total `ChunkKV.nbytes` stays within `capacity` bytes (a cache
    larger than the whole capacity is not kept)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[Key, ChunkKV] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Key) -> ChunkKV | None:
        """The cache, now the most recently used; None when absent."""
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
            return hit

    def put(self, key: Key, kv: ChunkKV) -> None:
        """Keep `kv` (replacing what `key` held), evicting the least recently used past capacity."""
        size = kv.nbytes
        if size > self.capacity:
            return
        with self._lock:
            self._drop(key)
            self._items[key] = kv
            self._bytes += size
            while self._bytes > self.capacity:
                _, evicted = self._items.popitem(last=False)
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
            self._bytes -= old.nbytes
