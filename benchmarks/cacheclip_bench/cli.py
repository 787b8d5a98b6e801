"""`cacheclip bench` and `cacheclip eval`, added to the library's command line through its
`cacheclip.commands` entry point (the library never imports the harness).

Importing the harness registers its analysis-only modes (`oracle`, the bench variants), so that
`cacheclip ask --mode oracle` works where the harness is installed.
"""

from __future__ import annotations

from functools import partial

from . import harness, oracle, variants  # noqa: F401  (oracle, variants: register the analysis-only modes)
from .benches import BENCHES, qa


def add_commands(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks; each prints its table and writes JSON (`cacheclip bench BENCH -h`)")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for module in BENCHES:
        p = benches.add_parser(module.NAME, help=module.HELP)
        module.arguments(p)
        p.set_defaults(func=partial(harness.run, module))
    p = sub.add_parser("eval", help="QA from a file: `cacheclip bench qa`, on the shipped invented questions by default")
    qa.eval_arguments(p)
    p.set_defaults(func=partial(harness.run, qa))
