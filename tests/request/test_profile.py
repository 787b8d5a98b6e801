"""The calibrated selection profile: one frozen type, validated, stored and shipped as flat JSON."""

import json

import pytest

from cacheclip_rag.config import SelectConfig
from cacheclip_rag.request import profile_source
from cacheclip_rag.storage import profiles
from cacheclip_rag.storage.profiles import Profile


def test_a_profile_round_trips_through_its_json_and_keeps_what_was_measured():
    p = Profile(primary="p1", aux="a1", aux_layers=(2, 3), head_agg="max", lengths=(1024, 4096),
                measured={"kl": 0.02, "criterion": "kl"})
    doc = json.loads(json.dumps(p.to_dict()))
    assert doc["aux_layers"] == [2, 3] and doc["kl"] == 0.02
    back = Profile.from_dict(doc)
    assert back == p and back.measured["criterion"] == "kl"
    assert back.length == pytest.approx(2048.0)
    assert "heads max" in back.describe()


@pytest.mark.parametrize("bad, message", [
    ({"aux": "a", "aux_layers": [1]}, "primary"),
    ({"primary": "p", "aux": "a"}, "aux_layers"),
    ({"primary": "p", "aux": "a", "aux_layers": []}, "aux_layers must be a non-empty list"),
    ({"primary": "p", "aux": "a", "aux_layers": ["1"]}, "aux_layers"),
    ({"primary": "p", "aux": "a", "aux_layers": [1], "head_agg": "median"}, r"head_agg must be one of \['mean', 'max'\]"),
    ({"primary": "p", "aux": "a", "aux_layers": [1], "context": "all"}, "context must be one of"),
    ({"primary": "p", "aux": "a", "aux_layers": [1], "lengths": [0]}, "lengths"),
])
def test_a_bad_profile_is_refused_naming_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        Profile.from_dict(bad)


def test_a_stored_document_with_a_bad_profile_keeps_the_good_ones():
    good = Profile(primary="p", aux="a", aux_layers=(1,), lengths=(4096,))
    doc = {"profiles": [{"primary": "p", "aux": "a", "aux_layers": "last"}, good.to_dict()]}
    assert profiles.parse(doc) == [good]
    assert profiles.parse(None) == [] and profiles.parse({"aux_layers": [1]}) == []  # a bare old profile without a pair
    assert profiles.parse(good.to_dict()) == [good]  # stores written before per-length profiles held one object


def test_merging_replaces_only_the_same_pair_at_the_same_lengths():
    a2k = Profile(primary="p", aux="a", aux_layers=(1,), lengths=(2048,))
    a4k = Profile(primary="p", aux="a", aux_layers=(2,), lengths=(4096,))
    new2k = Profile(primary="p", aux="a", aux_layers=(3,), lengths=(2048,))
    other = Profile(primary="q", aux="a", aux_layers=(4,), lengths=(2048,))
    assert profiles.merged([a4k, a2k], new2k) == [new2k, a4k]
    assert [p.aux_layers for p in profiles.merged([a2k], other)] == [(1,), (4,)]


def test_resolve_fills_what_the_config_leaves_open():
    p = Profile(primary="p", aux="a", aux_layers=(5,), row_agg="max", context="joint")
    cfg = profile_source.resolve(SelectConfig(head_agg="max"), p)
    assert (cfg.score_layers, cfg.head_agg, cfg.row_agg, cfg.normalize, cfg.context) == ((5,), "max", "max", "none", "joint")
    bare = profile_source.resolve(SelectConfig(), None)
    assert (bare.score_layers, bare.head_agg, bare.context) == ((-1,), "mean", "chunk")


def test_the_default_pair_ships_valid_profiles_and_other_pairs_none():
    shipped = profile_source.shipped("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct")
    assert shipped and all(p.source == "shipped" for p in shipped)
    assert [p.length for p in shipped] == sorted(p.length for p in shipped)
    assert profile_source.shipped("/some/folder", "smollm2-135m-instruct") == []


def test_the_1_5b_pair_ships_its_own_profile():
    shipped = profile_source.shipped("qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct")
    assert [round(p.length) for p in shipped] == [2048, 4096] and {p.source for p in shipped} == {"shipped"}
    assert shipped[1].aux_layers == (18,)  # 4K requests score with an earlier layer than 2K ones
    assert shipped[0].aux_layers == (21, 22) != profile_source.shipped("qwen2.5-coder-0.5b-instruct",
                                                                  "smollm2-135m-instruct")[0].aux_layers


def test_the_staleness_settings_come_from_the_config_else_the_profile_else_the_defaults():
    from cacheclip_rag.config import STALE_DEFAULTS

    p = Profile(primary="p", aux="a", aux_layers=(5,), stale_layers=1, stale_on="v", cascade_factor=4.0)
    assert Profile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    cfg = profile_source.resolve(SelectConfig(stale_on="k"), p)
    assert (cfg.stale_layers, cfg.stale_on, cfg.cascade_factor) == (1, "k", 4.0)
    bare = profile_source.resolve(SelectConfig(), Profile(primary="p", aux="a", aux_layers=(5,)))
    assert {name: getattr(bare, name) for name in STALE_DEFAULTS} == STALE_DEFAULTS
    for shipped in profile_source.shipped("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"):  # calibrated
        assert (shipped.stale_layers, shipped.stale_on, shipped.cascade_factor) == (3, "kv", 2.5)
        assert "stale_calibration" in shipped.measured


@pytest.mark.parametrize("field, value, message", [
    ("stale_layers", 0, "profile stale_layers must be a positive integer, got 0"),
    ("stale_on", "q", r"profile stale_on must be one of \['k', 'v', 'kv'\] or absent, got 'q'"),
    ("cascade_factor", 0.5, "profile cascade_factor must be a number >= 1, got 0.5"),
])
def test_a_bad_staleness_setting_in_a_profile_is_refused_naming_it(field, value, message):
    with pytest.raises(ValueError, match=message):
        Profile.from_dict({"primary": "p", "aux": "a", "aux_layers": [1], field: value})
