"""`cacheclip bench stages`: each stage of a request as a share of full's TTFT, beside the share
its arithmetic alone would cost (`cost_model`)."""

from __future__ import annotations

from cacheclip_rag.analysis import attention_path, machine, progress_bar

from .. import harness as h
from .. import stages

NAME = "stages"
HELP = "a request's cost taken apart by stage (selection, loading, re-rotation, recompute by range) vs arithmetic"


def arguments(p) -> None:
    h.timed_flags(p, "reuse cacheclip prophetkv")
    p.set_defaults(runs=3)
    h.out_flags(p)


def measure(args) -> h.Report:
    engine = h.engine(args)
    modes = h.mode_list(args.modes or ["reuse", "cacheclip", "prophetkv"], args.ratios or [0.2])
    step = progress_bar(stages.requests(args.lengths, modes, args.runs), "stages", "request")
    rows = stages.run(engine, args.lengths, modes, runs=args.runs, budget=args.budget, progress=step)
    report = h.Report()
    report.add(f"recompute attends with "
               f"{attention_path(engine.config.attention_backend, engine.primary.lm.device, engine.primary.lm.dtype)}")
    report.add(stages.table(rows))
    report.json = lambda path: stages.write_json(rows, path, machine())
    return report
