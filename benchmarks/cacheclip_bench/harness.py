"""The bench interface, and what every bench shares: its flags, its modes, its journal, its tables.

A bench is one module under `benches/` with four names:

    NAME: str                       the subcommand (`cacheclip bench NAME`)
    HELP: str                       its one-line help
    arguments(p: ArgumentParser)    its flags (the shared ones come from the helpers below)
    measure(args) -> Report         its run: what it measured, as tables and a JSON writer

and `run(bench, args)` does the rest the same way for all of them: the CPU header, the tables in
order, `--json` and `--plot` written once. A bench never prints its own tables or writes its own
JSON; it may print progress while it measures.
"""

from __future__ import annotations

from argparse import ArgumentParser, Namespace
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from cacheclip_rag import ChunkConfig, ModelConfig
from cacheclip_rag.analysis import (
    AUTO,
    add_common,
    cache_dir,
    describe_cpu,
    engine_from_args,
    machine,
    progress_bar,
    ratio_arg,
)
from cacheclip_rag.analysis import (
    selector_registry as registry,
)

from .journal import Journal, pooled_machines
from .needle import BENCH_MODES, versus, versus_table
from .suite import Suite


@dataclass
class Report:
    """What a bench measured, ready to show. tables: printed in order (each may span lines);
    json(path) / plot(path): what --json / --plot write (None: the bench writes none); code: the
    exit status."""

    tables: list[str] = field(default_factory=list)
    json: Callable[[str], None] | None = None
    plot: Callable[[str], None] | None = None
    code: int = 0

    def add(self, text: str) -> None:
        if text:
            self.tables.append(text)


def run(bench: ModuleType, args: Namespace) -> int:
    """One bench from the command line: header, measure, tables, JSON and plots."""
    if getattr(bench, "HEADER", True):
        print(f"{describe_cpu()}; compute dtype {args.dtype}")
    report: Report = bench.measure(args)
    for text in report.tables:
        print(text)
    if getattr(args, "json", None) and report.json:
        report.json(args.json)
    if getattr(args, "plot", None) and report.plot:
        report.plot(args.plot)
    return report.code


# -- what the benches share ------------------------------------------------------------------------

FRONTIER_RATIOS = [0.1, 0.2, 0.3, 0.4]


def engine(args: Namespace):
    """The engine of a bench's engine flags (chunks of --chunk-tokens, no overlap)."""
    return engine_from_args(args, ChunkConfig(chunk_tokens=args.chunk_tokens, overlap_tokens=0))


def mode_list(modes: list[str], ratios: list) -> list[tuple[str, float | str]]:
    """(mode, ratio) pairs: a fixed-ratio mode once, every other mode at every ratio ("auto" only
    for the modes that size their own budget; a list of only "auto" for others is an error); a
    mode written "name@ratio" runs at that ratio alone."""
    out = []
    for mode in modes:
        if "@" in mode:
            name, _, ratio = mode.partition("@")
            out += [m for m in mode_list([name], [ratio_arg(ratio)]) if m not in out]
            continue
        if mode not in (*registry.modes(), *BENCH_MODES):
            raise ValueError(f"mode must be one of {[*registry.modes(), *BENCH_MODES]}, got {mode!r}")
        fixed = registry.get(mode).fixed_ratio if mode not in BENCH_MODES else None
        adaptive = mode in BENCH_MODES or registry.get(mode).adaptive
        if fixed is not None:
            out.append((mode, fixed))
        elif not adaptive and all(r == AUTO for r in ratios):
            raise ValueError(f"mode {mode!r} takes numeric ratios, not only 'auto'")
        else:
            out.extend((mode, r) for r in ratios if adaptive or r != AUTO)
    return out


def suite_progress(suite: Suite):
    """The progress bar over the needle-suite samples a bench runs (minutes each at 4K on a CPU)."""
    return progress_bar(len(suite), "samples", "sample")


def journal(args: Namespace, engine, **settings) -> Journal | None:
    """The --results journal of a bench, its header the settings its rows depend on, the codecs
    the engine's caches are kept in among them (None without --results)."""
    if not args.results:
        return None
    header = {"primary": args.primary, "aux": args.aux, "dtype": str(ModelConfig(dtype=args.dtype).torch_dtype()),
              "kv_dtype": args.kv_dtype, "kv_codec": engine.primary.codec, "aux_kv_codec": engine.aux.codec,
              "max_new_tokens": args.max_new_tokens, "score_layers": args.score_layers, **settings}
    out = Journal(args.results, header, machine=machine())
    print(f"resuming {args.results} ({len(out.rows)} rows)" if out.rows else f"rows go to {args.results}")
    return out


def versus_tables(args: Namespace, results: list, rows: list[dict], metric: str, title: str, scale: float = 100,
                  digits: int = 1, default_mode: str = "cacheclip") -> tuple[str, list[dict]]:
    """The text after a bench table: the oracle's footnote, then the paired comparison of the
    --versus rows (default: the rows of `default_mode`) with every other on `metric`; and the pairs."""
    lines = []
    if any(r["mode"] == "oracle" for r in rows):
        lines.append("* oracle: analysis only; it selects with the primary's own attention from a full prefill")
    labels = args.versus or list(dict.fromkeys(r["label"] for r in rows if r["mode"] == default_mode))
    pairs = [p for label in labels for p in versus(results, rows, label, metric=metric)]
    if pairs:
        lines += [f"\n{title}", versus_table(pairs, scale=scale, digits=digits)]
    return "\n".join(lines), pairs


def mixed_machines_note(args: Namespace) -> str:
    """A frontier pooled from rows of several machines places them at TTFT ratios of mixed CPUs:
    say so, and what gives one machine's ("" when the rows are one machine's)."""
    if getattr(args, "from_json", None) and len(pooled_machines(args.from_json)) > 1:
        return ("\nnote: the pooled rows were measured on more than one machine (above), so the frontier's "
                "TTFT / full averages CPUs; --ttft-from a `bench ttft --json` run places them at one machine's")
    return ""


def frontier_tables(args: Namespace, rows: list[dict], bench: str) -> str:
    """Per length: each mode's score at the TTFT budget and the Pareto frontier (and a plot).
    bench: "niah" (% of full attention's score) or "fidelity" (KL to full attention)."""
    from . import fidelity, frontier

    to_points, metric, title = {"niah": (frontier.points, frontier.NEEDLE, "Needle suite"),
                                "fidelity": (fidelity.points, frontier.KL, "Fidelity")}[bench]
    out = []
    if getattr(args, "ttft_from", None):
        rows = frontier.retime(rows, frontier.load_ttft(args.ttft_from), args.ttft_from)
        out.append(f"\nthe frontier at the TTFT / full of {args.ttft_from} ({frontier.ttft_machine(args.ttft_from)})")
    else:
        out.append(mixed_machines_note(args))
    for length in sorted({r["length"] for r in rows}):
        pts = to_points([r for r in rows if r["length"] == length])
        out.append("\n" + frontier.table(pts, args.budget_ttft, length, metric))
        if metric.higher_is_better:
            out.append("\n" + frontier.reach_table(pts))
        if args.plot:
            stem = Path(args.plot)
            frontier.plot(pts, str(stem.with_name(f"{stem.stem}-frontier-{length}.png")), args.budget_ttft,
                          f"{title}, {length} tokens", metric)
    return "\n".join(t for t in out if t)


# -- the shared flags ------------------------------------------------------------------------------

def engine_flags(p: ArgumentParser) -> None:
    add_common(p, store_default=str(cache_dir() / "bench-store"))
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--score-layers", type=int, nargs="+", default=None, help="aux scoring layers (default: profile or last)")


def mode_flags(p: ArgumentParser, default: str, ratios: str = "default 0.2") -> None:
    p.add_argument("--modes", nargs="+", default=None,
                   help=f"modes to compare (registered: {list(registry.modes())}; and cacheclip-paper: last aux "
                        f"layer, paper rule; cacheclip-joint / cacheclip-chunk: the aux query reads all chunks at "
                        f"once / each alone); default {default}")
    p.add_argument("--ratios", type=ratio_arg, nargs="+", default=None,
                   help=f"recompute ratios of the ratio modes (auto: the selector decides per request); {ratios}")
    p.add_argument("--budget", choices=["paper", "keep"], default="keep",
                   help="selection budget rule of cacheclip and oracle (keep: compare at equal effective fractions)")


def suite_bench_flags(p: ArgumentParser, modes: list[str], versus: str) -> None:
    """What a bench over the needle suite with a frontier takes (niah, fidelity): the engine, the
    suite, the modes (default `modes`), the frontier and --versus."""
    engine_flags(p)
    suite_flags(p)
    mode_flags(p, " ".join(modes), "default 0.2, with --frontier 0.1 0.2 0.3 0.4")
    frontier_flags(p)
    versus_flag(p, versus)


def timed_flags(p: ArgumentParser, modes: str) -> None:
    """What a bench that times requests of every mode takes (ttft, http): the engine, --lengths,
    the modes (default `modes`) and --runs."""
    engine_flags(p)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048], help="context lengths in primary tokens")
    mode_flags(p, modes)
    p.add_argument("--runs", type=int, default=5, help="runs per mode")


def one_request_flags(p: ArgumentParser) -> None:
    """What a bench that takes one cacheclip request apart takes (schedules, recompute-profile)."""
    engine_flags(p)
    p.add_argument("--length", type=int, default=4096, help="request length in primary tokens")
    p.add_argument("--ratio", type=float, default=0.2)


def suite_flags(p: ArgumentParser, lengths: list[int] = (2048,)) -> None:
    p.add_argument("--lengths", type=int, nargs="+", default=list(lengths), help="context lengths in primary tokens")
    p.add_argument("--variants", nargs="+", default=None, help="needle variants (default: all eight)")
    p.add_argument("--samples", type=int, default=5, help="samples per variant and length")
    p.add_argument("--seed", type=int, default=0)


def versus_flag(p: ArgumentParser, default: str) -> None:
    p.add_argument("--versus", nargs="+", default=None, metavar="LABEL",
                   help=f"compare these rows (e.g. cacheclip@0.2) with every other, sample by sample (default: {default})")


def frontier_flags(p: ArgumentParser) -> None:
    p.add_argument("--frontier", action="store_true",
                   help="every mode over the ratios, placed at its measured TTFT / full; prints each mode's score at "
                        "--budget-ttft and the Pareto frontier (plot with --plot)")
    p.add_argument("--budget-ttft", type=float, default=0.25, help="the TTFT / full budget the frontier is read at")


def from_flag(p: ArgumentParser, disjoint: str) -> None:
    p.add_argument("--from", dest="from_json", nargs="+", default=None, metavar="JSON",
                   help=f"pool these saved runs or journals ({disjoint}, or other modes on the same samples) instead "
                        "of running; TAG=JSON puts a run under a tag (tuned=run.json: rows tuned/full, ...)")


def results_flag(p: ArgumentParser) -> None:
    p.add_argument("--results", default=None, metavar="JSONL",
                   help="write each row here as it is measured; the same command with the same file resumes there "
                        "(a file of other settings is refused)")


def out_flags(p: ArgumentParser, plot: str | None = None) -> None:
    p.add_argument("--json", default=None, help="write results as JSON here")
    if plot:
        p.add_argument("--plot", default=None, help=f"write PNGs next to this path ({plot})")
