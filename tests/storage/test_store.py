"""KVStore: round trip, atomic writes, damage detection and rebuild, fingerprint binding."""

import json
import os

import pytest
import torch

from cacheclip_rag.storage import store as store_mod
from cacheclip_rag.storage.backends import files as files_backend
from cacheclip_rag.storage.record import Chunk, ChunkKV
from cacheclip_rag.storage.store import KVStore

NS = "ab" * 16


def _kv(t=5, layers=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(
        keys=[torch.randn(2, t, 8, generator=g).to(torch.bfloat16) for _ in range(layers)],
        values=[torch.randn(2, t, 8, generator=g).to(torch.bfloat16) for _ in range(layers)],
        token_ids=torch.arange(t),
        offsets=torch.stack([torch.arange(t), torch.arange(t) + 1], dim=1),
        start_pos=7,
    )


def _equal(a: ChunkKV, b: ChunkKV):
    assert a.start_pos == b.start_pos
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.offsets, b.offsets)
    for x, y in zip(a.keys + a.values, b.keys + b.values):
        assert x.dtype == y.dtype and torch.equal(x, y)


def test_round_trip_through_disk(tmp_path):
    s = KVStore(tmp_path)
    kv = _kv()
    s.put_kv(NS, "chunk-1", kv)
    fresh = KVStore(tmp_path)  # empty memory tier: reads the file
    _equal(fresh.get_kv(NS, "chunk-1"), kv)
    assert fresh.stats.disk_hits == 1
    _equal(fresh.get_kv(NS, "chunk-1"), kv)
    assert fresh.stats.memory_hits == 1
    assert fresh.get_kv(NS, "other") is None


def test_file_names_are_hashes_inside_the_store(tmp_path):
    s = KVStore(tmp_path)
    s.put_kv(NS, "../../etc/passwd", _kv())
    files = list((tmp_path / "kv").rglob("*.safetensors"))
    assert len(files) == 1 and files[0].parent.parent == tmp_path / "kv"
    assert "passwd" not in files[0].name
    with pytest.raises(ValueError, match="hex digest"):
        s.backend.kv_path("../escape", "x")


def test_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    s = KVStore(tmp_path)
    old = _kv(seed=1)
    s.put_kv(NS, "c", old)

    def broken_save(tensors, path, metadata=None):
        with open(path, "wb") as fh:
            fh.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files_backend, "save_file", broken_save)
    with pytest.raises(OSError, match="No space"):
        s.put_kv(NS, "c", _kv(seed=2))
    leftovers = [p.name for p in (tmp_path / "kv" / NS).iterdir()]
    assert len(leftovers) == 1 and not leftovers[0].startswith(".tmp")
    _equal(KVStore(tmp_path).get_kv(NS, "c"), old)


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_damaged_file_is_detected_and_removed(tmp_path, damage):
    s = KVStore(tmp_path)
    s.put_kv(NS, "c", _kv())
    path = s.backend.kv_path(NS, "c")
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[-10] ^= 0xFF  # inside tensor bytes: parses, fails the checksum
    else:
        data = b"not a safetensors file"
    path.write_bytes(bytes(data))
    fresh = KVStore(tmp_path)
    assert fresh.get_kv(NS, "c") is None
    assert fresh.stats.damaged == 1 and not path.exists()


def test_memory_tier_is_bounded(tmp_path):
    kv = _kv(t=50)
    s = KVStore(tmp_path, store_mod.StoreConfig(memory_bytes=int(kv.nbytes * 2.5)))
    for i in range(5):
        s.put_kv(NS, f"c{i}", _kv(t=50, seed=i))
    assert s.memory_bytes <= kv.nbytes * 2.5
    s.get_kv(NS, "c0")  # evicted from memory, still on disk
    assert s.stats.disk_hits == 1


def test_a_partial_memory_entry_serves_reads_of_at_most_its_layers(tmp_path):
    """What the aux scoring pass leaves in memory: its first layers, never taken for the whole cache."""
    kv = _kv(layers=3)
    KVStore(tmp_path).put_kv(NS, "c", kv)
    s = KVStore(tmp_path)
    s.remember(NS, "c", kv.first_layers(2), whole=False)
    assert s.memory_bytes == kv.first_layers(2).nbytes
    hit = s.open_layers(NS, "c", 2)
    assert isinstance(hit, ChunkKV) and len(hit.keys) == 2 and s.stats.memory_hits == 1
    assert not isinstance(s.open_layers(NS, "c", 3), ChunkKV)  # more layers than it holds: the store
    assert not isinstance(s.open_layers(NS, "c"), ChunkKV)  # every layer: the store
    _equal(s.get_kv(NS, "c"), kv)  # a whole read is never served by a partial entry...
    assert s.stats.memory_hits == 1 and s.stats.disk_hits == 3
    s.remember(NS, "c", kv.first_layers(1), whole=False)  # ...and, once whole, is not replaced by one
    _equal(s.get_kv(NS, "c"), kv)
    assert s.stats.memory_hits == 2 and s.memory_bytes == kv.nbytes


def test_chunk_texts_round_trip(tmp_path):
    s = KVStore(tmp_path)
    c = Chunk("cid", "Zürich — 東京 text", "doc", 3, 20)
    s.put_chunk(c)
    assert KVStore(tmp_path).get_chunk("cid") == c
    assert s.get_chunk("unknown") is None
    assert s.chunk_ids() == ["cid"]


def test_fingerprint_mismatch_is_refused(tmp_path):
    s = KVStore(tmp_path)
    s.bind_models({"primary": "aaa", "aux": "bbb"})
    KVStore(tmp_path).bind_models({"primary": "aaa", "aux": "bbb"})
    with pytest.raises(ValueError, match="different primary model"):
        KVStore(tmp_path).bind_models({"primary": "zzz", "aux": "bbb"})
    assert json.loads((tmp_path / "store.json").read_text())["models"]["primary"] == "aaa"


def test_the_memory_tier_lists_what_it_holds_per_namespace(tmp_path):
    """What chunk-affinity routing reads from each replica (`CacheClipEngine.cached_chunks`)."""
    s = KVStore(tmp_path, store_mod.StoreConfig(memory_bytes=int(_kv(t=50).nbytes * 2.5)))
    for i in range(3):
        s.put_kv(NS, f"c{i}", _kv(t=50, seed=i))
    assert s.memory_keys(NS) == ["c1", "c2"]  # the oldest was dropped to stay in bounds
    assert s.memory_keys("other-namespace") == [] and s.memory_bytes <= _kv(t=50).nbytes * 2.5


def _records(root):
    return sorted(p.name for p in (root / "kv").rglob("*.safetensors"))


def test_a_bounded_folder_drops_the_least_recently_used(tmp_path):
    from cacheclip_rag.config import StoreConfig
    from cacheclip_rag.storage.backends.base import PREFIX_KEY

    one = KVStore(tmp_path / "probe")
    one.put_kv(NS, "x", _kv())
    size = one.backend.kv_path(NS, "x").stat().st_size
    s = KVStore(tmp_path / "s", StoreConfig(max_bytes=int(size * 3.5), memory_bytes=0))
    s.put_kv(NS, PREFIX_KEY, _kv(seed=9))
    for i, key in enumerate("abc"):
        s.put_kv(NS, key, _kv(seed=i))
        os.utime(s.backend.kv_path(NS, key), (1000 + i, 1000 + i))  # a, b, c in order of use
    os.utime(s.backend.kv_path(NS, PREFIX_KEY), (1, 1))  # the oldest of all, yet never dropped
    assert s.get_kv(NS, "a") is not None  # a read refreshes "a": now "b" is the least recently used
    s.put_kv(NS, "d", _kv(seed=4))  # over the bound: dropped down to 90% of it
    left = {key for key in ("a", "b", "c", "d", PREFIX_KEY) if s.backend.kv_path(NS, key).exists()}
    assert left == {"a", "c", "d", PREFIX_KEY}, left  # 3 of 3.5 records: within 90% of the bound
    assert s.get_kv(NS, "b") is None and s.stats.misses == 1  # gone: rebuilt from its text by the engine
    # the bound is recorded: a process that opens the store without it keeps to it too
    other = KVStore(tmp_path / "s", StoreConfig(memory_bytes=0))
    assert other.max_bytes == int(size * 3.5) and other.usage()["max_bytes"] == other.max_bytes
    for key in "efg":
        other.put_kv(NS, key, _kv(seed=7))
    held = sum(p.stat().st_size for p in (tmp_path / "s" / "kv").rglob("*.safetensors")
               if p.stem != other.backend.name_of(PREFIX_KEY))
    assert held <= int(size * 3.5)


def test_a_bound_on_a_memory_store_is_refused_by_name():
    from cacheclip_rag.config import StoreConfig

    with pytest.raises(ValueError, match="max_bytes"):
        KVStore("memory://bounded-test", StoreConfig(max_bytes=1000))
    with pytest.raises(ValueError, match="max_bytes"):
        StoreConfig(max_bytes=0)
