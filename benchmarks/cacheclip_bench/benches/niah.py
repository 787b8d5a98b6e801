"""`cacheclip bench niah`: the needle suite, every mode's score on the same samples, paired."""

from __future__ import annotations

from pathlib import Path

from .. import harness as h
from .. import needle
from ..journal import provenance
from ..suite import Suite

NAME = "niah"
HELP = "the needle suite: every mode's score on the same samples, paired"
MODES = ["full", "reuse", "ape", "cacheblend", "epic", "random", "cacheclip"]
FRONTIER_MODES = ["full", "reuse", "cacheblend", "epic", "random", "cacheclip", "prophetkv"]
"""The modes of `--frontier` when none are given (the packet modes join with --modes)."""


def arguments(p) -> None:
    h.suite_bench_flags(p, MODES, "the cacheclip rows")
    p.add_argument("--max-new-tokens", type=int, default=64)
    h.from_flag(p, "disjoint seeds")
    p.add_argument("--ttft-from", default=None, metavar="JSON",
                   help="place the frontier's points at the TTFT / full of this `bench ttft --json` run (one on an "
                        "idle CPU) instead of the samples' own")
    h.results_flag(p)
    h.out_flags(p, "-quality, -ttft, -frontier-LENGTH")


def measure(args) -> h.Report:
    report = h.Report()
    args.ratios = args.ratios or (h.FRONTIER_RATIOS if args.frontier else [0.2])
    if args.from_json:
        results = needle.load(args.from_json)
        report.add(provenance(args.from_json))
    else:
        engine = h.engine(args)
        modes = h.mode_list(args.modes or (FRONTIER_MODES if args.frontier else MODES), args.ratios)
        journal = h.journal(args, engine, budget=args.budget, chunk_tokens=args.chunk_tokens)
        suite = Suite.from_args(args)
        results = needle.run(engine, modes, suite, max_new_tokens=args.max_new_tokens,
                             progress=h.suite_progress(suite), budget=args.budget, journal=journal)
    rows = needle.summarize(results)
    report.add(needle.table(rows))
    text, pairs = h.versus_tables(args, results, rows, "score",
                                  "Paired differences on the same samples (x100; 95% stratified bootstrap interval):")
    report.add(text)
    if args.frontier:
        report.add(h.frontier_tables(args, rows, "niah"))
    report.json = lambda path: needle.write_json(results, rows, path, pairs)
    report.plot = lambda path: _plot(rows, path)
    return report


def _plot(rows: list[dict], path: str) -> None:
    from .. import plots

    stem = Path(path)
    plots.quality_vs_ratio(rows, stem.with_name(stem.stem + "-quality.png"))
    plots.ttft_breakdown(rows, stem.with_name(stem.stem + "-ttft.png"))
