"""What an engine stores: lazily ingested chunks encoded on first use, aux caches only as deep as
scoring reads (deeper re-encoded on demand), and a bounded store that rebuilds what it dropped."""

import torch
from conftest import CORPUS

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig, SelectConfig, StoreConfig

QUESTION = "What is the code in the kitchen drawer?"
CHUNKING = ChunkConfig(chunk_tokens=24, overlap_tokens=4)


def _cached(eng, caches, ids):
    return [eng.store.backend.get(caches.namespace, cid) is not None for cid in ids]


def test_lazy_ingest_answers_and_encodes_on_first_use(tiny_pair, tmp_path):
    cfg = EngineConfig(chunk=CHUNKING)
    with CacheClipEngine(*tiny_pair, tmp_path / "eager", cfg) as eager:
        ids = eager.ingest(CORPUS, progress=False)
        want = eager.answer(QUESTION, chunk_ids=ids[:3], max_new_tokens=6, recompute_ratio=0.5)
    with CacheClipEngine(*tiny_pair, tmp_path / "lazy", cfg) as lazy:
        assert lazy.ingest(CORPUS, progress=False, lazy=True) == ids
        assert not any(_cached(lazy, lazy.primary, ids)) and not any(_cached(lazy, lazy.aux, ids))
        assert [cid for cid, _ in lazy.retrieve(QUESTION, k=len(ids))]  # indexed all the same
        assert lazy.store.verify()["missing"] == {}  # not encoded yet is not missing
        got = lazy.answer(QUESTION, chunk_ids=ids[:3], max_new_tokens=6, recompute_ratio=0.5)
        assert got.text == want.text and got.recomputed == want.recomputed
        assert _cached(lazy, lazy.primary, ids[:3]) == [True] * 3 and not any(_cached(lazy, lazy.primary, ids[3:]))
        assert _cached(lazy, lazy.aux, ids[:3]) == [True] * 3
        assert lazy.repair(progress=False)["rebuilt"] == 0  # repair leaves lazy chunks to their first use


def test_lazy_and_packets_together_are_refused(tiny_pair, tmp_path):
    import pytest

    with CacheClipEngine(*tiny_pair, tmp_path, EngineConfig(chunk=CHUNKING)) as eng:
        with pytest.raises(ValueError, match="lazy"):
            eng.ingest(CORPUS, progress=False, lazy=True, packets=True)


def _aux_layers(eng, cid):
    record = eng.store.backend.get(eng.aux.namespace, cid)
    try:
        return int(record.meta["num_layers"])
    finally:
        record.close()


def test_aux_caches_keep_only_the_layers_scoring_reads(tiny_pair, tmp_path):
    """The tiny aux has 2 layers; scoring with layer 0 stores 1. A request that scores with layer
    1 re-encodes (and stores) the chunks it uses with both; answers equal a store that keeps all."""
    shallow = EngineConfig(chunk=CHUNKING, select=SelectConfig(score_layers=(0,)), store=StoreConfig(kv_codec="bf16"))
    full = EngineConfig(chunk=CHUNKING, select=SelectConfig(score_layers=(0,)),
                        store=StoreConfig(aux_depth="all", kv_codec="bf16"))
    with CacheClipEngine(*tiny_pair, tmp_path / "all", full) as eng:
        ids = eng.ingest(CORPUS, progress=False)
        assert {_aux_layers(eng, cid) for cid in ids} == {2}
        want = [eng.answer(QUESTION, chunk_ids=ids[:3], max_new_tokens=4, recompute_ratio=0.5, score_layers=layers)
                for layers in ([0], [1])]
        all_bytes = eng.store.backend.nbytes(eng.aux.namespace)
    with CacheClipEngine(*tiny_pair, tmp_path / "cut", shallow) as eng:
        ids = eng.ingest(CORPUS, progress=False)
        assert eng.profiles.aux_depth() == 1
        assert {_aux_layers(eng, cid) for cid in ids} == {1}
        assert eng.store.backend.nbytes(eng.aux.namespace) < 0.7 * all_bytes  # headers, ids and the prefix stay
        eng.store.clear_memory()
        got = eng.answer(QUESTION, chunk_ids=ids[:3], max_new_tokens=4, recompute_ratio=0.5, score_layers=[0])
        assert (got.text, got.recomputed) == (want[0].text, want[0].recomputed)
        deeper = eng.answer(QUESTION, chunk_ids=ids[:3], max_new_tokens=4, recompute_ratio=0.5, score_layers=[1])
        assert (deeper.text, deeper.recomputed) == (want[1].text, want[1].recomputed)
        assert [_aux_layers(eng, cid) for cid in ids[:3]] == [2, 2, 2]  # re-encoded deeper where read deeper
        assert {_aux_layers(eng, cid) for cid in ids[3:]} == {1}
        # a whole read (calibration reads every aux layer) gets every layer
        assert len(eng.aux.get(ids[4]).keys) == 2


def _chunk_bytes(root):
    from cacheclip_rag.storage.backends.base import PREFIX_KEY, hashed_name

    return sum(p.stat().st_size for p in (root / "kv").rglob("*.safetensors") if p.stem != hashed_name(PREFIX_KEY))


def test_a_bounded_store_answers_and_rebuilds_what_it_dropped(tiny_pair, tmp_path):
    probe = EngineConfig(chunk=CHUNKING)
    with CacheClipEngine(*tiny_pair, tmp_path / "probe", probe) as eng:
        ids = eng.ingest(CORPUS, progress=False)
        want = eng.answer(QUESTION, chunk_ids=ids[:3], max_new_tokens=4, recompute_ratio=0.5)
    bound = _chunk_bytes(tmp_path / "probe") // 3
    cfg = EngineConfig(chunk=CHUNKING, store=StoreConfig(max_bytes=bound, memory_bytes=0))
    with CacheClipEngine(*tiny_pair, tmp_path / "bounded", cfg) as eng:
        assert eng.ingest(CORPUS, progress=False) == ids
        assert _chunk_bytes(tmp_path / "bounded") <= bound  # the shared prefixes are never dropped, nor counted
        misses = eng.store.stats.misses
        got = eng.answer(QUESTION, chunk_ids=ids[:3], max_new_tokens=4, recompute_ratio=0.5)
        assert (got.text, got.recomputed) == (want.text, want.recomputed)
        assert eng.store.stats.misses > misses  # some were dropped, and rebuilt from their texts
        assert eng.store.verify()["missing"] == {} and torch.is_tensor(eng.aux.get(ids[0]).keys[0])
