"""The protocol every store backend implements.

A backend keeps bytes and nothing else: per (namespace, key) records of named tensors with
string metadata, chunk texts (small JSON documents keyed by chunk id) and named JSON documents
(the manifest, the profile). Checksums, the memory tier and
the meaning of it all live in `cacheclip_rag.storage.store.KVStore`, once, above every backend.

Guarantees each backend gives: `put` is atomic (a reader sees the old record or the new one,
never a part); a record is read tensor by tensor (layer-wise loading); failures of the medium
(an unreachable server, a dropped connection) raise `StoreUnavailableError` naming the store
within a bounded time, never hang.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

_HEX = re.compile(r"^[0-9a-f]{8,64}$")

PREFIX_KEY = "__shared_prefix__"
"""The key of a namespace's shared-prefix cache. Keys starting "__" are not chunks; a bounded
backend never drops the prefix (every request of the namespace reads it)."""


def check_namespace(namespace: str) -> str:
    """A namespace is a hex digest (8-64 digits), so it is safe as a folder name and a key part."""
    if not isinstance(namespace, str) or not _HEX.match(namespace):
        raise ValueError(f"store namespace must be a hex digest, got {namespace!r}")
    return namespace


def hashed_name(key: str) -> str:
    """The name a key or chunk id is stored under: a hash, so none ever becomes a path or a server key."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:40]


class StoreUnavailableError(ValueError):
    """The store's medium failed (server unreachable or gone mid-request); names the store."""


class Record(Protocol):
    """One stored record, opened for reading tensor by tensor."""

    meta: dict[str, str]

    def names(self) -> set[str]: ...

    def tensor(self, name: str) -> torch.Tensor: ...

    def close(self) -> None: ...


class HeldRecord:
    """A record's tensors and metadata held in memory, read like a stored one (the memory backend's
    records; a record just encoded, read back before it is stored)."""

    def __init__(self, tensors: dict[str, torch.Tensor], meta: dict[str, str]):
        self.meta = dict(meta)
        self._tensors = tensors

    def names(self) -> set[str]:
        return set(self._tensors)

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def close(self) -> None:
        pass


class KVBackend(Protocol):
    location: str
    """The path or URL the store was named by (for messages)."""

    # per-(namespace, key) tensors
    def put(self, namespace: str, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None: ...

    def get(self, namespace: str, key: str) -> Record | None:
        """The record, or None when absent. A record that cannot be parsed raises ValueError."""

    def delete(self, namespace: str, key: str) -> None: ...

    def list(self, namespace: str) -> list[str]:
        """The record names (hashed keys) in a namespace; `get_by_name` opens one."""

    def get_by_name(self, namespace: str, name: str) -> Record | None: ...

    def name_of(self, key: str) -> str:
        """The name a key is stored under (a hash: no key ever becomes a path or a server key)."""

    def namespaces(self) -> list[str]: ...

    def nbytes(self, namespace: str) -> int: ...

    # chunk texts
    def put_text(self, chunk_id: str, data: dict) -> None: ...

    def get_text(self, chunk_id: str) -> dict | None:
        """The stored document, or None when absent or unreadable (logged)."""

    def texts(self) -> list[tuple[str, dict | None]]:
        """Every text as (name, document or None when unreadable)."""

    def text_count(self) -> int:
        """How many texts are stored (cheap: processes sharing a store poll it to catch up)."""

    def text_names(self) -> list[str]:
        """The names of every stored text, without reading them."""

    def get_text_by_name(self, name: str) -> dict | None:
        """The text stored under `name` (`text_name`), None when absent or unreadable (logged)."""

    def text_name(self, chunk_id: str) -> str: ...

    # named documents (the manifest, the profile)
    def put_doc(self, name: str, data: dict) -> None: ...

    def get_doc(self, name: str) -> dict | None:
        """The document, None when absent; a ValueError naming the store when unreadable."""

    # housekeeping
    def leftovers(self) -> list[tuple[str, str]]:
        """(namespace or folder, name) of pieces of interrupted writes."""

    def drop_leftovers(self) -> None: ...

    def local_dir(self) -> Path:
        """A local folder for what must be a file (the FAISS index working copy)."""

    def close(self) -> None: ...


class BoundedBackend(KVBackend, Protocol):
    """A backend that can hold at most a number of bytes of records (folders, Redis): past it,
    the least recently used records are dropped (the store rebuilds them from their texts)."""

    max_bytes: int | None

    def limit(self, max_bytes: int) -> None:
        """Keep at most max_bytes of records from now on (dropping some at once if over)."""


_OPENERS: dict[str, Callable[[str], KVBackend]] = {}
PATH_SCHEME = "file"
"""The scheme a plain folder path opens with (`open_backend("my-store")`)."""


def register(scheme: str, opener: Callable[[str], KVBackend]) -> None:
    """Make `open_backend` open locations of `scheme` (a URL scheme; "file" for folder paths)
    with `opener`, which takes the path or URL as given. Each backend module registers itself."""
    if not isinstance(scheme, str) or not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise ValueError(f"a backend scheme must be a lowercase URL scheme, got {scheme!r}")
    _OPENERS[scheme] = opener


def unregister(scheme: str) -> None:
    _OPENERS.pop(scheme, None)


def schemes() -> tuple[str, ...]:
    """The URL schemes a store may be named by (besides a folder path)."""
    return tuple(s for s in _OPENERS if s != PATH_SCHEME)


def open_backend(location: str | os.PathLike) -> KVBackend:
    """A backend for a folder path or a store URL; a ValueError names a malformed or unknown one."""
    if isinstance(location, os.PathLike) or "://" not in str(location):
        return _OPENERS[PATH_SCHEME](os.fspath(location))
    url = str(location)
    scheme = url.split("://", 1)[0].lower()
    if scheme not in _OPENERS or scheme == PATH_SCHEME:
        raise ValueError(f"store {url!r}: unknown URL scheme {scheme!r}; expected a folder path or one of "
                         f"{[s + '://' for s in schemes()]}")
    return _OPENERS[scheme](url)
