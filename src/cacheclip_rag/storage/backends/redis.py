"""A store in Redis (`redis://host:port/db`), shared by every engine process that names it.

Keys, under a prefix (default "cacheclip"; `?prefix=NAME` in the URL keeps several stores in one
database apart):

    P:kv:<namespace>:<h>   hash: "__meta__" (JSON: metadata, each tensor's dtype and shape) and
                           one field of raw bytes per tensor (read one layer at a time)
    P:names:<namespace>    set of the record names in a namespace;  P:namespaces: set
    P:text:<h>             one chunk text (JSON);  P:texts: set of their names
    P:doc:<name>           a named document (manifest, profile)
    P:lru, P:sizes         with `?max_bytes=N`: records by last write and their sizes, for the bound

A record is written in one MULTI/EXEC transaction (delete, then write every field, then the
index sets): a reader sees the old record or the new one, and a connection that drops before
EXEC leaves nothing. Every call has a socket timeout; a server that cannot be reached or that
drops raises `StoreUnavailableError` naming the URL.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import torch

from ...paths import cache_dir
from .base import PREFIX_KEY, StoreUnavailableError, hashed_name, register

log = logging.getLogger(__name__)

_META = "__meta__"
TIMEOUT_S = 5.0
"""Seconds any one Redis call may take before the store is reported unavailable."""


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


class RedisRecord:
    def __init__(self, backend: RedisBackend, key: str, meta: dict, specs: dict[str, tuple[str, list[int]]]):
        self._backend, self._key, self.meta, self._specs = backend, key, meta, specs

    def names(self) -> set[str]:
        return set(self._specs)

    def tensor(self, name: str) -> torch.Tensor:
        dtype_name, shape = self._specs[name]
        raw = self._backend.call(lambda r: r.hget(self._key, name))
        if raw is None:
            raise ValueError(f"tensor {name} is missing from {self._key}")
        dtype = _dtype(dtype_name)
        count = 1
        for d in shape:
            count *= int(d)
        if len(raw) != count * torch.empty(0, dtype=dtype).element_size():
            raise ValueError(f"tensor {name} in {self._key} has {len(raw)} bytes, expected shape {shape} of {dtype_name}")
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape) if count else torch.empty(shape, dtype=dtype)

    def close(self) -> None:
        pass


class RedisBackend:
    def __init__(self, url: str):
        import redis

        self.location = url
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        try:
            port = parts.port
        except ValueError as err:
            raise ValueError(f"store URL {url!r} is malformed: {err}") from None
        if not parts.hostname and parts.scheme != "unix":
            raise ValueError(f"store URL {url!r} names no host; expected redis://host:port/db")
        db_part = parts.path.strip("/") or "0"
        if not db_part.isdigit():
            raise ValueError(f"store URL {url!r}: the database must be a number (redis://host:port/0), got {db_part!r}")
        self.prefix = (query.get("prefix") or ["cacheclip"])[0]
        bound = (query.get("max_bytes") or [None])[0]
        if bound is not None and not bound.isdigit():
            raise ValueError(f"store URL {url!r}: max_bytes must be a whole number of bytes, got {bound!r}")
        self.max_bytes = int(bound) if bound is not None else None
        self._redis = redis.Redis(host=parts.hostname or "localhost", port=port or 6379, db=int(db_part),
                                  password=parts.password, username=parts.username, ssl=parts.scheme == "rediss",
                                  socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S, retry=None)
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self._response_error = redis.exceptions.ResponseError
        self.call(lambda r: r.ping())
        self._dir = None

    def limit(self, max_bytes: int) -> None:
        """Hold at most max_bytes of records from now on (the URL's ?max_bytes=N does the same)."""
        self.max_bytes = int(max_bytes)
        self._enforce_bound()

    def call(self, fn):
        """Run fn(client); a dropped or unreachable server becomes a StoreUnavailableError."""
        try:
            return fn(self._redis)
        except self._errors as err:
            raise StoreUnavailableError(f"store {self.location}: the Redis server is unreachable or went away "
                                        f"({type(err).__name__}: {err})") from err
        except self._response_error as err:
            raise StoreUnavailableError(f"store {self.location}: the Redis server refused a command ({err})") from err

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    # ----- records ----------------------------------------------------------------------------

    def name_of(self, key: str) -> str:
        return hashed_name(key)

    def put(self, namespace: str, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        name = self.name_of(key)
        rkey = self._k("kv", namespace, name)
        specs = {n: [str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in tensors.items()}
        fields = {_META: json.dumps({"meta": meta, "tensors": specs})}
        size = 0
        for n, t in tensors.items():
            data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            fields[n] = data
            size += len(data)

        def write(r):
            pipe = r.pipeline(transaction=True)
            pipe.delete(rkey)
            pipe.hset(rkey, mapping=fields)
            pipe.sadd(self._k("names", namespace), name)
            pipe.sadd(self._k("namespaces"), namespace)
            if self.max_bytes is not None and key != PREFIX_KEY:  # the shared prefix is never dropped
                pipe.zadd(self._k("lru"), {f"{namespace}:{name}": time.time()})
                pipe.hset(self._k("sizes"), f"{namespace}:{name}", size)
            pipe.execute()

        self.call(write)
        if self.max_bytes is not None:
            self._enforce_bound()

    def _enforce_bound(self) -> None:
        """Drop the oldest records until the store holds at most max_bytes of tensors."""
        while True:
            sizes = self.call(lambda r: r.hgetall(self._k("sizes")))
            if sum(int(v) for v in sizes.values()) <= self.max_bytes:
                return
            oldest = self.call(lambda r: r.zrange(self._k("lru"), 0, 0))
            if not oldest:
                return
            member = oldest[0].decode()
            namespace, name = member.split(":", 1)
            self._delete_name(namespace, name)
            log.info("store %s: dropped %s to stay within %d bytes", self.location, member, self.max_bytes)

    def get(self, namespace: str, key: str) -> RedisRecord | None:
        return self.get_by_name(namespace, self.name_of(key))

    def get_by_name(self, namespace: str, name: str) -> RedisRecord | None:
        rkey = self._k("kv", namespace, name)
        raw = self.call(lambda r: r.hget(rkey, _META))
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
            specs = {n: (str(d), [int(x) for x in s]) for n, (d, s) in doc["tensors"].items()}
            meta = {str(k): str(v) for k, v in doc["meta"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"record {rkey} has unreadable metadata ({err})") from err
        return RedisRecord(self, rkey, meta, specs)

    def delete(self, namespace: str, key: str) -> None:
        self._delete_name(namespace, self.name_of(key))

    def _delete_name(self, namespace: str, name: str) -> None:
        def drop(r):
            pipe = r.pipeline(transaction=True)
            pipe.delete(self._k("kv", namespace, name))
            pipe.srem(self._k("names", namespace), name)
            pipe.zrem(self._k("lru"), f"{namespace}:{name}")
            pipe.hdel(self._k("sizes"), f"{namespace}:{name}")
            pipe.execute()

        self.call(drop)

    def list(self, namespace: str) -> list[str]:
        return sorted(m.decode() for m in self.call(lambda r: r.smembers(self._k("names", namespace))))

    def namespaces(self) -> list[str]:
        return sorted(m.decode() for m in self.call(lambda r: r.smembers(self._k("namespaces"))))

    def nbytes(self, namespace: str) -> int:
        return sum(int(self.call(lambda r, n=n: r.memory_usage(self._k("kv", namespace, n)) or 0))
                   for n in self.list(namespace))

    # ----- texts ------------------------------------------------------------------------------

    def text_name(self, chunk_id: str) -> str:
        return hashed_name(chunk_id)

    def put_text(self, chunk_id: str, data: dict) -> None:
        name = self.text_name(chunk_id)

        def write(r):
            pipe = r.pipeline(transaction=True)
            pipe.set(self._k("text", name), json.dumps(data, ensure_ascii=False))
            pipe.sadd(self._k("texts"), name)
            pipe.execute()

        self.call(write)

    def get_text(self, chunk_id: str) -> dict | None:
        return self._text(self.text_name(chunk_id))

    def _text(self, name: str) -> dict | None:
        raw = self.call(lambda r: r.get(self._k("text", name)))
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            log.warning("chunk text %s in %s is unreadable (%s)", name, self.location, err)
            return None

    def texts(self) -> list[tuple[str, dict | None]]:
        return [(name, self._text(name)) for name in self.text_names()]

    def text_count(self) -> int:
        return int(self.call(lambda r: r.scard(self._k("texts"))))

    def text_names(self) -> list[str]:
        return sorted(m.decode() for m in self.call(lambda r: r.smembers(self._k("texts"))))

    def get_text_by_name(self, name: str) -> dict | None:
        return self._text(name)

    # ----- documents ----------------------------------------------------------------------------

    def put_doc(self, name: str, data: dict) -> None:
        self.call(lambda r: r.set(self._k("doc", name), json.dumps(data, indent=2)))

    def get_doc(self, name: str) -> dict | None:
        raw = self.call(lambda r: r.get(self._k("doc", name)))
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError as err:
            raise ValueError(f"store document {name} in {self.location} is unreadable: {err}") from err

    # ----- housekeeping -------------------------------------------------------------------------

    def leftovers(self) -> list[tuple[str, str]]:
        return []  # MULTI/EXEC leaves no partial record behind

    def drop_leftovers(self) -> None:
        pass

    def local_dir(self) -> Path:
        """This process's working copy of the chunk index (rebuilt from the shared texts when new)."""
        if self._dir is None:
            digest = hashlib.sha256(f"{self.location}|{self.prefix}".encode()).hexdigest()[:16]
            self._dir = cache_dir() / "redis-index" / digest
        return self._dir

    def flush(self) -> None:
        """Delete every key of this store's prefix (tests, `store clear`)."""
        def drop(r):
            for key in r.scan_iter(match=f"{self.prefix}:*", count=500):
                r.delete(key)

        self.call(drop)

    def close(self) -> None:
        self._redis.close()


register("redis", RedisBackend)
register("rediss", RedisBackend)
