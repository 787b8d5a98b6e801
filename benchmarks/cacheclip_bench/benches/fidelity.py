"""`cacheclip bench fidelity`: KL to full attention of each mode's recompute, teacher-forced."""

from __future__ import annotations

from .. import fidelity
from .. import harness as h
from ..suite import Suite

NAME = "fidelity"
HELP = "KL to full attention of each mode's recompute, teacher-forced, no labels"
MODES = ["reuse", "random", "epic", "cacheclip-paper", "cacheclip", "oracle"]
FRONTIER_MODES = ["reuse", "epic", "random", "cacheclip", "prophetkv"]
"""The modes of `--frontier`: those with a row set to replay (CacheBlend has none)."""
KL_TITLE = ("Paired KL differences on the same samples (negative: closer to full; 95% bootstrap interval; "
            "W/L: higher/lower KL):")


def arguments(p) -> None:
    h.suite_bench_flags(p, MODES, "the cacheclip rows")
    p.add_argument("--max-new-tokens", type=int, default=64, help="answer tokens compared")
    h.out_flags(p, "-frontier-LENGTH")


def measure(args) -> h.Report:
    report = h.Report()
    args.ratios = args.ratios or (h.FRONTIER_RATIOS if args.frontier else [0.2])
    engine = h.engine(args)
    modes = h.mode_list(args.modes or (FRONTIER_MODES if args.frontier else MODES), args.ratios)
    modes = [(m, r) for m, r in modes if m != "full"]  # full is the reference itself
    suite = Suite.from_args(args)
    results = fidelity.run(engine, modes, suite, answer_tokens=args.max_new_tokens, budget=args.budget,
                           progress=h.suite_progress(suite))
    rows = fidelity.summarize(results)
    report.add(fidelity.table(rows))
    text, pairs = h.versus_tables(args, results, rows, "kl", KL_TITLE, scale=1, digits=4)
    report.add(text)
    if args.frontier:
        report.add(h.frontier_tables(args, rows, "fidelity"))
    report.json = lambda path: fidelity.write_json(results, rows, path, pairs)
    return report
