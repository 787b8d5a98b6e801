"""Quality at a time budget: every mode's (TTFT / full, score) points, the Pareto frontier over
all of them, and each mode's score read off its own curve at a TTFT budget.

A point is one bench row (a mode at one ratio, or at "auto", which is a curve of its own): its median TTFT relative to full
prefill measured in the same run, and its score with a 95% interval: needle, % of full
attention's score on the same samples (higher is better, `NEEDLE`); fidelity, KL(full || mode)
(lower is better, `KL`). A mode's score at a budget B is linear interpolation between its
two measured points that bracket B in TTFT (the interval's bounds interpolated the same way, an
approximation: the two points are not independent); a mode whose every point is within B takes
its best point within B; a mode with none within B has no score there. Where no mode keeps a share S of full's score
within B, `reach` says where each mode first does: the ratio and TTFT at which its curve crosses
S, interpolated the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Metric:
    """What a point's score is: its name in tables and plots, which way is better, its format."""

    name: str
    higher_is_better: bool = True
    digits: int = 1

    def key(self, score: float) -> float:
        """Larger is better, whichever way the metric runs."""
        return score if self.higher_is_better else -score

    def fmt(self, x: float) -> str:
        return f"{x:.{self.digits}f}"


NEEDLE = Metric("% of full attention's score")
KL = Metric("KL(full||mode)", higher_is_better=False, digits=4)


def curve_name(mode: str, ratio: float | str) -> str:
    """The curve a row belongs to: its mode, or mode@auto (an adaptive budget is a curve of its own)."""
    return f"{mode}@{ratio}" if isinstance(ratio, str) else mode


@dataclass(frozen=True)
class Point:
    label: str
    mode: str
    ratio: float | str
    ttft: float
    """Median TTFT / full prefill's, same run."""
    score: float
    low: float
    high: float


def points(rows: list[dict]) -> list[Point]:
    """Needle bench rows (`needle.summarize`, one length) as points in % of full attention's score,
    the average's interval scaled the same way; `full` itself is the reference, not a point."""
    out = []
    for r in rows:
        if r["mode"] == "full" or not math.isfinite(r.get("ttft_vs_full", float("nan"))):
            continue
        scale = r["pct_of_full"] / r["avg"] if r["avg"] else 1.0
        low, high = (x * scale for x in r["avg_ci95"])
        out.append(Point(r["label"], curve_name(r["mode"], r["ratio"]), r["ratio"], r["ttft_vs_full"], r["pct_of_full"],
                         low, high))
    return out


def _ttft_key(length: int, mode: str, ratio: float | str) -> tuple:
    return int(length), mode, ratio if isinstance(ratio, str) else round(float(ratio), 4)


def load_ttft(path: str | Path) -> dict[tuple, float]:
    """(length, mode, ratio) -> TTFT / full from a `bench ttft --json` file."""
    try:
        rows = json.loads(Path(path).read_text())
        return {_ttft_key(r["length"], r["mode"], r["ratio"]): float(r["vs_full"]) for r in rows}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a `bench ttft --json` file (expected rows with length, mode, ratio, "
                         f"vs_full): {err}") from err


def ttft_machine(path: str | Path) -> str:
    """The machine a `bench ttft --json` file was measured on, as its rows say (files written
    before rows named it: "machine not recorded")."""
    rows = json.loads(Path(path).read_text())
    return next((r["machine"] for r in rows if isinstance(r, dict) and r.get("machine")), "machine not recorded")


def retime(rows: list[dict], measured: dict[tuple, float], source: str = "the TTFT run") -> list[dict]:
    """Bench rows placed at the TTFT / full of another run (`load_ttft`: a `bench ttft` on an idle
    CPU, where the rows' own came from a long quality run that shared it); `full` stays 1. A row
    whose length, mode and ratio that run did not measure is an error naming it."""
    out = []
    for r in rows:
        if r["mode"] != "full":
            key = _ttft_key(r["length"], r["mode"], r["ratio"])
            if key not in measured:
                raise ValueError(f"{source} has no TTFT for {r['label']} at {r['length']} tokens; run bench ttft "
                                 f"with that mode and ratio at that length")
            r = {**r, "ttft_vs_full": measured[key]}
        out.append(r)
    return out


def pareto(pts: list[Point], metric: Metric = NEEDLE) -> list[Point]:
    """The points no other point beats on both axes (faster or as fast, and scoring better or as
    well, one of them strictly), fastest first."""
    def beaten(p: Point) -> bool:
        good = metric.key(p.score)
        return any(q.ttft <= p.ttft and metric.key(q.score) >= good and (q.ttft < p.ttft or metric.key(q.score) > good)
                   for q in pts)

    return sorted((p for p in pts if not beaten(p)), key=lambda p: (p.ttft, -metric.key(p.score)))


def at_budget(pts: list[Point], budget: float, metric: Metric = NEEDLE) -> tuple[float, float, float] | None:
    """(score, low, high) of one mode's points at TTFT = budget (see the module docstring)."""
    curve = sorted(pts, key=lambda p: p.ttft)
    within = [p for p in curve if p.ttft <= budget]
    beyond = [p for p in curve if p.ttft > budget]
    if not within:
        return None
    if not beyond:
        best = max(within, key=lambda p: metric.key(p.score))
        return best.score, best.low, best.high
    a, b = within[-1], beyond[0]
    t = (budget - a.ttft) / (b.ttft - a.ttft)
    return tuple(x + t * (y - x) for x, y in ((a.score, b.score), (a.low, b.low), (a.high, b.high)))


def headline(pts: list[Point], budget: float = 0.25, metric: Metric = NEEDLE) -> list[dict]:
    """Per mode: its score at the budget with the interval, best first; modes without a point
    within the budget last."""
    modes = sorted({p.mode for p in pts})
    out = []
    for mode in modes:
        got = at_budget([p for p in pts if p.mode == mode], budget, metric)
        out.append(dict(mode=mode, budget=budget, score=got[0] if got else float("nan"),
                        low=got[1] if got else float("nan"), high=got[2] if got else float("nan")))
    return sorted(out, key=lambda r: (math.isnan(r["score"]), -metric.key(r["score"]) if not math.isnan(r["score"]) else 0))


@dataclass(frozen=True)
class Reach:
    """Where one mode's curve first keeps `target` (% of full): the ratio and TTFT / full,
    interpolated between the last point below and the first at or above; None for both where no
    measured point reaches it (then `best` is its best point)."""

    mode: str
    target: float
    ratio: float | None
    ttft: float | None
    best: Point


def reach(pts: list[Point], target: float = 95.0) -> list[Reach]:
    """Per mode with numeric ratios (an `auto` curve has no ratio to name), the first crossing
    of `target` along its points in ratio order; modes that reach it first, earliest TTFT first."""
    out = []
    for mode in sorted({p.mode for p in pts if not isinstance(p.ratio, str)}):
        curve = sorted((p for p in pts if p.mode == mode), key=lambda p: (p.ratio, p.ttft))
        best = max(curve, key=lambda p: p.score)
        hit = next((i for i, p in enumerate(curve) if p.score >= target), None)
        if hit is None:
            out.append(Reach(mode, target, None, None, best))
            continue
        b = curve[hit]
        if hit == 0:
            out.append(Reach(mode, target, b.ratio, b.ttft, best))
            continue
        a = curve[hit - 1]
        t = (target - a.score) / (b.score - a.score)
        out.append(Reach(mode, target, a.ratio + t * (b.ratio - a.ratio), a.ttft + t * (b.ttft - a.ttft), best))
    return sorted(out, key=lambda r: (r.ttft is None, r.ttft or 0.0, -r.best.score))


def reach_table(pts: list[Point], target: float = 95.0) -> str:
    """Where each mode first keeps `target` % of full attention's score (`reach`)."""
    lines = [f"where each mode first keeps >= {target:g}% of full (interpolated between measured ratios)",
             f"{'mode':<20} {'ratio':>6} {'TTFT/full':>9}"]
    for r in reach(pts, target):
        if r.ratio is None:
            lines.append(f"{r.mode:<20} {'-':>6} {'-':>9}  not by {max(p.ratio for p in pts if p.mode == r.mode):g}; "
                         f"best {r.best.score:.1f} at {r.best.label} ({r.best.ttft:.3f})")
        else:
            lines.append(f"{r.mode:<20} {r.ratio:>6.2f} {r.ttft:>9.3f}")
    return "\n".join(lines)


def table(pts: list[Point], budget: float = 0.25, length: int | None = None, metric: Metric = NEEDLE) -> str:
    """The headline (score at the budget per mode), then the frontier's points."""
    where = f" at {length} tokens" if length else ""
    ci_digits = 0 if metric.digits <= 1 else metric.digits
    width = max(6, metric.digits + 4)
    lines = [f"score at TTFT <= {budget:g} of full{where} ({metric.name}, interpolated; 95% CI)",
             f"{'mode':<20} {'score':>{width}} {'95% CI':>{2 * width + 4}}"]
    for r in headline(pts, budget, metric):
        if math.isnan(r["score"]):
            lines.append(f"{r['mode']:<20} {'-':>{width}} {'(no point within)':>{2 * width + 4}}")
        else:
            ci = f"[{r['low']:.{ci_digits}f}, {r['high']:.{ci_digits}f}]"
            lines.append(f"{r['mode']:<20} {metric.fmt(r['score']):>{width}} {ci:>{2 * width + 4}}")
    lines += ["", "Pareto frontier (no other point is faster and better):",
              f"{'point':<24} {'TTFT/full':>9} {'score':>{width}}"]
    lines += [f"{p.label:<24} {p.ttft:>9.3f} {metric.fmt(p.score):>{width}}" for p in pareto(pts, metric)]
    return "\n".join(lines)


def plot(pts: list[Point], path: str, budget: float = 0.25, title: str = "", metric: Metric = NEEDLE) -> None:
    """Score against TTFT / full: each mode's curve, the frontier, the budget line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in sorted({p.mode for p in pts}):
        curve = sorted((p for p in pts if p.mode == mode), key=lambda p: p.ttft)
        ax.errorbar([p.ttft for p in curve], [p.score for p in curve],
                    yerr=[[p.score - p.low for p in curve], [p.high - p.score for p in curve]],
                    marker="o", capsize=3, label=mode)
    front = pareto(pts, metric)
    ax.plot([p.ttft for p in front], [p.score for p in front], "k--", linewidth=1, label="Pareto frontier")
    ax.axvline(budget, color="grey", linestyle=":", label=f"TTFT = {budget:g} of full")
    ax.set_xlabel("TTFT / full prefill (same run)")
    ax.set_ylabel(metric.name)
    ax.set_title(title or "Quality at a time budget")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
