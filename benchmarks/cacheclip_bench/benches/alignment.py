"""`cacheclip bench alignment`: aux against primary attention over the same chunks, in character
space."""

from __future__ import annotations

from cacheclip_rag.analysis import load_model

from .. import alignment
from .. import harness as h

NAME = "alignment"
HELP = "aux against primary attention over the same chunks"


def arguments(p) -> None:
    h.engine_flags(p)
    h.suite_flags(p)
    h.out_flags(p)


def measure(args) -> h.Report:
    rows = alignment.run(load_model(args.primary), load_model(args.aux), args.lengths, samples=args.samples,
                         seed=args.seed + 10_000)
    return h.Report([alignment.table(rows)], json=lambda path: alignment.write_json(rows, path))
