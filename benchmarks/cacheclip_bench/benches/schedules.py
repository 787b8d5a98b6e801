"""`cacheclip bench schedules`: one cacheclip request under three schedules of its stages, cold,
alternated (the aux selection overlapped with cache loading, first, or everything serial)."""

from __future__ import annotations

from cacheclip_rag.analysis import describe_cpu, progress_bar

from .. import harness as h
from .. import schedules

NAME = "schedules"
HELP = "one cacheclip request with the aux selection overlapped, first, or everything serial"


def arguments(p) -> None:
    h.one_request_flags(p)
    p.add_argument("--runs", type=int, default=3, help="cold runs per schedule")
    h.out_flags(p)


def measure(args) -> h.Report:
    engine = h.engine(args)
    step = progress_bar(args.runs * len(schedules.SCHEDULES), "schedules", "request")
    rows = schedules.run(engine, args.length, runs=args.runs, ratio=args.ratio, progress=step)
    return h.Report([f"{args.length} tokens, cacheclip@{args.ratio}, {args.runs} cold runs per schedule, medians (s)",
                     schedules.table(rows)],
                    json=lambda path: schedules.write_json(rows, path, describe_cpu()))
