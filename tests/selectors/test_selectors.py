"""Selectors as objects: one registry, and a new method is one file that appears everywhere."""

import pytest
import torch
from conftest import CORPUS

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_rag.cli import main
from cacheclip_rag.request import selector as registry
from cacheclip_rag.request.plan import Plan
from cacheclip_rag.request.selector import Selector


class EveryOther(Selector):
    """A toy method: every second chunk token."""

    name = "every-other"

    def plan(self, prepared) -> Plan:
        return Plan(rows=prepared.layout.chunk_rows()[::2])


@pytest.fixture
def toy():
    selector = registry.register(EveryOther())
    yield selector
    registry.unregister(selector.name)


def test_builtin_modes_are_registered():
    assert {"full", "reuse", "ape", "cacheblend", "epic", "random", "cacheclip"} <= set(registry.modes())
    with pytest.raises(ValueError, match="mode must be one of"):
        registry.get("nope")
    with pytest.raises(ValueError, match="mode name"):
        registry.register(type("Bad", (Selector,), {"name": "has space"})())


def test_a_registered_selector_runs_through_the_api(toy, tiny_pair, tmp_path):
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4))
    with CacheClipEngine(*tiny_pair, tmp_path, cfg) as engine:
        ids = engine.ingest(CORPUS, progress=False)[:3]
        assert "every-other" in engine.modes()
        ans = engine.answer("What is the code?", chunk_ids=ids, mode="every-other", recompute_ratio=0.5, max_new_tokens=2)
        layout = engine.prepare("What is the code?", ids).layout
        chunk_rows = layout.chunk_rows()
        assert set(ans.recomputed) & set(chunk_rows.tolist()) == set(chunk_rows[::2].tolist())
        assert ans.mode == "every-other" and 0.45 < ans.effective_fraction < 0.55


def test_a_registered_selector_runs_through_bench_niah(toy, tiny_pair, tmp_path, capsys):
    """Saved as model folders, the tiny pair loads by path like any model; the toy mode is in the
    CLI's mode list, the bench and its table without any edit elsewhere."""
    folders = []
    for i, lm in enumerate(tiny_pair):
        folder = tmp_path / f"model{i}"
        lm.model.save_pretrained(folder)
        lm.tokenizer.save_pretrained(folder)
        folders.append(str(folder))
    code = main(["bench", "niah", "--store", str(tmp_path / "store"), "--primary", folders[0], "--aux", folders[1],
                 "--lengths", "150", "--samples", "1", "--variants", "single_2", "--modes", "reuse", "every-other",
                 "--ratios", "0.5", "--chunk-tokens", "48", "--max-new-tokens", "2"])
    printed = capsys.readouterr().out
    assert code == 0 and "every-other@0.5" in printed and "reuse" in printed


def test_prepare_gives_analysis_what_serving_uses(tiny_pair, tmp_path):
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4))
    with CacheClipEngine(*tiny_pair, tmp_path, cfg) as engine:
        ids = engine.ingest(CORPUS, progress=False)[:3]
        prepared = engine.prepare("What is the code?", ids)
        assert [s.chunk_id for s in prepared.layout.chunk_segments()] == ids
        assert set(prepared.chunk_kvs()) == set(ids) and len(prepared.aux_kvs()) == 3
        assert prepared.aux_query_ids().numel() > 0 and prepared.prefix_kv().num_tokens == prepared.layout.prefix_len
        with pytest.raises(ValueError, match="exactly one of question or prompt"):
            engine.prepare()
        streamed = engine.run(engine.prepare("What is the code?", ids, mode="reuse", max_new_tokens=2)).collect()
        assert torch.equal(torch.tensor(streamed.recomputed), prepared.layout.uncached_rows())


class AuxMover(Selector):
    """A bad aux selector: plans on the aux thread (the cache is assembled meanwhile) but moves positions."""

    name = "aux-mover"
    uses_aux = True

    def plan(self, prepared) -> Plan:
        return Plan(rows=prepared.layout.chunk_rows()[:1], positions=torch.arange(prepared.layout.num_tokens) + 1)


def test_an_aux_selector_that_moves_positions_is_refused(tiny_pair, tmp_path):
    selector = registry.register(AuxMover())
    try:
        with CacheClipEngine(*tiny_pair, tmp_path, EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4))) as engine:
            ids = engine.ingest(CORPUS, progress=False)[:3]
            with pytest.raises(ValueError, match="moves token positions"):
                engine.answer("What is the code?", chunk_ids=ids, mode="aux-mover", recompute_ratio=0.5, max_new_tokens=2)
    finally:
        registry.unregister(selector.name)


def test_joint_aux_context_runs_through_the_api_and_falls_back_when_too_long(tiny_pair, tmp_path, caplog):
    """aux_context="joint" (per request or in the config) scores with one query pass over every
    chunk; a request longer than the aux model's positions is scored per chunk, logged."""
    import logging

    from cacheclip_rag import SelectConfig

    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4))
    with CacheClipEngine(*tiny_pair, tmp_path, cfg) as engine:
        ids = engine.ingest(CORPUS, progress=False)[:4]
        ask = dict(chunk_ids=ids, mode="cacheclip", recompute_ratio=0.3, max_new_tokens=2)
        joint = engine.answer("What is the code?", aux_context="joint", **ask)
        chunk = engine.answer("What is the code?", aux_context="chunk", **ask)
        assert engine.profiles.settings(context="joint").context == "joint" and engine.profiles.settings().context == "chunk"
        assert 0.2 < joint.effective_fraction < 0.45 and 0.2 < chunk.effective_fraction < 0.45
        aux_config = engine.aux.lm.model.config
        saved = aux_config.max_position_embeddings
        try:
            prepared = engine.prepare("What is the code?", ids, aux_context="joint")
            lens = [kv.num_tokens for kv in prepared.aux_kvs()]
            fixed = prepared.aux_prefix_kv().num_tokens + prepared.aux_query_ids().numel()
            aux_config.max_position_embeddings = fixed + max(lens)  # each chunk fits, all of them do not
            with caplog.at_level(logging.INFO, logger="cacheclip_rag"):
                fallback = engine.answer("What is the code?", aux_context="joint", **ask)
            assert "scoring per chunk" in caplog.text
            assert fallback.recomputed == chunk.recomputed
        finally:
            aux_config.max_position_embeddings = saved
    with pytest.raises(ValueError, match="context must be one of"):
        SelectConfig(context="everything")
    from cacheclip_rag.request.profile_source import resolve

    assert resolve(SelectConfig(context="joint"), None).context == "joint"
