"""The quality-at-a-time-budget frontier on hand-made bench rows."""

import math

import pytest

from cacheclip_bench import frontier


def _row(mode, ratio, ttft, pct, ci=(0.4, 0.6), avg=0.5):
    return dict(length=2048, mode=mode, ratio=ratio, label=f"{mode}@{ratio}", ttft_vs_full=ttft, pct_of_full=pct,
                avg=avg, avg_ci95=ci)


ROWS = [
    dict(length=2048, mode="full", ratio=1.0, label="full", ttft_vs_full=1.0, pct_of_full=100.0, avg=0.8,
         avg_ci95=(0.7, 0.9)),
    _row("reuse", 0.0, 0.05, 40.0),
    _row("a", 0.1, 0.15, 60.0), _row("a", 0.2, 0.20, 70.0), _row("a", 0.3, 0.30, 90.0),
    _row("b", 0.1, 0.22, 80.0), _row("b", 0.2, 0.35, 95.0),
    _row("c", 0.2, 0.40, 99.0),
]


def test_points_scale_the_interval_to_percent_of_full_and_leave_out_full():
    pts = frontier.points(ROWS)
    assert "full" not in {p.mode for p in pts} and len(pts) == 7
    a1 = next(p for p in pts if p.label == "a@0.1")
    assert (a1.score, a1.low, a1.high) == pytest.approx((60.0, 48.0, 72.0))  # 0.4 and 0.6 of 0.5 avg -> x120


def test_a_modes_score_at_the_budget_is_interpolated_between_its_bracketing_points():
    pts = frontier.points(ROWS)
    score, low, high = frontier.at_budget([p for p in pts if p.mode == "a"], 0.25)
    assert score == pytest.approx(80.0)  # halfway from (0.20, 70) to (0.30, 90)
    assert (low, high) == pytest.approx((64.0, 96.0))
    assert frontier.at_budget([p for p in pts if p.mode == "b"], 0.25)[0] == pytest.approx(80 + 15 * 3 / 13)
    assert frontier.at_budget([p for p in pts if p.mode == "c"], 0.25) is None  # no point within
    assert frontier.at_budget([p for p in pts if p.mode == "reuse"], 0.25)[0] == 40.0  # all within: its best


def test_the_headline_ranks_modes_and_the_frontier_keeps_only_unbeaten_points():
    pts = frontier.points(ROWS)
    heads = frontier.headline(pts, 0.25)
    assert [h["mode"] for h in heads] == ["b", "a", "reuse", "c"] and math.isnan(heads[-1]["score"])
    assert [p.label for p in frontier.pareto(pts)] == ["reuse@0.0", "a@0.1", "a@0.2", "b@0.1", "a@0.3", "b@0.2", "c@0.2"]
    text = frontier.table(pts, 0.25, 2048)
    assert "score at TTFT <= 0.25 of full at 2048 tokens" in text and "(no point within)" in text


def test_a_point_beaten_on_both_axes_is_off_the_frontier(tmp_path):
    pts = frontier.points([_row("x", 0.1, 0.2, 50.0), _row("y", 0.1, 0.1, 60.0), _row("y", 0.2, 0.3, 55.0)])
    assert [p.label for p in frontier.pareto(pts)] == ["y@0.1"]
    frontier.plot(pts, str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").stat().st_size > 1000


def test_auto_points_are_a_curve_of_their_own():
    rows = [_row("cacheclip", 0.2, 0.26, 67.0), _row("cacheclip", "auto", 0.29, 73.0)]
    rows[1]["label"] = "cacheclip@auto"
    assert sorted(p.mode for p in frontier.points(rows)) == ["cacheclip", "cacheclip@auto"]


def test_a_lower_is_better_metric_turns_the_frontier_and_the_budget_around():
    """Fidelity's KL: the best point within the budget is the lowest, and a point is beaten by one
    as fast with a lower KL."""
    pts = [frontier.Point("a@0.1", "a", 0.1, 0.15, 0.08, 0.06, 0.10), frontier.Point("a@0.2", "a", 0.2, 0.20, 0.04, 0.03, 0.05),
           frontier.Point("b@0.1", "b", 0.1, 0.18, 0.09, 0.07, 0.11), frontier.Point("c@0.1", "c", 0.1, 0.10, 0.12, 0.1, 0.14)]
    assert frontier.at_budget([p for p in pts if p.mode == "a"], 0.3, frontier.KL)[0] == pytest.approx(0.04)
    assert frontier.at_budget([p for p in pts if p.mode == "a"], 0.175, frontier.KL)[0] == pytest.approx(0.06)
    assert [p.label for p in frontier.pareto(pts, frontier.KL)] == ["c@0.1", "a@0.1", "a@0.2"]
    assert [h["mode"] for h in frontier.headline(pts, 0.3, frontier.KL)] == ["a", "b", "c"]
    text = frontier.table(pts, 0.3, 2048, frontier.KL)
    assert "0.0400" in text and "[0.0300, 0.0500]" in text and "KL(full||mode)" in text


def test_fidelity_rows_become_points_at_their_measured_ttft():
    from cacheclip_bench import fidelity

    rows = [dict(length=2048, mode="cacheclip", ratio=0.2, label="cacheclip@0.2", kl=0.04, kl_ci95=(0.03, 0.05),
                 ttft_vs_full=0.26),
            dict(length=2048, mode="cacheclip", ratio="auto", label="cacheclip@auto", kl=0.03, kl_ci95=(0.02, 0.04),
                 ttft_vs_full=0.29),
            dict(length=2048, mode="reuse", ratio=0.0, label="reuse", kl=0.13, kl_ci95=(0.1, 0.16),
                 ttft_vs_full=float("nan"))]
    pts = fidelity.points(rows)
    assert [(p.mode, p.ttft, p.score, p.low) for p in pts] == [("cacheclip", 0.26, 0.04, 0.03),
                                                                ("cacheclip@auto", 0.29, 0.03, 0.02)]


def test_reach_says_where_each_mode_first_keeps_the_target_share():
    pts = frontier.points(ROWS + [_row("a", "auto", 0.26, 97.0)])
    got = {r.mode: r for r in frontier.reach(pts, 95.0)}
    assert "a@auto" not in got  # an adaptive budget has no ratio to name
    b, c, a = got["b"], got["c"], got["a"]
    assert (b.ratio, b.ttft) == pytest.approx((0.2, 0.35))  # exactly at its second point
    assert (c.ratio, c.ttft) == pytest.approx((0.2, 0.40))  # its first point is already above
    assert a.ratio is None and a.ttft is None and a.best.label == "a@0.3"
    half = frontier.reach(pts, 85.0)
    assert [r.mode for r in half][:3] == ["b", "a", "c"]  # earliest TTFT first
    assert (half[0].ratio, half[0].ttft) == pytest.approx((0.1 + 0.1 / 3, 0.22 + 0.13 / 3))  # 1/3 from 80 to 95
    assert (half[1].ratio, half[1].ttft) == pytest.approx((0.275, 0.275))  # 3/4 of the way from 70 to 90
    text = frontier.reach_table(pts, 95.0)
    assert "first keeps >= 95% of full" in text and "not by 0.3; best 90.0 at a@0.3" in text


def test_rows_are_placed_at_the_ttft_of_another_run(tmp_path):
    import json

    (tmp_path / "ttft.json").write_text(json.dumps([
        dict(length=2048, mode="full", ratio=1.0, vs_full=1.0), dict(length=2048, mode="reuse", ratio=0.0, vs_full=0.04),
        dict(length=2048, mode="a", ratio=0.1, vs_full=0.11), dict(length=2048, mode="a", ratio=0.2, vs_full=0.21),
        dict(length=2048, mode="a", ratio=0.30000000000000004, vs_full=0.31)]))
    measured = frontier.load_ttft(tmp_path / "ttft.json")
    rows = frontier.retime([r for r in ROWS if r["mode"] in ("full", "reuse", "a")], measured)
    assert [r["ttft_vs_full"] for r in rows] == [1.0, 0.04, 0.11, 0.21, 0.31]
    assert ROWS[2]["ttft_vs_full"] == 0.15  # the given rows are left as they were
    with pytest.raises(ValueError, match=r"no TTFT for b@0.1 at 2048 tokens"):
        frontier.retime(ROWS, measured)
    (tmp_path / "bad.json").write_text('{"rows": 1}')
    with pytest.raises(ValueError, match="not a `bench ttft --json` file"):
        frontier.load_ttft(tmp_path / "bad.json")
