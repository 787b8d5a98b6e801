"""Baseline modes on a tiny model: each selection rule as its paper defines it."""

import pytest
import torch
from conftest import CORPUS

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_rag.request.recompute import attend
from cacheclip_rag.selectors.ape import ApeSpec, ape_positions, attend_ape
from cacheclip_rag.selectors.cacheblend import BlendSpec, blend_keep

Q = "what is the code in the kitchen drawer?"


@pytest.fixture(scope="module")
def eng(tiny_pair, tmp_path_factory):
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4))
    engine = CacheClipEngine(*tiny_pair, tmp_path_factory.mktemp("baselines"), cfg)
    engine.ids = engine.ingest(CORPUS, progress=False)[:4]
    return engine



def test_ape_places_chunks_in_parallel_and_recomputes_only_text(eng):
    ans = eng.answer(Q, chunk_ids=eng.ids, mode="ape", max_new_tokens=3)
    reuse = eng.answer(Q, chunk_ids=eng.ids, mode="reuse", max_new_tokens=3)
    assert ans.recomputed == reuse.recomputed and ans.effective_fraction == 0.0
    layout = eng.prepare(Q, eng.ids).layout
    pos = ape_positions(layout)
    starts = [int(pos[s.start]) for s in layout.chunk_segments()]
    assert starts == [layout.prefix_len] * len(starts)  # every chunk right after the prefix
    question = layout.segments[-1]
    longest = max(s.end - s.start for s in layout.chunk_segments())
    assert int(pos[question.start]) >= layout.prefix_len + longest


def test_ape_attention_with_neutral_settings_is_plain_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 3, 16, generator=g), torch.randn(1, 2, 10, 16, generator=g), torch.randn(1, 2, 10, 16, generator=g)
    rows = torch.tensor([[7, 8, 9]])
    ctx = torch.zeros(10, dtype=torch.bool)
    ctx[2:7] = True
    neutral = attend_ape(q, k, v, rows, 0.25, ApeSpec(ctx, 1.0, 1.0))
    torch.testing.assert_close(neutral, attend(q, k, v, rows, 0.25, "torch"), atol=1e-5, rtol=1e-5)
    sharper = attend_ape(q, k, v, rows, 0.25, ApeSpec(ctx, 0.9, 0.9))
    assert not torch.allclose(sharper, neutral)


@pytest.mark.parametrize("temperature, scale", [(0.9, 0.9), (0.5, 1.2), (1.0, 0.7)])
def test_ape_attention_is_the_reference_codes_two_group_merge(temperature, scale):
    """APE's reference code attends to the contexts C and to the rest A (prefix, query) in two
    calls, A with softmax scale / T, and merges the outputs by softmax([S*T*lse_A, lse_C]).
    Computed here that way, for one decode-step row (where its causal flags are exact)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 2, 12, 16, generator=g), torch.randn(1, 2, 12, 16, generator=g)
    ctx = torch.zeros(12, dtype=torch.bool)
    ctx[3:9] = True  # prefix 0..2, contexts 3..8, query 9..11
    got = attend_ape(q, k, v, torch.tensor([[11]]), 0.25, ApeSpec(ctx, temperature, scale))

    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = (q @ kk.transpose(-1, -2)) * 0.25  # [1, 4, 1, 12]
    s_a, s_c = s[..., ~ctx] / temperature, s[..., ctx]
    out_a, out_c = s_a.softmax(-1) @ vv[:, :, ~ctx], s_c.softmax(-1) @ vv[:, :, ctx]
    lse = torch.stack([scale * temperature * s_a.logsumexp(-1), s_c.logsumexp(-1)], dim=-1).softmax(-1)  # [1, 4, 1, 2]
    want = lse[..., :1] * out_a + lse[..., 1:] * out_c
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cacheblend_keeps_the_largest_deviations():
    rows = torch.arange(3, 9)  # 6 rows; 3..7 candidates, 8 is the question
    cand = torch.zeros(10, dtype=torch.bool)
    cand[3:8] = True
    old = torch.zeros(1, 2, 6, 4)
    new = old.clone()
    for i, d in enumerate([0.1, 3.0, 0.2, 2.0, 0.0, 0.05]):
        new[0, :, i] = d
    keep = blend_keep(BlendSpec(cand, 0.4, on="k"), rows, new, new, old, old)
    assert rows[keep].tolist() == [4, 6, 8]  # the two largest deviations among 5 candidates, plus the question


def test_cacheblend_ratio_one_is_full_and_ratio_counts(eng):
    full = eng.answer(Q, chunk_ids=eng.ids, mode="full", max_new_tokens=6)
    blend1 = eng.answer(Q, chunk_ids=eng.ids, mode="cacheblend", recompute_ratio=1.0, max_new_tokens=6)
    assert blend1.text == full.text and blend1.effective_fraction == 1.0
    blend = eng.answer(Q, chunk_ids=eng.ids, mode="cacheblend", recompute_ratio=0.25, max_new_tokens=2)
    assert abs(blend.effective_fraction - 0.25) < 1.0 / blend.context_tokens + 1e-9


def test_epic_recomputes_the_first_tokens_of_each_chunk(eng):
    ans = eng.answer(Q, chunk_ids=eng.ids, mode="epic", epic_tokens=3, max_new_tokens=2)
    layout = eng.prepare(Q, eng.ids).layout
    expected = set()
    for seg in layout.chunk_segments():
        expected |= set(range(seg.start, seg.start + 3))
    chunk_rows = set(layout.chunk_rows().tolist())
    assert set(ans.recomputed) & chunk_rows == expected


def test_random_is_seeded_and_hits_the_ratio(eng):
    a = eng.answer(Q, chunk_ids=eng.ids, mode="random", recompute_ratio=0.3, seed=1, max_new_tokens=2)
    b = eng.answer(Q, chunk_ids=eng.ids, mode="random", recompute_ratio=0.3, seed=1, max_new_tokens=2)
    c = eng.answer(Q, chunk_ids=eng.ids, mode="random", recompute_ratio=0.3, seed=2, max_new_tokens=2)
    assert a.recomputed == b.recomputed != c.recomputed
    assert abs(a.effective_fraction - 0.3) <= 1.0 / a.context_tokens


@pytest.mark.parametrize("mode", ["ape", "cacheblend", "epic", "random"])
def test_modes_work_through_generate(eng, mode):
    texts = [eng.store.get_chunk(c).text for c in eng.ids]
    ans = eng.generate("\n".join(texts) + f"\nQ: {Q}", mode=mode, max_new_tokens=2)
    assert ans.mode == mode and ans.chunk_ids == eng.ids
