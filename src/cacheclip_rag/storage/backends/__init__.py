"""Where a store's bytes live: one `KVBackend` protocol (base.py), one file per implementation.

`files` (a folder: the embedded default), `memory` (in-process, `memory://name`), `redis`
(`redis://host:port/db`, shared by several processes or machines). Each module registers its URL
scheme (`base.register`) when imported, as here; `open_backend` picks one from a path or URL.
To add one: write a module with a class that implements `KVBackend`, call
`register("scheme", opener)` in it, and import it; the contract suite in tests/storage/test_backends.py
runs against every implementation.
"""

from __future__ import annotations

from . import files, memory, redis  # noqa: F401  (each registers its scheme)
from .base import (
    KVBackend,
    Record,
    StoreUnavailableError,
    open_backend,
    register,
    schemes,
    unregister,
)

__all__ = ["KVBackend", "Record", "StoreUnavailableError", "open_backend", "register", "schemes", "unregister"]
