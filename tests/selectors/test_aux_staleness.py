"""`cacheclip-stale` and `cascade` on the tiny models: the aux's reading of where reuse went stale.

The oracles: the early-exit aux pass is the aux model's own prefill at the layers it computes; a
single chunk right after the shared prefix has no staleness (its stored cache is its in-context
cache); a row planted to differ scores highest; ratio 1.0 is a full prefill; rows stay within
the budget and do not depend on anything but the request.
"""

import dataclasses

import pytest
import torch
from conftest import CORPUS
from transformers import DynamicCache

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_rag.config import SelectConfig
from cacheclip_rag.selectors import aux_staleness as stale

Q = "what is the code in the kitchen drawer?"


@pytest.fixture(scope="module")
def eng(tiny_pair, tmp_path_factory):
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4))
    with CacheClipEngine(*tiny_pair, tmp_path_factory.mktemp("store"), cfg) as engine:
        engine.ids = engine.ingest(CORPUS, progress=False)
        yield engine


def test_the_early_exit_pass_is_the_aux_models_own_prefill_at_its_layers(eng):
    aux = eng.aux.lm
    ids = torch.tensor(aux.tokenizer("the quick brown fox jumps over the lazy dog again")["input_ids"])
    with torch.inference_mode():
        cache = DynamicCache(config=aux.model.config)
        aux.model(input_ids=ids[None].to(aux.device), past_key_values=cache, use_cache=True)
        seen = list(stale.joint_pass(aux, ids, 2))
    assert [layer for layer, _, _ in seen] == [0, 1]
    for layer, k, v in seen:
        torch.testing.assert_close(k, cache.layers[layer].keys, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(v, cache.layers[layer].values, rtol=2e-2, atol=2e-2)


def test_a_chunk_right_after_the_prefix_is_not_stale_and_a_planted_row_is_the_most(eng):
    prepared = eng.prepare(Q, eng.ids[:3], mode="cacheclip-stale")
    aux_kvs = prepared.aux_kvs()
    args = (eng.aux.lm, prepared.aux_prefix_kv(), aux_kvs, prepared.aux_query_ids())
    alone = stale.aux_deviation(eng.aux.lm, prepared.aux_prefix_kv(), aux_kvs[:1], prepared.aux_query_ids(), 3)
    assert float(alone[0].max()) < 1e-2  # rounding only: its stored cache is its in-context cache
    first, *later = stale.aux_deviation(*args, layers=3)
    assert float(first.max()) < 1e-2 and max(float(d.max()) for d in later) > 10 * float(first.max())
    values = [v.clone() for v in aux_kvs[2].values]
    for v in values:
        v[:, 5] += 25.0  # row 5 of the third chunk: its stored V far from any pass
    planted = [*aux_kvs[:2], dataclasses.replace(aux_kvs[2], values=values)]
    scores = stale.aux_deviation(eng.aux.lm, prepared.aux_prefix_kv(), planted, prepared.aux_query_ids(), 3, on="v")
    assert int(scores[2].argmax()) == 5 and float(scores[2][5]) > max(float(s.max()) for s in scores[:2])
    with pytest.raises(ValueError, match="on must be 'k', 'v' or 'kv'"):
        stale.aux_deviation(*args, layers=3, on="q")


def test_scores_move_to_primary_tokens_through_character_spans():
    aux_offsets = torch.tensor([[0, 3], [3, 7], [7, 7]])
    primary_offsets = torch.tensor([[0, 2], [2, 5], [5, 7], [7, 7]])
    got = stale.to_primary(aux_offsets, torch.tensor([0.1, 0.9, 5.0]), primary_offsets, 7)
    assert got.tolist() == pytest.approx([0.1, 0.9, 0.9, 0.0])  # [2, 5) overlaps both: the higher


@pytest.mark.parametrize("mode", ["cacheclip-stale", "cascade"])
def test_ratio_one_is_full_rows_stay_within_budget_and_repeat(eng, mode):
    full = eng.answer(Q, chunk_ids=eng.ids[:4], mode="full", max_new_tokens=4)
    every = eng.answer(Q, chunk_ids=eng.ids[:4], mode=mode, recompute_ratio=1.0, max_new_tokens=4)
    assert every.text == full.text and every.effective_fraction == pytest.approx(1.0)
    prepared = eng.prepare(Q, eng.ids[:4], mode=mode, recompute_ratio=0.3)
    chunk_rows = prepared.layout.chunk_rows()
    rows = prepared.selector.plan_for(prepared).rows
    assert torch.isin(rows, chunk_rows).all() and rows.numel() == round(0.3 * chunk_rows.numel())
    again = eng.prepare(Q, eng.ids[:4], mode=mode, recompute_ratio=0.3)
    assert torch.equal(again.selector.plan_for(again).rows, rows)
    assert eng.answer(Q, chunk_ids=eng.ids[:4], mode=mode, recompute_ratio=0.0, max_new_tokens=2).effective_fraction == 0


def test_the_cascade_keeps_the_proposals_the_primary_reads(eng):
    prepared = eng.prepare(Q, eng.ids[:4], mode="cascade", recompute_ratio=0.2)
    chunk_rows = prepared.layout.chunk_rows()
    k = round(0.2 * chunk_rows.numel())
    proposals = chunk_rows[torch.topk(stale.stale_scores(prepared), round(2.5 * k)).indices]
    rows = prepared.selector.plan_for(prepared).rows
    assert torch.isin(rows, proposals).all()


def test_bad_staleness_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="stale_layers must be a positive integer"):
        SelectConfig(stale_layers=0)
    with pytest.raises(ValueError, match="stale_on must be one of"):
        SelectConfig(stale_on="q")
    with pytest.raises(ValueError, match="cascade_factor must be a number >= 1"):
        SelectConfig(cascade_factor=0.5)


def test_the_bench_variants_change_one_staleness_setting(eng):
    import cacheclip_bench  # noqa: F401  (registers the analysis variants)

    rows = {}
    for mode in ("cacheclip-stale", "cacheclip-stale-l1", "cacheclip-stale-lall", "cacheclip-stale-v", "cascade-x4"):
        prepared = eng.prepare(Q, eng.ids[:4], mode=mode, recompute_ratio=0.3)
        rows[mode] = prepared.selector.plan_for(prepared).rows
        assert rows[mode].numel() == round(0.3 * prepared.layout.chunk_rows().numel())
    assert not torch.equal(rows["cacheclip-stale"], rows["cacheclip-stale-l1"])


def test_the_auto_budget_recomputes_more_where_chunks_interact(eng):
    """One chunk right after the prefix has no staleness to repair: "auto" spends its floor; four
    chunks that read each other spend more."""
    cfg = eng.config.select
    alone = eng.answer(Q, chunk_ids=eng.ids[:1], mode="cacheclip-stale", recompute_ratio="auto", max_new_tokens=2)
    several = eng.answer(Q, chunk_ids=eng.ids[:4], mode="cacheclip-stale", recompute_ratio="auto", max_new_tokens=2)
    assert several.effective_fraction > alone.effective_fraction
    assert cfg.auto_floor - 0.05 <= several.effective_fraction <= cfg.auto_cap + 0.05
