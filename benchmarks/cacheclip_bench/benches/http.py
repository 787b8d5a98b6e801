"""`cacheclip bench http`: TTFT through `cacheclip serve` against the engine's own, same requests."""

from __future__ import annotations

from .. import harness as h
from .. import http

NAME = "http"
HELP = "TTFT through `cacheclip serve` against the engine's own, same requests"


def arguments(p) -> None:
    h.timed_flags(p, "cacheclip")
    p.add_argument("--max-new-tokens", type=int, default=16)
    h.out_flags(p)


def measure(args) -> h.Report:
    engine = h.engine(args)
    rows = http.run(engine, args.lengths, h.mode_list(args.modes or ["cacheclip"], args.ratios or [0.2]),
                    runs=args.runs, max_new_tokens=min(args.max_new_tokens, 16))
    return h.Report([http.table(rows)], json=lambda path: http.write_json(rows, path))
