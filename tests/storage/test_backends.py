"""The KVBackend contract, run against every backend: files, memory and Redis.

The same guarantees everywhere: round trip, tensor-by-tensor reads, checksums (a damaged value
is detected, removed and reported missing, never used), atomic puts (a failed write leaves the
old record), namespaces kept apart, texts and documents, verify. Then what only a server can do
wrong: a malformed URL, an unreachable server, a server that goes away mid-request.
"""

import time
import uuid

import pytest
import torch
from test_store import NS, _equal, _kv

from cacheclip_rag.storage.backends import StoreUnavailableError, open_backend
from cacheclip_rag.storage.profiles import Profile
from cacheclip_rag.storage.record import Chunk
from cacheclip_rag.storage.store import KVStore

OTHER_NS = "cd" * 16


@pytest.fixture(params=["files", "memory", "redis"])
def store(request, tmp_path):
    if request.param == "files":
        yield KVStore(tmp_path / "store")
    elif request.param == "memory":
        yield KVStore(f"memory://test-{uuid.uuid4().hex}")
    else:
        yield KVStore(request.getfixturevalue("redis_store_url"))


def _corrupt(store: KVStore, namespace: str, key: str) -> None:
    """Damage one stored tensor in place, as a disk or a careless writer would."""
    backend, name = store.backend, store.backend.name_of(key)
    kind = type(backend).__name__
    if kind == "FileBackend":
        path = backend.kv_path(namespace, key)
        data = bytearray(path.read_bytes())
        data[-20:-10] = b"\xff" * 10
        path.write_bytes(bytes(data))
    elif kind == "MemoryBackend":
        record = backend.get_by_name(namespace, name)
        record.tensor("v.2").add_(1)  # the record's own tensor: the stored bytes change
    else:
        backend.call(lambda r: r.hset(backend._k("kv", namespace, name), "v.2", b"\x00" * 16))


def test_round_trip_layer_by_layer(store):
    kv = _kv()
    store.put_kv(NS, "c1", kv)
    store.clear_memory()
    _equal(store.get_kv(NS, "c1"), kv)
    store.clear_memory()
    reader = store.open_layers(NS, "c1")
    assert reader.num_layers == 3 and torch.equal(reader.token_ids, kv.token_ids)
    for i in range(3):
        k, v = reader.layer(i)
        assert torch.equal(k, kv.keys[i]) and torch.equal(v, kv.values[i])


def test_missing_and_namespaces_apart(store):
    store.put_kv(NS, "c1", _kv())
    store.clear_memory()
    assert store.get_kv(OTHER_NS, "c1") is None and store.get_kv(NS, "nope") is None
    assert store.backend.list(NS) == [store.backend.name_of("c1")] and store.backend.list(OTHER_NS) == []


def test_damage_is_detected_removed_and_reported_missing(store):
    store.put_kv(NS, "c1", _kv())
    store.put_kv(NS, "c2", _kv(seed=3))
    store.clear_memory()
    _corrupt(store, NS, "c1")
    report = store.verify()
    assert [d[1] for d in report["damaged"]] == [store.backend.name_of("c1")]
    assert store.get_kv(NS, "c1") is None  # detected: removed, never served
    assert store.stats.damaged == 1 and store.backend.get(NS, "c1") is None
    _equal(store.get_kv(NS, "c2"), _kv(seed=3))
    assert store.verify()["damaged"] == []


def test_damage_found_while_loading_layers(store):
    from cacheclip_rag.storage.record import DamagedCacheError

    kv = _kv()
    store.put_kv(NS, "c1", kv)
    store.clear_memory()
    _corrupt(store, NS, "c1")
    reader = store.open_layers(NS, "c1")
    k, v = reader.layer(0)  # the intact first layer reads back as written
    assert torch.equal(k, kv.keys[0]) and torch.equal(v, kv.values[0])
    with pytest.raises(DamagedCacheError):
        reader.layer(2)


def _put_with_sums(store: KVStore, key: str, kv, algorithm: str | None) -> None:
    """A record as `put_kv` writes it, but carrying `algorithm`'s checksums (None: none at all)."""
    import json

    from cacheclip_rag.storage import record

    tensors = {name: t.contiguous() for name, t in kv.tensors().items()}
    meta = {"format": "1", "key": key, "namespace": NS, "start_pos": str(kv.start_pos), "num_layers": str(len(kv.keys))}
    if algorithm is not None:
        meta[algorithm] = json.dumps({n: record.tensor_sum(n, t, algorithm) for n, t in tensors.items()})
    store.backend.put(NS, key, tensors, meta)


def test_caches_written_with_sha256_sums_still_read_and_their_damage_is_still_found(store):
    from cacheclip_rag.storage.record import CHECKSUM

    assert CHECKSUM == "xxh3_128"
    _put_with_sums(store, "old", _kv(seed=4), "sha256")  # a store written before XXH3
    _equal(store.get_kv(NS, "old"), _kv(seed=4))
    store.clear_memory()
    _corrupt(store, NS, "old")
    assert [d[1] for d in store.verify()["damaged"]] == [store.backend.name_of("old")]
    assert store.get_kv(NS, "old") is None and store.stats.damaged == 1


def test_a_record_without_checksums_is_damaged_not_trusted(store):
    _put_with_sums(store, "bare", _kv(), None)
    damaged = store.verify()["damaged"]
    assert len(damaged) == 1 and "no checksums" in damaged[0][2]
    assert store.get_kv(NS, "bare") is None and store.backend.get(NS, "bare") is None


def test_failed_put_leaves_the_old_record(store, monkeypatch):
    old = _kv(seed=1)
    store.put_kv(NS, "c1", old)
    kind = type(store.backend).__name__
    if kind == "FileBackend":
        from cacheclip_rag.storage.backends import files

        def broken(tensors, path, metadata=None):
            open(path, "wb").write(b"partial")
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(files, "save_file", broken)
        error = OSError
    elif kind == "MemoryBackend":
        def broken(*a, **k):
            raise MemoryError("out of memory")

        monkeypatch.setattr(torch.Tensor, "clone", broken)
        error = MemoryError
    else:
        import redis

        def dropped(self, *a, **k):  # the connection goes away before EXEC: nothing applied
            raise redis.exceptions.ConnectionError("connection reset by peer")

        monkeypatch.setattr(redis.client.Pipeline, "execute", dropped)
        error = StoreUnavailableError
    with pytest.raises(error):
        store.put_kv(NS, "c1", _kv(seed=2))
    monkeypatch.undo()
    store.clear_memory()
    _equal(store.get_kv(NS, "c1"), old)
    assert store.verify()["damaged"] == []


def test_texts_documents_and_delete(store):
    chunk = Chunk("id-1", "Zürich text", "doc0", 0, 11)
    store.put_chunk(chunk)
    assert store.get_chunk("id-1") == chunk and store.chunk_ids() == ["id-1"] and store.get_chunk("x") is None
    store.bind_models({"primary": "p1", "aux": "a1"})
    with pytest.raises(ValueError, match="different primary model"):
        store.bind_models({"primary": "p2", "aux": "a1"})
    store.write_profile(Profile(primary="p1", aux="a1", aux_layers=(3,)))
    assert store.read_profiles("p1", "a1")[0].aux_layers == (3,) and store.read_profiles("p9", "a1") == []
    store.put_kv(NS, "id-1", _kv())
    store.discard(NS, "id-1", "test")
    assert store.get_kv(NS, "id-1") is None
    assert store.verify()["missing"] == {} or store.verify()["missing"].get(NS) == ["id-1"]


def test_a_store_is_named_by_a_path_or_a_url(tmp_path):
    assert type(open_backend(tmp_path).__class__) and open_backend(str(tmp_path)).location == str(tmp_path)
    assert type(open_backend("memory://x")).__name__ == "MemoryBackend"
    with pytest.raises(ValueError, match=r"unknown URL scheme 'ftp'.*'memory://', 'redis://'"):
        open_backend("ftp://host/x")


def test_a_backend_registers_its_scheme_and_the_store_opens_it_by_url(tmp_path):
    """The seam: a backend module registers an opener; `KVStore` opens its URLs without naming it."""
    from cacheclip_rag.storage.backends import register, schemes, unregister
    from cacheclip_rag.storage.backends.memory import MemoryBackend

    opened = []
    register("scratch", lambda url: opened.append(url) or MemoryBackend(url))
    try:
        store = KVStore("scratch://one")
        assert opened == ["scratch://one"] and store.location == "scratch://one" and "scratch" in schemes()
        store.put_chunk(Chunk("id-1", "text", "doc", 0, 4))
        assert store.get_chunk("id-1").text == "text"
    finally:
        unregister("scratch")
    with pytest.raises(ValueError, match="scheme"):
        register("Bad Scheme", MemoryBackend)


@pytest.mark.parametrize("url, match", [
    ("redis://127.0.0.1:notaport/0", "malformed"),
    ("redis:///0", "names no host"),
    ("redis://127.0.0.1:6379/zero", "database must be a number"),
    ("redis://127.0.0.1:6379/0?max_bytes=lots", "max_bytes"),
])
def test_malformed_redis_urls_are_refused(url, match):
    with pytest.raises(ValueError, match=match):
        open_backend(url)


def test_unreachable_redis_is_a_clear_error_naming_the_url():
    from conftest import _free_port

    url = f"redis://127.0.0.1:{_free_port()}/0"
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=url.replace("/", ".")):
        KVStore(url)
    assert time.monotonic() - start < 30  # bounded: the connect timeout, not a hang


def test_redis_server_gone_mid_request():
    """A server that dies between requests: the next call fails fast, naming the URL."""
    from conftest import RedisServer

    try:
        server = RedisServer()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    store = KVStore(server.url)
    store.put_kv(NS, "c1", _kv())
    store.clear_memory()
    reader = store.open_layers(NS, "c1")
    server.stop()
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="unreachable or went away"):
        reader.layer(0)
    with pytest.raises(StoreUnavailableError, match=str(server.port)):
        store.put_kv(NS, "c2", _kv())
    assert time.monotonic() - start < 30


def test_redis_size_bound_drops_the_oldest(redis_store_url):
    kv = _kv()
    size = sum(t.numel() * t.element_size() for t in kv.tensors().values())
    store = KVStore(f"{redis_store_url}&max_bytes={int(size * 2.5)}")
    for i in range(4):
        store.put_kv(NS, f"c{i}", kv)
    store.clear_memory()
    assert [store.get_kv(NS, f"c{i}") is not None for i in range(4)] == [False, False, True, True]


def test_a_memory_store_leaves_no_folder_behind(tmp_path):
    """`memory://` keeps nothing past its life: its scratch folder goes when the store is
    collected, and a named store's (which lives as long as the process) when the process exits."""
    import gc
    import subprocess
    import sys
    from pathlib import Path

    from cacheclip_rag.storage.backends.memory import MemoryBackend

    backend = MemoryBackend()
    folder = backend.local_dir()
    (folder / "index.faiss").write_bytes(b"x")
    del backend
    gc.collect()
    assert not folder.exists()
    code = "from cacheclip_rag.storage.backends.memory import MemoryBackend; print(MemoryBackend.named('memory://t').local_dir())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    named = Path(out.stdout.strip())
    assert named.name.startswith("cacheclip-memory-store-") and not named.exists()
