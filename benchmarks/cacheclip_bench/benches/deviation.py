"""`cacheclip bench deviation`: reused vs full K/V per layer, how concentrated the deviation is,
and the fidelity of rows chosen by deviation against rows chosen by attention."""

from __future__ import annotations

from cacheclip_rag.analysis import selector_registry as registry

from .. import deviation, fidelity
from .. import harness as h
from ..suite import Suite
from .fidelity import KL_TITLE

NAME = "deviation"
HELP = "reused vs full K/V per layer, and rows selected by that deviation"


def arguments(p) -> None:
    h.engine_flags(p)
    h.suite_flags(p)
    h.mode_flags(p, "none besides the oracle")
    h.versus_flag(p, "the oracle rows")
    p.add_argument("--max-new-tokens", type=int, default=64, help="answer tokens compared")
    p.add_argument("--packets", action="store_true",
                   help="measure the KV Packet caches (against a full prefill of the wrapped sequence)")
    h.out_flags(p)


def measure(args) -> h.Report:
    report = h.Report()
    args.ratios = args.ratios or [0.2]
    modes = [m for m in dict.fromkeys(args.modes or []) if m not in ("full", "oracle")]  # oracle: always replayed
    if unknown := [m for m in modes if m not in registry.modes()]:
        raise ValueError(f"bench deviation replays serving modes {list(registry.modes())}; got {unknown!r}")
    engine = h.engine(args)
    suite = Suite.from_args(args)
    deviations, results = deviation.run(engine, args.ratios, suite, answer_tokens=args.max_new_tokens,
                                        budget=args.budget, progress=h.suite_progress(suite), packets=args.packets,
                                        modes=modes)
    if not deviations:
        raise ValueError("full attention answered none of the samples; nothing to compare")
    what = "the KV Packet cache from a full prefill of the wrapped sequence" if args.packets else \
        "the reused cache from full prefill"
    report.add(f"Relative deviation of {what}, |full - reused| / |full|, mean over rows:")
    report.add(deviation.layer_table(deviations))
    report.add(deviation.concentration(deviations))
    report.add("\nShare of the deviation held by the rows each criterion picks:")
    report.add(deviation.held_table(deviations))
    report.add("\nFidelity to full attention of the rows each criterion picks:")
    rows = fidelity.summarize(results)
    report.add(fidelity.table(rows))
    text, pairs = h.versus_tables(args, results, rows, "kl", KL_TITLE, scale=1, digits=4,
                                  default_mode="packet+cacheclip" if args.packets else "oracle")
    report.add(text)
    report.json = lambda path: deviation.write_json(deviations, results, rows, path, pairs)
    return report
