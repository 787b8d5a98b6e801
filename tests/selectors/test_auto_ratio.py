"""recompute_ratio="auto": the selector sizes each request's budget from its own scores (CacheClip:
the fewest top aux-scored tokens holding a calibrated share of the mass, within a floor and a cap)."""

import pytest
import torch
from conftest import CORPUS

from cacheclip_rag import (
    CacheClipEngine,
    ChunkConfig,
    EngineConfig,
    RequestOptions,
    SelectConfig,
)
from cacheclip_rag.request.profile_source import resolve
from cacheclip_rag.selectors.budget import mass_ratio
from cacheclip_rag.storage.profiles import Profile

Q = "what is the code in the kitchen drawer?"


def test_mass_ratio_is_small_for_concentrated_scores_and_large_for_spread_ones():
    peaked = [torch.tensor([10.0, 0.1, 0.1, 0.1]), torch.tensor([0.1] * 6)]
    flat = [torch.ones(4), torch.ones(6)]
    assert mass_ratio(peaked, share=0.5, floor=0.0001, cap=1.0) == pytest.approx(0.1)  # one token of ten
    assert mass_ratio(flat, share=0.5, floor=0.0001, cap=1.0) == pytest.approx(0.5)
    assert mass_ratio(peaked, share=0.5, floor=0.3, cap=1.0) == 0.3  # the floor
    assert mass_ratio(flat, share=0.9, floor=0.05, cap=0.4) == 0.4  # the cap
    assert mass_ratio([torch.zeros(3)], share=0.5, floor=0.05, cap=0.4) == 0.4  # no signal: the cap


@pytest.fixture(scope="module")
def eng(tiny_pair, tmp_path_factory):
    engine = CacheClipEngine(*tiny_pair, tmp_path_factory.mktemp("auto"),
                             EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4)))
    engine.ids = engine.ingest(CORPUS, progress=False)[:4]
    yield engine
    engine.close()


def test_auto_reports_what_it_spent_within_its_floor_and_cap(eng, tiny_pair, tmp_path):
    ans = eng.answer(Q, chunk_ids=eng.ids, recompute_ratio="auto", max_new_tokens=2)
    assert ans.recompute_ratio == "auto" and ans.metadata()["recompute_ratio"] == "auto"
    cfg = eng.profiles.settings()
    slack = 2 * cfg.window / ans.context_tokens  # grouping keeps the budget within a window per side
    assert cfg.auto_floor - slack <= ans.effective_fraction <= cfg.auto_cap + slack
    pinned = EngineConfig(chunk=eng.config.chunk, select=SelectConfig(auto_floor=0.3, auto_cap=0.3))
    with CacheClipEngine(*tiny_pair, eng.store.backend.root, pinned) as fixed:
        at_cap = fixed.answer(Q, chunk_ids=eng.ids, recompute_ratio="auto", max_new_tokens=2)
        at_ratio = fixed.answer(Q, chunk_ids=eng.ids, recompute_ratio=0.3, max_new_tokens=2)
    assert at_cap.recomputed == at_ratio.recomputed  # floor == cap: auto is that fixed ratio


def test_auto_share_comes_from_the_config_else_the_profile_else_the_default():
    p = Profile(primary="p", aux="a", aux_layers=(1,), auto_share=0.7)
    assert resolve(SelectConfig(), p).auto_share == 0.7
    assert resolve(SelectConfig(auto_share=0.4), p).auto_share == 0.4
    assert resolve(SelectConfig(), None).auto_share == 0.5
    with pytest.raises(ValueError, match="auto_share"):
        Profile(primary="p", aux="a", aux_layers=(1,), auto_share=1.5)
    with pytest.raises(ValueError, match=r"auto_floor \(0.5\) must not exceed auto_cap \(0.2\)"):
        SelectConfig(auto_floor=0.5, auto_cap=0.2)


@pytest.mark.parametrize("bad, message", [
    ("most", r"recompute_ratio must be a number in \[0, 1\] or 'auto', got 'most'"),
    (1.5, r"recompute_ratio must be in \[0, 1\], got 1.5"),
    (True, "recompute_ratio must be a number"),
])
def test_bad_ratios_are_refused_naming_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        RequestOptions.parse(recompute_ratio=bad)


def test_auto_is_refused_by_a_mode_that_cannot_size_its_budget(eng):
    with pytest.raises(ValueError, match="recompute_ratio 'auto' needs a mode that sizes its own budget"):
        eng.answer(Q, chunk_ids=eng.ids, mode="random", recompute_ratio="auto")
    assert eng.answer(Q, chunk_ids=eng.ids, mode="reuse", recompute_ratio="auto", max_new_tokens=1).effective_fraction == 0


def test_auto_through_the_command_line_and_both_framework_llms(eng):
    from langchain_cacheclip import CacheClipLLM
    from llama_index.llms.cacheclip import CacheClipLLM as IndexLLM

    from cacheclip_rag.cli import parser

    assert parser().parse_args(["ask", "why?", "--ratio", "auto"]).recompute_ratio == "auto"
    with pytest.raises(SystemExit):  # argparse: "expected a number in [0, 1] or 'auto', got 'most'"
        parser().parse_args(["ask", "why?", "--ratio", "most"])
    texts = "\n".join(eng.store.get_chunk(c).text for c in eng.ids)
    lc = CacheClipLLM(engine=eng, recompute_ratio="auto", max_new_tokens=2)
    result = lc.generate([texts + "\nQ: " + Q])
    assert result.generations[0][0].generation_info["recompute_ratio"] == "auto"
    li = IndexLLM(engine=eng, recompute_ratio="auto", max_new_tokens=2)
    assert li.complete(texts + "\nQ: " + Q).additional_kwargs["recompute_ratio"] == "auto"


def test_the_auto_share_is_calibrated_to_spend_a_fixed_ratio_on_average(tiny_pair, tmp_path):
    from cacheclip_rag.offline.auto_share import calibrate_share

    engine = CacheClipEngine(*tiny_pair, tmp_path, EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4)))
    with pytest.raises(ValueError, match="no calibrated profile"):
        calibrate_share(engine, lengths=(120,), samples=1, progress=False)
    pair = dict(primary=engine.primary.lm.fingerprint, aux=engine.aux.lm.fingerprint)
    engine.profiles.write(Profile(**pair, aux_layers=(1,), lengths=(120,)))
    (calibrated,) = calibrate_share(engine, lengths=(120,), samples=2, ratio=0.3, progress=False)
    assert 0 < calibrated.auto_share <= 1 and calibrated.aux_layers == (1,)
    assert engine.profiles.nearest().auto_share == calibrated.auto_share  # stored: requests use it from now on
    assert engine.profiles.settings().auto_share == calibrated.auto_share
    engine.close()


def test_bench_mode_lists_give_auto_only_to_modes_that_size_their_budget():
    from cacheclip_bench.harness import mode_list as _mode_list

    pairs = _mode_list(["reuse", "cacheblend", "cacheclip"], [0.1, "auto"])
    assert pairs == [("reuse", 0.0), ("cacheblend", 0.1), ("cacheclip", 0.1), ("cacheclip", "auto")]
    with pytest.raises(ValueError, match="takes numeric ratios"):
        _mode_list(["random"], ["auto"])
    # name@ratio: that ratio alone, beside the cross product of the rest
    assert _mode_list(["reuse", "cacheclip-stale@auto", "cacheclip-stale@0.1", "prophetkv"], [0.2]) == [
        ("reuse", 0.0), ("cacheclip-stale", "auto"), ("cacheclip-stale", 0.1), ("prophetkv", 0.2)]
    with pytest.raises(ValueError, match="takes numeric ratios"):
        _mode_list(["random@auto"], [0.2])
