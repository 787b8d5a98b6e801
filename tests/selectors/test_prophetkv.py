"""ProphetKV (arXiv:2602.02579): its edges are the oracles (ratio 1 == full prefill, 0 == direct
reuse) on every family, and its first stage reads the attention a full prefill would have where
the reused caches already hold the cross-chunk context. The bench variant `cacheclip+prophetkv`
(`eval/variants.py`) has the same edges, and between them is CacheClip's selection at its share
of the budget, filled by ProphetKV's top rows among the rest."""

import dataclasses

import pytest
import torch
from conftest import CORPUS

import cacheclip_bench  # noqa: F401  (registers the bench variants)
from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_rag.config import BaselineConfig
from cacheclip_rag.models.rope import rerotate
from cacheclip_rag.request.assemble import Layout, Segment
from cacheclip_rag.request.selector import get
from cacheclip_rag.selectors.primary_attention import attention_from_rows
from cacheclip_rag.selectors.prophetkv import query_attention, top_words, word_ids
from cacheclip_rag.storage.record import ChunkKV

Q = "what is the code in the kitchen drawer?"


@pytest.fixture
def eng(tiny_lm, tmp_path):
    engine = CacheClipEngine(tiny_lm, tiny_lm, tmp_path, EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4)))
    engine.ids = engine.ingest(CORPUS, progress=False)[:4]
    yield engine
    engine.close()


@pytest.mark.parametrize("mode", ["prophetkv", "prophetkv-word", "cacheclip+prophetkv"])
def test_at_ratio_one_is_full_prefill_and_at_zero_direct_reuse(eng, mode):
    full = eng.answer(Q, chunk_ids=eng.ids, mode="full", max_new_tokens=5)
    reuse = eng.answer(Q, chunk_ids=eng.ids, mode="reuse", max_new_tokens=5)
    all_rows = eng.answer(Q, chunk_ids=eng.ids, mode=mode, recompute_ratio=1.0, max_new_tokens=5)
    none = eng.answer(Q, chunk_ids=eng.ids, mode=mode, recompute_ratio=0.0, max_new_tokens=5)
    assert all_rows.text == full.text and all_rows.effective_fraction == 1.0
    assert none.text == reuse.text and none.recomputed == reuse.recomputed


def test_prophetkv_recomputes_the_ratio_and_counts_its_first_stage(eng):
    ans = eng.answer(Q, chunk_ids=eng.ids, mode="prophetkv", recompute_ratio=0.3, max_new_tokens=2)
    assert ans.effective_fraction == pytest.approx(round(0.3 * ans.context_tokens) / ans.context_tokens)
    assert ans.timings["selection"] > 0  # stage one is on the critical path, in TTFT
    prepared = eng.prepare(Q, eng.ids, mode="prophetkv", recompute_ratio=0.3)
    scores = query_attention(prepared)
    chunk_rows = prepared.layout.chunk_rows()
    expected = chunk_rows[torch.topk(scores, round(0.3 * chunk_rows.numel())).indices]
    assert set(ans.recomputed) & set(chunk_rows.tolist()) == set(expected.tolist())


@pytest.mark.parametrize("heads", ["mean", "max"])
def test_stage_one_reads_a_full_prefills_query_attention(eng, heads):
    """Over chunk caches cut from one full prefill (each rotated back as if encoded alone), stage
    one's recompute of the plain rows is exact, so its per-layer attention from the query rows is
    the full prefill's: the fused scores equal the full prefill's, reduced over heads the same
    way, normalised and averaged over layers."""
    lm = eng.primary.lm
    prepared = eng.prepare(Q, eng.ids, mode="prophetkv", recompute_ratio=0.3)
    layout = prepared.layout
    cache = lm.family.prefill(layout.input_ids).cache
    p = layout.prefix_len
    cut = {}
    for seg in layout.chunk_segments():
        keys = [rerotate(cache.layers[i].keys[0, :, seg.start:seg.end].float(), p - seg.start, lm.family.inv_freq(i))
                for i in range(lm.num_layers)]
        values = [cache.layers[i].values[0, :, seg.start:seg.end].float() for i in range(lm.num_layers)]
        cut[seg.chunk_id] = ChunkKV(keys, values, seg.ids, seg.offsets, p)
    got = query_attention(prepared, cut, heads=heads)
    query_rows = torch.arange(layout.chunk_segments()[-1].end, layout.num_tokens)
    ref = attention_from_rows(lm, layout.input_ids, query_rows, list(range(lm.num_layers)), heads=heads)
    chunk_rows = layout.chunk_rows()
    per_layer = torch.stack([ref[i][chunk_rows] / ref[i][chunk_rows].sum() for i in range(lm.num_layers)])
    # one head's attention, unlike the mean over heads, keeps its own rounding (fp32, other summation order)
    tol = dict(atol=2e-5, rtol=1e-4) if heads == "mean" else dict(atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(got, per_layer.mean(dim=0).float(), **tol)


def test_max_fusion_is_a_bench_variant_on_the_same_samples(eng):
    prepared = eng.prepare(Q, eng.ids, mode="prophetkv", recompute_ratio=0.3)
    mean, top = query_attention(prepared, fuse="mean"), query_attention(prepared, fuse="max")
    assert mean.shape == top.shape and bool((top >= mean - 1e-6).all())  # max over layers >= their mean
    ans = eng.answer(Q, chunk_ids=eng.ids, mode="prophetkv-max", recompute_ratio=0.3, max_new_tokens=1)
    expected = prepared.layout.chunk_rows()[torch.topk(top, round(0.3 * top.numel())).indices]
    assert set(ans.recomputed) & set(prepared.layout.chunk_rows().tolist()) == set(expected.tolist())


def test_the_mean_over_heads_is_a_bench_variant_and_differs_from_the_default(eng):
    prepared = eng.prepare(Q, eng.ids, mode="prophetkv", recompute_ratio=0.3)
    default, mean = query_attention(prepared), query_attention(prepared, heads="mean")
    torch.testing.assert_close(default, query_attention(prepared, heads="max"))
    assert not torch.allclose(default, mean)
    ans = eng.answer(Q, chunk_ids=eng.ids, mode="prophetkv-hmean", recompute_ratio=0.3, max_new_tokens=1)
    expected = prepared.layout.chunk_rows()[torch.topk(mean, round(0.3 * mean.numel())).indices]
    assert set(ans.recomputed) & set(prepared.layout.chunk_rows().tolist()) == set(expected.tolist())


def test_the_fusion_rules_are_validated_settings(eng):
    with pytest.raises(ValueError, match="prophetkv_fuse must be 'mean' or 'max', got 'sum'"):
        BaselineConfig(prophetkv_fuse="sum")
    with pytest.raises(ValueError, match="prophetkv_heads must be 'mean' or 'max', got 'median'"):
        BaselineConfig(prophetkv_heads="median")
    cfg = dataclasses.replace(eng.config, baselines=BaselineConfig(prophetkv_fuse="max"))
    with CacheClipEngine(eng.primary.lm, eng.aux.lm, eng.store.backend.root, cfg) as other:
        ans = other.answer(Q, chunk_ids=eng.ids, mode="prophetkv", recompute_ratio=0.3, max_new_tokens=1)
    assert ans.mode == "prophetkv"


def test_the_split_is_cacheclip_at_its_share_filled_by_prophetkv(eng):
    ratio = 0.4
    ans = eng.answer(Q, chunk_ids=eng.ids, mode="cacheclip+prophetkv", recompute_ratio=ratio, max_new_tokens=1)
    assert ans.timings["selection"] > 0  # both selections are on the critical path
    prepared = eng.prepare(Q, eng.ids, mode="cacheclip+prophetkv", recompute_ratio=ratio)
    chunk_rows = prepared.layout.chunk_rows()
    share = get("cacheclip+prophetkv").share
    half = dataclasses.replace(prepared, request=dataclasses.replace(prepared.request, ratio=ratio * share))
    aux_rows = set(get("cacheclip").plan(half).rows.tolist())
    scores = query_attention(prepared)
    budget = round(ratio * chunk_rows.numel())
    assert 0 < len(aux_rows) < budget
    got = set(ans.recomputed) & set(chunk_rows.tolist())
    assert aux_rows <= got and len(got) == budget
    # The rest is a top-k of ProphetKV's scores among the rows CacheClip left (ties in any order).
    score = {int(r): float(s) for r, s in zip(chunk_rows, scores)}
    filled = got - aux_rows
    left = set(chunk_rows.tolist()) - got
    assert min(score[r] for r in filled) >= max(score[r] for r in left)
    assert ans.effective_fraction == pytest.approx(budget / chunk_rows.numel())


def test_the_split_refuses_auto(eng):
    with pytest.raises(ValueError, match="recompute_ratio"):
        eng.answer(Q, chunk_ids=eng.ids, mode="cacheclip+prophetkv", recompute_ratio="auto", max_new_tokens=1)


def _segment(text: str, cuts: list[tuple[int, int]], start: int, chunk_id: str | None = "c", ids=None) -> Segment:
    ids = torch.tensor(ids if ids is not None else [1] * len(cuts))
    return Segment(text, chunk_id, start, ids, torch.tensor(cuts))


def test_words_join_digit_and_word_pieces_and_never_cross_a_space_or_a_chunk():
    # "is: 5078743 dusty-jacket." cut as a byte-level tokenizer cuts it: digits one by one
    text = "is: 5078743 dusty-jacket."
    cuts = [(0, 2), (2, 3), (3, 5), *[(i, i + 1) for i in range(5, 11)], (11, 17), (17, 19), (19, 24), (24, 25)]
    plain = _segment("Q?", [(0, 2)], start=13, chunk_id=None)  # not a chunk: not numbered
    second = _segment("7 7", [(0, 1), (1, 3)], start=14)
    layout = Layout(torch.zeros(16, dtype=torch.long), 0, (_segment(text, cuts, start=0), plain, second))
    words = word_ids(layout).tolist()
    assert words == [0, 1, 2, 2, 2, 2, 2, 2, 2, 3, 4, 4, 5, 6, 7]
    #                is  :  " 5" 0  7  8  7  4  3 " dusty" "-j" "acket" . | next chunk: 7, " 7"
    soft = _segment("ab", [(0, 1), (1, 2)], start=0, ids=[-1, 5])  # a packet's soft row stands alone
    assert word_ids(Layout(torch.zeros(2, dtype=torch.long), 0, (soft,))).tolist() == [0, 1]


def test_whole_words_are_taken_by_their_best_token_until_the_budget_is_held():
    scores = torch.tensor([0.1, 0.9, 0.2, 0.2, 0.5, 0.05, 0.3])
    words = torch.tensor([0, 1, 1, 1, 2, 3, 4])
    assert top_words(scores, words, 0).tolist() == []
    assert top_words(scores, words, 1).tolist() == [1, 2, 3]  # the number's best digit brings all its digits
    assert top_words(scores, words, 4).tolist() == [1, 2, 3, 4]
    assert top_words(scores, words, 5).tolist() == [1, 2, 3, 4, 6]
    assert top_words(scores, words, 7).tolist() == list(range(7))


def test_prophetkv_by_words_recomputes_whole_words(eng):
    prepared = eng.prepare(Q, eng.ids, mode="prophetkv-word", recompute_ratio=0.3)
    words, chunk_rows = word_ids(prepared.layout), prepared.layout.chunk_rows()
    assert words.numel() == chunk_rows.numel()
    rows = set(get("prophetkv-word").plan(prepared).rows.tolist())
    taken = torch.tensor([int(r) in rows for r in chunk_rows])
    for w in words.unique():
        assert taken[words == w].all() or not taken[words == w].any()
    k = round(0.3 * chunk_rows.numel())
    assert k <= int(taken.sum()) < k + int(torch.bincount(words).max())
