"""`cacheclip+prophetkv` (a bench variant, `cacheclip_rag.eval.variants`): its edges are the oracles (ratio 1 == full prefill, 0 == direct reuse)
on every family, and at a ratio between it is CacheClip's selection at `share` of the budget,
filled up to the budget by ProphetKV's top rows among the rest."""

import dataclasses

import pytest
import torch

import cacheclip_rag.eval  # noqa: F401  (registers cacheclip+prophetkv)
from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_rag.plan import get
from cacheclip_rag.selectors.prophetkv import query_attention

from conftest import CORPUS

Q = "what is the code in the kitchen drawer?"
MODE = "cacheclip+prophetkv"


@pytest.fixture
def eng(tiny_lm, tmp_path):
    engine = CacheClipEngine(tiny_lm, tiny_lm, tmp_path, EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4)))
    engine.ids = engine.ingest(CORPUS, progress=False)[:4]
    yield engine
    engine.close()


def test_union_at_ratio_one_is_full_prefill_and_at_zero_direct_reuse(eng):
    full = eng.answer(Q, chunk_ids=eng.ids, mode="full", max_new_tokens=5)
    reuse = eng.answer(Q, chunk_ids=eng.ids, mode="reuse", max_new_tokens=5)
    all_rows = eng.answer(Q, chunk_ids=eng.ids, mode=MODE, recompute_ratio=1.0, max_new_tokens=5)
    none = eng.answer(Q, chunk_ids=eng.ids, mode=MODE, recompute_ratio=0.0, max_new_tokens=5)
    assert all_rows.text == full.text and all_rows.effective_fraction == 1.0
    assert none.text == reuse.text and none.recomputed == reuse.recomputed


def test_union_is_cacheclip_at_its_share_filled_by_prophetkv(eng):
    ratio = 0.4
    ans = eng.answer(Q, chunk_ids=eng.ids, mode=MODE, recompute_ratio=ratio, max_new_tokens=1)
    assert ans.timings["selection"] > 0  # both selections are on the critical path
    prepared = eng.prepare(Q, eng.ids, mode=MODE, recompute_ratio=ratio)
    chunk_rows = prepared.layout.chunk_rows()
    share = get(MODE).share
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


def test_union_refuses_auto(eng):
    with pytest.raises(ValueError, match="recompute_ratio"):
        eng.answer(Q, chunk_ids=eng.ids, mode=MODE, recompute_ratio="auto", max_new_tokens=1)
