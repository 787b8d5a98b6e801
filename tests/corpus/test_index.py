"""The chunk index: approximate kinds agree with the flat one, adds append segments instead of
rewriting the index, reopening reads base and segments, torn segments are ignored."""

import json

import numpy as np
import pytest

from cacheclip_rag.config import IndexConfig
from cacheclip_rag.corpus.index import ChunkIndex


def _vectors(n, d=32, seed=0):
    v = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _fill(index, vectors, batch=100, offset=0):
    for start in range(0, len(vectors), batch):
        index.add_vectors([(f"c{offset + i}", vectors[i]) for i in range(start, min(start + batch, len(vectors)))])


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_the_approximate_index_returns_the_flat_indexs_top_hit(tmp_path, kind):
    vectors = _vectors(1500)
    flat, approx = ChunkIndex(tmp_path / "flat", config=IndexConfig(kind="flat")), \
        ChunkIndex(tmp_path / kind, config=IndexConfig(kind=kind))
    _fill(flat, vectors)
    _fill(approx, vectors)
    assert (flat.kind, approx.kind) == ("flat", kind)
    queries = _vectors(40, seed=1)
    for want, got in zip(flat.search_vectors(queries, 4), approx.search_vectors(queries, 4)):
        assert got[0] == pytest.approx(want[0])


def test_auto_turns_approximate_past_its_threshold(tmp_path):
    index = ChunkIndex(tmp_path, config=IndexConfig(approximate_from=300))
    _fill(index, _vectors(250))
    assert index.kind == "flat"
    _fill(index, _vectors(100, seed=3), offset=250)
    assert index.kind == "ivf"
    assert ChunkIndex(tmp_path, config=IndexConfig(approximate_from=300)).kind == "ivf"


def test_an_add_writes_a_segment_not_the_index(tmp_path):
    index = ChunkIndex(tmp_path, config=IndexConfig(kind="flat"))
    _fill(index, _vectors(2000), batch=2000)  # one add into an empty index: written as the base
    base = (tmp_path / "faiss.bin").stat().st_mtime_ns, (tmp_path / "faiss.bin").stat().st_size
    written = index.bytes_written
    _fill(index, _vectors(100, seed=5), offset=2000)
    assert ((tmp_path / "faiss.bin").stat().st_mtime_ns, (tmp_path / "faiss.bin").stat().st_size) == base
    assert index.bytes_written - written < base[1] / 10  # its own 100 vectors, not the 2,000
    assert len(list((tmp_path / "segments").glob("*.json"))) == 1
    again = ChunkIndex(tmp_path, config=IndexConfig(kind="flat"))
    assert len(again) == 2100 and again.search_vectors(_vectors(100, seed=5)[:1], 1)[0][0][0] == "c2000"


def test_segments_are_compacted_once_they_hold_a_share_of_the_base(tmp_path):
    index = ChunkIndex(tmp_path, config=IndexConfig(kind="flat", compact_share=0.25))
    _fill(index, _vectors(400), batch=400)
    _fill(index, _vectors(150, seed=2), batch=50, offset=400)  # 50, 100: segments; 150 > 100: compacted
    assert not list((tmp_path / "segments").glob("*.json"))
    assert len(ChunkIndex(tmp_path, config=IndexConfig(kind="flat"))) == 550


def test_a_torn_or_damaged_segment_is_ignored(tmp_path, caplog):
    index = ChunkIndex(tmp_path, config=IndexConfig(kind="flat"))
    _fill(index, _vectors(400), batch=400)
    _fill(index, _vectors(20, seed=2), batch=10, offset=400)
    first, second = sorted((tmp_path / "segments").glob("*.json"))
    first.with_suffix(".npy").unlink()  # torn: its vectors never landed
    second.write_text(json.dumps(["only-one-id"]))  # damaged: ids and vectors disagree
    again = ChunkIndex(tmp_path, config=IndexConfig(kind="flat"))
    assert len(again) == 400 and "unreadable" in caplog.text  # the store's catch-up re-indexes the rest


def test_a_chunk_added_by_two_processes_is_indexed_once(tmp_path):
    cfg = IndexConfig(kind="flat")
    vectors = _vectors(350)
    a = ChunkIndex(tmp_path, config=cfg)
    _fill(a, vectors[:200], batch=200)
    b = ChunkIndex(tmp_path, config=cfg)
    _fill(b, vectors[150:300], batch=150, offset=150)  # b knows 0-199 from the base: appends 200-299
    _fill(a, vectors[250:350], batch=100, offset=250)  # a never saw b's base: it merges it as it compacts
    again = ChunkIndex(tmp_path, config=cfg)
    assert len(again) == 350 and sorted(again.ids()) == sorted(f"c{i}" for i in range(350))
    # and without compactions: segments that overlap are indexed once
    loose = IndexConfig(kind="flat", compact_share=10.0)
    c, d = ChunkIndex(tmp_path / "loose", config=loose), ChunkIndex(tmp_path / "loose", config=loose)
    _fill(c, vectors[:100], batch=100)
    _fill(c, vectors[100:150], batch=50, offset=100)
    _fill(d, vectors[120:200], batch=80, offset=120)  # d never saw c's segment: 120-149 twice on disk
    assert len(ChunkIndex(tmp_path / "loose", config=loose)) == 200


def test_bad_index_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="'annoy'"):
        IndexConfig(kind="annoy")
    with pytest.raises(ValueError, match="nprobe"):
        IndexConfig(nprobe=0)
