"""What a store holds and whether it is sound: `KVStore.usage` and `KVStore.verify` read through
here, over the store's backend and manifest; nothing here writes."""

from __future__ import annotations

import json
from collections.abc import Callable

from . import codecs
from .backends import KVBackend, StoreUnavailableError
from .record import DamagedCacheError, LayerReader


def usage(backend: KVBackend, manifest: dict, max_bytes: int | None) -> dict:
    """Chunks, the bound, and per namespace its caches, stored bytes, tokens and bytes per token
    (each record's token count read from its token ids, not its layers)."""
    texts = backend.texts()
    out = {"chunks": len(texts), "text_bytes": sum(len(json.dumps(d)) for _, d in texts if d),
           "max_bytes": max_bytes, "namespaces": {}}
    names = manifest.get("namespaces", {})
    for ns in backend.namespaces():
        listed = backend.list(ns)
        tokens = sum(_tokens(backend, ns, name) for name in listed)
        nbytes = backend.nbytes(ns)
        out["namespaces"][ns] = {"kv_codec": codecs.DEFAULT_CODEC, **names.get(ns, {}), "caches": len(listed),
                                 "bytes": nbytes, "tokens": tokens,
                                 "bytes_per_token": nbytes / tokens if tokens else None}
    return out


def _tokens(backend: KVBackend, namespace: str, name: str) -> int:
    try:
        record = backend.get_by_name(namespace, name)
        if record is None:
            return 0
        try:
            return int(record.tensor("token_ids").numel())
        finally:
            record.close()
    except StoreUnavailableError:
        raise
    except (OSError, ValueError, KeyError):
        return 0


def verify(backend: KVBackend, manifest: dict, max_bytes: int | None,
           record_codec: Callable[[str, str], str]) -> dict:
    """Check every cache (parse, names, every checksum) and every chunk text.

    record_codec(namespace, key): the codec a record must carry. Returns {"checked": n,
    "damaged": [(namespace, name, why)], "orphans": [...], "missing": {namespace: [chunk ids
    without a cache]}, "bad_texts": [names]}. Nothing is changed.
    """
    report = {"checked": 0, "damaged": [], "orphans": [], "missing": {}, "bad_texts": []}
    on_demand = {ns for ns, info in manifest.get("namespaces", {}).items() if info.get("packets")}
    bounded = max_bytes is not None  # a bounded store drops caches by design: absent is fine
    chunk_ids, expected = set(), set()
    for name, data in backend.texts():
        ok = isinstance(data, dict) and isinstance(data.get("id"), str) and isinstance(data.get("text"), str) \
            and name == backend.text_name(data["id"])
        if ok:
            chunk_ids.add(data["id"])
            if not data.get("lazy"):  # a lazy chunk's caches are built on first use
                expected.add(data["id"])
        else:
            report["bad_texts"].append(f"{name}: unreadable, or its name or text does not match")
    for ns in backend.namespaces():
        have = set()
        for name in backend.list(ns):
            report["checked"] += 1
            try:
                record = backend.get_by_name(ns, name)
                if record is None:
                    continue
                key = record.meta.get("key", "")
                reader = LayerReader(record, ns, key, record_codec(ns, key))
                for i in range(reader.num_layers):
                    reader.layer(i)
                reader.close()
                if name != backend.name_of(key):
                    raise DamagedCacheError("stored name does not match its key")
            except StoreUnavailableError:
                raise
            except (OSError, ValueError, KeyError) as err:
                report["damaged"].append((ns, name, str(err)))
                continue
            have.add(key)
            if key not in chunk_ids and not key.startswith("__"):
                report["orphans"].append((ns, key))
        missing = sorted(expected - have)
        if missing and ns not in on_demand and not bounded:  # packet caches are built on first use: absent is fine
            report["missing"][ns] = missing
    for where, name in backend.leftovers():
        report["damaged"].append((where, name, "leftover temporary file from an interrupted write"))
    return report
