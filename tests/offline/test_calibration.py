"""Selection quality: budget-keeping, scoring options, the oracle mode, calibration profiles."""

import dataclasses

import pytest
import torch
from conftest import CORPUS

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig, SelectConfig
from cacheclip_bench.suite import Suite
from cacheclip_bench import needle
from cacheclip_rag.offline import calibrate as calibrate_mod
from cacheclip_rag.offline.calibrate import calibrate
from cacheclip_rag.request.recompute import recompute_rows
from cacheclip_rag.selectors.budget import keep_budget, pick
from cacheclip_rag.selectors.primary_attention import attention_from_rows

Q = "what is the code in the kitchen drawer?"


def test_budget_keeping_reaches_the_fraction_within_one_window():
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        sizes = torch.randint(20, 300, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
        scores = [torch.rand(n, generator=gen) ** 4 for n in sizes]
        ratio = float(torch.rand(1, generator=gen)) * 0.6 + 0.05
        kept = keep_budget(scores, ratio, window=8, tau=5)
        total = sum(sizes)
        got = sum(int(k.sum()) for k in kept)
        assert abs(got - round(ratio * total)) <= 8, (trial, got, ratio * total)
        for k in kept:  # kept runs come from passing windows: none shorter than tau
            runs = torch.diff(torch.cat([torch.tensor([0]), k.int(), torch.tensor([0])])).nonzero().flatten()
            lengths = (runs[1::2] - runs[::2]).tolist()
            assert all(n >= 5 for n in lengths)


def test_paper_rule_undershoots_and_keep_does_not():
    gen = torch.Generator().manual_seed(1)
    scores = [torch.rand(500, generator=gen)]
    cfg = SelectConfig()
    paper = pick(scores, 0.2, cfg, "paper")[0].kept.sum().item()
    keep = pick(scores, 0.2, cfg, "keep")[0].kept.sum().item()
    assert paper < 100 - 8 and abs(keep - 100) <= 8


def test_select_config_validation():
    with pytest.raises(ValueError, match="score_layers"):
        SelectConfig(score_layers=())
    with pytest.raises(ValueError, match="head_agg"):
        SelectConfig(head_agg="median")
    assert SelectConfig(score_layers=[3, 4]).score_layers == (3, 4)


@pytest.fixture(scope="module")
def eng(tiny_pair, tmp_path_factory):
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4))
    engine = CacheClipEngine(*tiny_pair, tmp_path_factory.mktemp("cal"), cfg)
    engine.ids = engine.ingest(CORPUS, progress=False)[:4]
    return engine


def test_oracle_mode_matches_its_definition(eng):
    ans = eng.answer(Q, chunk_ids=eng.ids, mode="oracle", recompute_ratio=0.5, max_new_tokens=1, budget="keep")
    layout = eng.prepare(Q, eng.ids).layout
    segs = layout.chunk_segments()
    query_rows = torch.arange(segs[-1].end, layout.num_tokens)
    # The definition, computed independently: a full prefill through transformers with eager
    # attention weights; the last layer's attention from the question rows, mean over heads and rows.
    lm = eng.primary.lm
    lm.model.config._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            out = lm.model(input_ids=layout.input_ids[None], output_attentions=True)
    finally:
        lm.model.config._attn_implementation = "sdpa"
    att = out.attentions[-1][0][:, query_rows].mean(dim=(0, 1))
    ours = attention_from_rows(lm, layout.input_ids, query_rows, [-1])[-1]
    torch.testing.assert_close(ours, att.float(), atol=1e-5, rtol=1e-4)
    picks = pick([att[s.start : s.end] for s in segs], 0.5, eng.config.select, "keep")
    expected = {s.start + int(i) for s, p in zip(segs, picks) for i in torch.nonzero(p.kept).flatten()}
    chunk_rows = set(layout.chunk_rows().tolist())
    assert set(ans.recomputed) & chunk_rows == expected


def test_calibration_is_deterministic_and_never_reads_evaluation_seeds(eng, monkeypatch):
    seen = []
    real = calibrate_mod.generate
    monkeypatch.setattr(calibrate_mod, "generate", lambda v, n, s, t: seen.append(s) or real(v, n, s, t))
    chunks_before = len(eng.store.chunks())
    a, scores_a = calibrate(eng, lengths=(120,), samples=2, answer_tokens=4)
    b, scores_b = calibrate(eng, lengths=(120,), samples=2, answer_tokens=4)
    assert a == dataclasses.replace(b, created=a.created) and a.measured["kl"] == b.measured["kl"]
    assert [s.kl for s in scores_a] == [s.kl for s in scores_b]
    assert seen and min(seen) >= calibrate_mod.CALIBRATION_SEED_BASE
    assert len(eng.store.chunks()) == chunks_before  # calibration inputs went to a scratch store
    # two aux layers: (0), (1), (0, 1); 15 variants: 4 aggregations x 2 normalizations x 2 contexts, less one
    assert len(scores_a) == 2 + 1 + 15 and {s.context for s in scores_a} == {"chunk", "joint"}
    assert all(s.kl >= -1e-6 for s in scores_a)
    with pytest.raises(ValueError, match="calibration seeds"):
        calibrate(eng, seed=5)
    with pytest.raises(ValueError, match="evaluation seeds"):
        needle.run(None, [("reuse", 0.0)], Suite(seed=calibrate_mod.CALIBRATION_SEED_BASE - 1, samples=2))


def test_profile_round_trips_and_is_used_by_default(tiny_pair, tmp_path):
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4))
    eng = CacheClipEngine(*tiny_pair, tmp_path, cfg)
    eng.ids = eng.ingest(CORPUS, progress=False)[:4]
    assert eng.profiles.settings().score_layers == (-1,)
    profile, _ = calibrate(eng, lengths=(120,), samples=1, answer_tokens=4)
    assert eng.store.read_profiles(eng.primary.lm.fingerprint, eng.aux.lm.fingerprint) == [profile]
    assert eng.profiles.settings().score_layers == profile.aux_layers
    assert eng.store.read_profiles("other", "pair") == []
    again = CacheClipEngine(eng.primary.lm, eng.aux.lm, eng.store.backend.root, eng.config)
    assert again.profiles.nearest() == profile
    ans = again.answer(Q, chunk_ids=eng.ids, recompute_ratio=0.3, budget="keep", max_new_tokens=1)
    assert abs(ans.effective_fraction - 0.3) <= 8 / ans.context_tokens + 1e-9
    resolved = again.profiles.settings()
    assert (list(resolved.score_layers), resolved.head_agg, resolved.row_agg, resolved.normalize, resolved.context) == \
        (list(profile.aux_layers), profile.head_agg, profile.row_agg, profile.normalize, profile.context)
    assert ans.metadata()["score_layers"] == list(profile.aux_layers) and ans.metadata()["budget"] == "keep"
    # A config value overrides the profile's; a request's layers override both.
    pinned = CacheClipEngine(eng.primary.lm, eng.aux.lm, eng.store.backend.root,
                             EngineConfig(chunk=cfg.chunk, select=SelectConfig(score_layers=(0,), head_agg="max")))
    assert pinned.profiles.settings().score_layers == (0,) and pinned.profiles.settings().head_agg == "max"
    assert pinned.profiles.settings().row_agg == profile.row_agg
    ans = pinned.answer(Q, chunk_ids=eng.ids, score_layers=[-1], max_new_tokens=1)
    assert ans.score_layers == (-1,)


def test_a_request_takes_the_profile_calibrated_nearest_its_length(tiny_pair, tmp_path):
    """Profiles calibrated at different lengths live side by side; each request scores with the
    one nearest its own token count, and recalibrating a length replaces only that one."""
    from cacheclip_rag.request.profile_source import nearest
    from cacheclip_rag.storage.profiles import Profile

    eng = CacheClipEngine(*tiny_pair, tmp_path, EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4)))
    ids = eng.ingest(CORPUS, progress=False)
    n_few, n_many = (eng.prepare(Q, chunk_ids=ids[:n]).layout.num_tokens for n in (1, len(ids)))
    assert n_many > 2 * n_few
    pair = dict(primary=eng.primary.lm.fingerprint, aux=eng.aux.lm.fingerprint)
    eng.profiles.write(Profile(**pair, aux_layers=(1,), lengths=(n_many,)))
    eng.profiles.write(Profile(**pair, aux_layers=(0,), lengths=(n_few,)))
    eng.profiles.write(Profile(primary="other", aux="pair", aux_layers=(1,), lengths=(n_few,)))
    assert [p.aux_layers for p in eng.profiles.all()] == [(0,), (1,)]  # shortest first, other pairs ignored
    middle = (n_few * n_many) ** 0.5  # nearest by ratio of lengths
    assert nearest(eng.profiles.all(), int(middle) - 1).aux_layers == (0,)
    assert nearest(eng.profiles.all(), int(middle) + 1).aux_layers == (1,)
    assert eng.profiles.nearest().aux_layers == (0,) and nearest([], 100) is None
    assert eng.answer(Q, chunk_ids=ids[:1], max_new_tokens=1).score_layers == (0,)
    assert eng.answer(Q, chunk_ids=ids, max_new_tokens=1).score_layers == (1,)
    eng.profiles.write(Profile(**pair, aux_layers=(2,), lengths=(n_many,)))
    assert [p.aux_layers for p in eng.profiles.all()] == [(0,), (2,)]


@pytest.mark.parametrize("bad", [[], [99], ["1"], True, "last"])
def test_score_layers_request_option_is_validated(eng, bad):
    with pytest.raises(ValueError, match="score_layers"):
        eng.answer(Q, chunk_ids=eng.ids, score_layers=bad, max_new_tokens=1)


def test_teacher_forced_fidelity_matches_a_plain_forward_and_reuse(eng):
    """The fidelity signal's oracles: every chunk row recomputed gives the model's own forward
    over prompt + answer; no row recomputed gives direct reuse's own decoding logits."""
    from cacheclip_rag.offline.reference import (
        Reference,
        kl_positions,
        reference,
        top1_agreement,
    )
    from cacheclip_rag.request.pipeline import assemble

    prepared = eng.prepare(Q, eng.ids)
    layout, kvs = prepared.layout, prepared.chunk_kvs()
    answer = torch.tensor([5, 9, 13, 2])
    cache = assemble(eng.primary.lm, layout, eng.primary.prefix(), kvs, capacity=layout.num_tokens + 4)
    ref = Reference(layout, cache, answer, torch.empty(0))
    full = ref.forced(eng, layout.chunk_rows())
    with torch.inference_mode():
        logits = eng.primary.lm.model(input_ids=torch.cat([layout.input_ids, answer[:-1]])[None]).logits[0].float()
    expected = torch.log_softmax(logits[layout.num_tokens - 1 :], dim=-1)
    torch.testing.assert_close(full, expected, atol=1e-4, rtol=1e-4)
    assert float(kl_positions(full, full).mean()) == 0.0 and bool(top1_agreement(full, full).all())
    # The base cache is copied, never written: a second call sees the same reused cache.
    reuse_a = ref.forced(eng, layout.chunk_rows()[:0])
    reuse_b = ref.forced(eng, layout.chunk_rows()[:0])
    torch.testing.assert_close(reuse_a, reuse_b)
    fresh = assemble(eng.primary.lm, layout, eng.primary.prefix(), kvs)
    first = recompute_rows(eng.primary.lm, fresh, layout.input_ids, layout.uncached_rows()).logits
    torch.testing.assert_close(reuse_a[0], torch.log_softmax(first, dim=-1), atol=1e-4, rtol=1e-4)
    assert float(kl_positions(full, reuse_a).mean()) > 0
    # reference(): full attention's own answer, with its log-probabilities from the 100% path.
    built = reference(eng, Q, eng.ids, answer_tokens=3)
    assert built is not None and 1 <= built.answer.numel() <= 3
    assert built.full_logprobs.shape == (built.answer.numel(), eng.primary.lm.config.vocab_size)


def test_left_at_hard_weighs_only_the_positions_reuse_gets_wrong():
    reuse = torch.tensor([0.0, 0.0, 0.0, 4.0])  # one hard position of four
    assert calibrate_mod._left_at_hard(torch.tensor([9.0, 9.0, 9.0, 1.0]), reuse) == 0.25
    assert calibrate_mod._left_at_hard(reuse, reuse) == 1.0
    assert calibrate_mod._left_at_hard(torch.zeros(4), torch.zeros(4)) == 0.0


def test_calibration_criterion_is_validated_and_recorded(eng):
    with pytest.raises(ValueError, match="criterion"):
        calibrate(eng, lengths=(120,), samples=1, criterion="loss")
    profile, scores = calibrate(eng, lengths=(120,), samples=1, answer_tokens=4, criterion="hard")
    assert profile.measured["criterion"] == "hard"
    layer_scores = [s for s in scores if s.variant == calibrate_mod.DEFAULT_VARIANT]
    assert [s.left_at_hard for s in layer_scores] == sorted(s.left_at_hard for s in layer_scores)


def test_chunk_start_tokens_are_always_recomputed(tiny_pair, tmp_path):
    with pytest.raises(ValueError, match="chunk_start_tokens"):
        SelectConfig(chunk_start_tokens=-1)
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4), select=SelectConfig(chunk_start_tokens=3))
    eng = CacheClipEngine(*tiny_pair, tmp_path, cfg)
    ids = eng.ingest(CORPUS, progress=False)[:4]
    ans = eng.answer(Q, chunk_ids=ids, recompute_ratio=0.1, max_new_tokens=1)
    layout = eng.prepare(Q, ids).layout
    starts = {seg.start + i for seg in layout.chunk_segments() for i in range(3)}
    assert starts <= set(ans.recomputed)


def test_profiles_are_read_once_and_again_after_a_write_or_a_catch_up(tiny_pair, tmp_path):
    """A request takes its selection settings from profiles held in memory, not from a store read
    per request; a profile written here, or one another process wrote before ingesting (found by
    the catch-up), is taken from the next request on."""
    from cacheclip_rag.storage.profiles import Profile

    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4))
    eng = CacheClipEngine(*tiny_pair, tmp_path / "s", cfg)
    reads = []
    read = eng.store.read_profiles
    eng.store.read_profiles = lambda *pair: (reads.append(pair) if pair else None) or read(*pair)  # a pair's reads
    ids = eng.ingest(CORPUS[:3], progress=False)  # the aux depth asks the profiles: the one read
    for _ in range(3):
        eng.answer(Q, chunk_ids=ids, max_new_tokens=1)
    assert len(reads) == 1
    pair = dict(primary=eng.primary.lm.fingerprint, aux=eng.aux.lm.fingerprint)
    eng.profiles.write(Profile(**pair, aux_layers=(0,)))
    assert eng.answer(Q, chunk_ids=ids, max_new_tokens=1).score_layers == (0,) and len(reads) == 2
    with CacheClipEngine(*tiny_pair, tmp_path / "s", cfg) as other:  # another process on the store
        other.profiles.write(Profile(**pair, aux_layers=(1,)))
        assert eng.answer(Q, chunk_ids=ids, max_new_tokens=1).score_layers == (0,)  # not looked for yet
        other.ingest([CORPUS[5]], progress=False)
    # a request that reads the corpus (retrieval) catches up first, and finds the new profile
    assert eng.answer(Q, max_new_tokens=1).score_layers == (1,)
    eng.close()
