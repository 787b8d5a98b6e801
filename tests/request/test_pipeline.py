"""Layer-wise pipelined loading and the overlapped aux selection never change a result."""

import dataclasses

import pytest
import torch
from conftest import CORPUS

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_rag.config import PipelineConfig
from cacheclip_rag.request.assemble import AssembledCache
from cacheclip_rag.request import pipeline
from cacheclip_rag.request.pipeline import LayerFeeder, assemble

Q = "what is the code in the kitchen drawer?"


@pytest.fixture(scope="module")
def eng(tiny_pair, tmp_path_factory):
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4))
    engine = CacheClipEngine(*tiny_pair, tmp_path_factory.mktemp("pipe"), cfg)
    engine.ids = engine.ingest(CORPUS, progress=False)[:5]
    return engine


def _layout(eng):
    return eng.prepare(Q, eng.ids).layout


@pytest.mark.parametrize("pipelined, block", [(True, 1), (True, 2), (False, 2), (True, None)])
def test_layer_reader_feeder_equals_plain_assembly(eng, pipelined, block, monkeypatch):
    """Whatever the decode block (one layer, blocks that do not divide the depth, all at once)."""
    if block is not None:
        monkeypatch.setattr(pipeline, "DECODE_BLOCK", block)
    layout = _layout(eng)
    frame = eng.primary
    plain_kvs = {s.chunk_id: eng.store.get_kv(frame.namespace, s.chunk_id) for s in layout.chunk_segments()}
    prefix = frame.prefix()
    expected = assemble(frame.lm, layout, prefix, plain_kvs)

    eng.store.clear_memory()
    sources = {s.chunk_id: eng.store.open_layers(frame.namespace, s.chunk_id) for s in layout.chunk_segments()}
    assert all(type(src).__name__ == "LayerReader" for src in sources.values())
    assert {src.codec for src in sources.values()} == {"int8"}  # a new store's default: decoded in blocks
    cache = AssembledCache.empty(frame.lm, layout.num_tokens)
    for i in range(frame.lm.num_layers):
        cache.keys[i][0, :, : layout.prefix_len] = prefix.keys[i]
        cache.values[i][0, :, : layout.prefix_len] = prefix.values[i]
    loaded = {}
    feeder = LayerFeeder(frame.lm, layout, sources, torch.arange(layout.num_tokens), cache,
                         rebuild=None, pipelined=pipelined, on_loaded=loaded.__setitem__)
    for i in range(frame.lm.num_layers):
        feeder.wait(i)
    feeder.finish()
    for i in range(frame.lm.num_layers):
        assert torch.equal(cache.keys[i], expected.keys[i]) and torch.equal(cache.values[i], expected.values[i])
    assert set(loaded) == set(sources)  # whole caches handed to the memory tier afterwards
    for cid, kv in loaded.items():
        assert all(torch.equal(a, b) for a, b in zip(kv.keys, plain_kvs[cid].keys))


@pytest.mark.parametrize("codec", ["int8", "bf16"])
def test_block_rerotation_with_two_thetas_and_a_chunk_in_two_places(tiny_tokenizer, tiny_pair, tmp_path, codec,
                                                                    monkeypatch):
    """A compressed record's keys are re-rotated a block of layers at a time: on gemma3 a block
    mixes its two RoPE thetas (each run of layers moved with its own), and a chunk placed twice in
    one request is moved to each place on its own; bf16 records and chunks in memory layer by
    layer. Every way equals the assembly one layer at a time exactly."""
    from conftest import tiny_model

    from cacheclip_rag.config import StoreConfig

    gemma = tiny_model("gemma3", tiny_tokenizer, layers=4)
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4), store=StoreConfig(kv_codec=codec))
    engine = CacheClipEngine(gemma, tiny_pair[1], tmp_path, cfg)
    a, b = engine.ingest(CORPUS[:2], progress=False)[:2]
    frame = engine.primary
    layout = engine.prepare(Q, [a, b, a]).layout
    ids = [s.chunk_id for s in layout.chunk_segments()]
    assert ids.count(a) == 2, ids
    prefix = frame.prefix()
    plain = {cid: engine.store.get_kv(frame.namespace, cid) for cid in set(ids)}
    monkeypatch.setattr(pipeline, "DECODE_BLOCK", 1)  # the reference: one layer at a time
    expected = assemble(frame.lm, layout, prefix, plain)
    monkeypatch.setattr(pipeline, "DECODE_BLOCK", 3)  # layers 0-2 mix sliding and full attention
    in_memory = assemble(frame.lm, layout, prefix, plain)
    engine.store.clear_memory()
    sources = {cid: engine.store.open_layers(frame.namespace, cid) for cid in set(ids)}
    assert {src.codec for src in sources.values()} == {codec}
    cache, feeder = pipeline.start_assembly(frame.lm, layout, prefix, sources)
    feeder.finish()
    for got in (cache, in_memory):
        for i in range(frame.lm.num_layers):
            assert torch.equal(got.keys[i], expected.keys[i]) and torch.equal(got.values[i], expected.values[i])


@pytest.mark.parametrize("mode", ["cacheclip", "cacheblend", "ape", "reuse"])
def test_overlap_and_pipelining_never_change_the_answer(eng, mode):
    answers = []
    for overlap in (True, False, "auto"):
        for layerwise in (True, False):
            cfg = dataclasses.replace(eng.config, pipeline=PipelineConfig(overlap, layerwise))
            with CacheClipEngine(eng.primary.lm, eng.aux.lm, eng.store.backend.root, cfg) as other:
                assert other.config.pipeline == PipelineConfig(overlap, layerwise)
                other.store.clear_memory()  # cold: readers on the layer-wise path
                ans = other.answer(Q, chunk_ids=eng.ids, mode=mode, recompute_ratio=0.4, max_new_tokens=6)
            answers.append((ans.text, ans.recomputed))
    assert all(a == answers[0] for a in answers)


def test_an_engine_config_is_fixed_once_open(eng):
    with pytest.raises(AttributeError, match="fixed when it opens"):
        eng.config = EngineConfig()


def test_breakdown_reports_overlap(eng):
    ans = eng.answer(Q, chunk_ids=eng.ids, recompute_ratio=0.4, max_new_tokens=2)
    t = ans.timings
    assert {"selection", "selection_wait", "selection_hidden", "load", "load_wait", "assemble", "recompute"} <= set(t)
    assert 0.0 <= t["selection_hidden"] <= t["selection"] + 1e-9
    stages = [t[f"assemble_{stage}"] for stage in pipeline.STAGES]  # the loader's time taken apart
    assert all(s >= 0 for s in stages) and t["assemble_read"] > 0 and t["assemble_write"] > 0
    assert sum(stages) <= t["assemble"] + 1e-6


def test_selection_runs_first_where_both_models_share_the_cpu(eng):
    assert eng.config.pipeline.overlap_selection == "auto"
    assert not eng.config.pipeline.overlaps(torch.device("cpu"), torch.device("cpu"))
    assert PipelineConfig().overlaps(torch.device("cuda:0"), torch.device("cpu"))  # the paper's split
    assert PipelineConfig(True).overlaps(torch.device("cpu"), torch.device("cpu"))
    eng.store.clear_memory()
    t = eng.answer(Q, chunk_ids=eng.ids, recompute_ratio=0.4, max_new_tokens=2).timings
    assert t["selection"] > 0 and t["selection_hidden"] == 0.0 and t["selection_wait"] == t["selection"]


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_pipeline_config_rejects_what_is_not_a_switch(bad):
    with pytest.raises(ValueError, match="overlap_selection"):
        PipelineConfig(overlap_selection=bad)
    with pytest.raises(ValueError, match="layerwise_loading"):
        PipelineConfig(layerwise_loading=bad)
