"""The packet modes end to end on tiny models: their own namespace, the oracles, healing, bad input."""

import pytest
import torch
from conftest import CORPUS

from cacheclip_bench.suite import Suite
from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_rag.config import StoreConfig
from cacheclip_rag.corpus import packets as packet_lib
from cacheclip_rag.corpus.packets import PacketAdapters
from cacheclip_rag.offline.train_packets import save_adapters
from cacheclip_rag.offline.training import TrainConfig
from cacheclip_rag.request.execute import execute
from cacheclip_rag.request.selector import get

QUESTION = "what is the code in the kitchen drawer?"


@pytest.fixture(scope="module")
def adapter_file(tiny_pair, tmp_path_factory):
    primary, _ = tiny_pair
    path = tmp_path_factory.mktemp("adapters") / "tiny.safetensors"
    save_adapters(path, PacketAdapters.initial(primary, 3, 2, seed=4), primary, TrainConfig(), [])
    return path


@pytest.fixture()
def eng(tiny_pair, adapter_file, tmp_path):
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4), top_k=3, packets=str(adapter_file),
                       store=StoreConfig(kv_dtype="float32"))  # the oracles compare logits exactly
    engine = CacheClipEngine(*tiny_pair, tmp_path / "store", cfg)
    engine.ids = engine.ingest(CORPUS, progress=False)
    return engine


def _logits(engine, mode, ratio=0.0, ids=None):
    prepared = engine.prepare(QUESTION, ids or engine.ids[:4], mode=mode, recompute_ratio=ratio, max_new_tokens=4)
    return prepared, execute(prepared, None).logits


def test_packet_layout_wraps_chunks_in_soft_rows(eng):
    prepared, _ = _logits(eng, "packet")
    n_h, n_t = eng.packets.adapters.shape
    for seg in prepared.chunk_segments:
        assert (seg.ids[:n_h] < 0).all() and (seg.ids[-n_t:] < 0).all() and (seg.ids[n_h:-n_t] >= 0).all()
        assert seg.offsets.shape == (seg.ids.numel(), 2)
    assert prepared.primary is eng.packets


def test_packet_at_zero_and_packet_cacheclip_at_zero_agree(eng):
    _, packet = _logits(eng, "packet")
    _, clip0 = _logits(eng, "packet+cacheclip", 0.0)
    torch.testing.assert_close(packet, clip0)
    answer = eng.answer(QUESTION, eng.ids[:4], mode="packet", max_new_tokens=4)
    assert answer.mode == "packet" and answer.effective_fraction == 0.0


def test_packet_cacheclip_at_one_is_a_full_prefill_of_the_wrapped_sequence(eng):
    prepared, logits = _logits(eng, "packet+cacheclip", 1.0)
    lm = eng.primary.lm
    embeds = packet_lib.embed(lm, eng.packets.adapters, prepared.layout.input_ids)
    with torch.inference_mode():
        full = lm.model(inputs_embeds=embeds[None], logits_to_keep=1).logits[0, -1].float()
    torch.testing.assert_close(logits, full, atol=2e-4, rtol=1e-4)


def test_packet_cacheclip_in_between_never_picks_soft_rows(eng):
    prepared, _ = _logits(eng, "packet+cacheclip", 0.3)
    plan = get("packet+cacheclip").plan_for(prepared)
    assert plan.rows.numel() > 0
    assert (prepared.layout.input_ids[plan.rows] >= 0).all()


def test_packet_and_plain_namespaces_never_serve_each_other(eng):
    cid = eng.ids[0]
    assert eng.packets.namespace != eng.primary.namespace
    assert not eng.packets.has(cid)  # built on first use, not at a plain ingest
    plain = eng.primary.get(cid)
    _logits(eng, "packet", ids=[cid])
    packet = eng.packets.get(cid)
    assert packet.num_tokens == plain.num_tokens + eng.packets.adapters.extra_rows
    assert eng.primary.get(cid).num_tokens == plain.num_tokens
    assert torch.equal(packet.token_ids[3:-2], plain.token_ids)


def test_damaged_packet_cache_is_rebuilt_not_used(eng):
    cid = eng.ids[0]
    _, before = _logits(eng, "packet", ids=[cid])
    path = eng.store.backend.kv_path(eng.packets.namespace, cid)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    eng.store.clear_memory()
    assert eng.store.verify()["damaged"]
    assert eng.repair(progress=False)["rebuilt"] == 1
    report = eng.store.verify()
    assert not report["damaged"] and not report["missing"]  # absent packet caches are not "missing"
    _, after = _logits(eng, "packet", ids=[cid])
    torch.testing.assert_close(before, after)


def test_ingest_with_packets_builds_them(eng):
    ids = eng.ingest(["A separate note: the gate code is 4471 and the shed is blue."], progress=False, packets=True)
    assert all(eng.packets.has(cid) for cid in ids)


def test_packet_modes_without_adapters_are_a_clear_error(tiny_pair, tmp_path):
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4), packets=None)
    engine = CacheClipEngine(*tiny_pair, tmp_path / "store", cfg)
    ids = engine.ingest(CORPUS[:2], progress=False)
    with pytest.raises(ValueError, match="needs KV Packet adapters"):
        engine.answer(QUESTION, ids, mode="packet")
    with pytest.raises(ValueError, match="needs KV Packet adapters"):
        engine.ingest(CORPUS[:1], progress=False, packets=True)


def test_foreign_or_missing_adapter_files_are_refused(tiny_pair, adapter_file, tmp_path):
    primary, aux = tiny_pair
    with pytest.raises(ValueError, match="adapters for model"):
        CacheClipEngine(aux, primary, tmp_path / "s1", EngineConfig(packets=str(adapter_file)))
    with pytest.raises(ValueError, match="no such file"):
        CacheClipEngine(primary, aux, tmp_path / "s2", EngineConfig(packets=str(tmp_path / "none.safetensors")))
    with pytest.raises(ValueError, match="packets must be"):
        EngineConfig(packets="")


def test_fidelity_and_deviation_benches_on_packet_caches(eng):
    """The packet modes replay through the packet cache; the packet deviation bench compares it
    with a full prefill of the wrapped sequence."""
    from cacheclip_bench import deviation, fidelity

    modes = [("reuse", 0.0), ("packet", 0.0), ("packet+cacheclip", 0.3)]
    results = fidelity.run(eng, modes, Suite(lengths=[150], variants=["multivalue"], samples=1), answer_tokens=3)
    by_mode = {r.mode: r for r in results}
    assert set(by_mode) == {"reuse", "packet", "packet+cacheclip"}
    assert by_mode["packet"].effective_fraction == 0.0 < by_mode["packet+cacheclip"].effective_fraction
    deviations, forced = deviation.run(eng, [0.3], Suite(lengths=[150], variants=["multivalue"], samples=1),
                                       answer_tokens=3, packets=True)
    assert deviations and {r.mode for r in forced} == {"packet-deviation", "packet-deviation-L1", "packet+cacheclip"}
    # The first packet follows the prefix in both caches: its rows differ by rounding only.
    assert max(deviations[0].k_first) < 1e-3 and max(deviations[0].v_first) < 1e-3
