"""Where a store's bytes live: one `KVBackend` protocol, one file per implementation.

`files` (a folder: the embedded default), `memory` (in-process, `memory://name`), `redis`
(`redis://host:port/db`, shared by several processes or machines). `open_backend` picks one
from a path or URL. To add one: write a file with a class that implements `KVBackend` (base.py)
and name its URL scheme in `SCHEMES`; the contract suite in tests/test_backends.py runs it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .base import KVBackend, Record, StoreUnavailableError

SCHEMES = ("memory", "redis", "rediss")


def open_backend(location: str | os.PathLike) -> KVBackend:
    """A backend for a folder path or a store URL; a ValueError names a malformed or unknown one."""
    if isinstance(location, Path) or "://" not in str(location):
        from .files import FileBackend

        return FileBackend(Path(location))
    url = str(location)
    scheme = url.split("://", 1)[0].lower()
    if scheme == "memory":
        from .memory import MemoryBackend

        return MemoryBackend.named(url)
    if scheme in ("redis", "rediss"):
        from .redis import RedisBackend

        return RedisBackend(url)
    raise ValueError(f"store {url!r}: unknown URL scheme {scheme!r}; expected a folder path or one of "
                     f"{[s + '://' for s in SCHEMES]}")


__all__ = ["KVBackend", "Record", "StoreUnavailableError", "open_backend", "SCHEMES"]
