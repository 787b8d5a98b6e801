"""`cacheclip bench fidelity`: KL to full attention of each mode's recompute, teacher-forced: on
the needle suite, or on real questions with `--data FILE` (the decision bench: both chunkings,
the ceilings, a resumable journal, `--from` to pool journals)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cacheclip_rag.analysis import engine_from_args, progress_bar, qa_data

from .. import fidelity, fidelity_qa
from .. import harness as h
from ..journal import provenance
from ..suite import Suite

NAME = "fidelity"
HELP = "KL to full attention of each mode's recompute, teacher-forced, no labels (needles, or --data FILE)"
MODES = ["reuse", "random", "epic", "cacheclip-paper", "cacheclip", "oracle"]
FRONTIER_MODES = ["reuse", "epic", "random", "cacheclip", "prophetkv"]
"""The modes of `--frontier`: those with a row set to replay (CacheBlend has none)."""
QA_MODES = ["reuse", "random", "cacheclip", "prophetkv"]
"""The modes of `--data` when none are given."""
KL_TITLE = ("Paired KL differences on the same samples (negative: closer to full; 95% bootstrap interval; "
            "W/L: higher/lower KL):")


def arguments(p) -> None:
    h.suite_bench_flags(p, MODES, "the cacheclip rows")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="answer tokens compared (default 64 on needles, 32 with --data)")
    real = p.add_argument_group("real questions (--data)")
    real.add_argument("--data", default=None, metavar="FILE",
                      help="teacher-force on the questions of this QA file (the formats `bench qa` reads) instead of "
                           f"needles; default modes {' '.join(QA_MODES)}")
    real.add_argument("--format", choices=list(qa_data.FORMATS), default="auto")
    real.add_argument("--prompt", choices=["dataset", "engine"], default="dataset",
                      help="dataset: the instruction of the dataset's own harness; engine: the engine's default prompt")
    real.add_argument("--offset", type=int, default=0, help="first question (0-based index in the file)")
    real.add_argument("--limit", type=int, default=None, help="at most N questions from --offset")
    real.add_argument("--chunkings", nargs="+", choices=list(fidelity_qa.CHUNKINGS), default=list(fidelity_qa.CHUNKINGS),
                      help="passage: each passage one chunk; engine: the engine's chunker (what ingest gives a user)")
    real.add_argument("--ceilings", nargs="*", default=[], metavar="NAME",
                      help=f"analysis-only rankings replayed beside the modes: {' '.join(fidelity_qa.CEILINGS)}, "
                           "dev-L<layer>")
    real.add_argument("--ceiling-ratios", type=float, nargs="+", default=None, help="default: --ratios")
    h.results_flag(real)
    h.from_flag(real, "other questions or chunkings")
    h.out_flags(p, "-frontier-LENGTH")


def measure(args) -> h.Report:
    if args.data or args.from_json:
        return _real(args)
    report = h.Report()
    args.ratios = args.ratios or (h.FRONTIER_RATIOS if args.frontier else [0.2])
    engine = h.engine(args)
    modes = h.mode_list(args.modes or (FRONTIER_MODES if args.frontier else MODES), args.ratios)
    modes = [(m, r) for m, r in modes if m != "full"]  # full is the reference itself
    suite = Suite.from_args(args)
    results = fidelity.run(engine, modes, suite, answer_tokens=args.max_new_tokens or 64, budget=args.budget,
                           progress=h.suite_progress(suite))
    rows = fidelity.summarize(results)
    report.add(fidelity.table(rows))
    text, pairs = h.versus_tables(args, results, rows, "kl", KL_TITLE, scale=1, digits=4)
    report.add(text)
    if args.frontier:
        report.add(h.frontier_tables(args, rows, "fidelity"))
    report.json = lambda path: fidelity.write_json(results, rows, path, pairs)
    return report


def _real(args) -> h.Report:
    """`--data`: every mode and ceiling on the same questions, both chunkings; or `--from`."""
    report = h.Report()
    args.ratios = args.ratios or [0.2]
    modes = [(m, r) for m, r in h.mode_list(args.modes or QA_MODES, args.ratios) if m != "full"]
    fidelity_qa.check_modes(modes, args.ceilings)
    if args.from_json:
        results = fidelity_qa.load(args.from_json)
        report.add(provenance(args.from_json))
        end = args.offset + args.limit if args.limit else float("inf")
        results = [r for r in results if args.offset <= r.index < end and r.chunking in args.chunkings]
        if not results:
            raise ValueError(f"no saved rows of questions {args.offset}..{end - 1} in {args.from_json}")
    else:
        data = qa_data.load(args.data, args.format)
        if not 0 <= args.offset < len(data.examples):
            raise ValueError(f"--offset must be in [0, {len(data.examples)}) for the {len(data.examples)} questions of "
                             f"{args.data}, got {args.offset}")
        end = args.offset + args.limit if args.limit else len(data.examples)
        items = list(enumerate(data.examples))[args.offset:end]
        prompt = data.prompt if args.prompt == "dataset" else None
        engine = engine_from_args(args, prompt=prompt)
        answer_tokens = args.max_new_tokens or 32
        journal = h.journal(args, engine, data=Path(args.data).name, format=data.format, questions=len(data.examples),
                            prompt=dataclasses.asdict(engine.config.prompt),
                            chunk=dataclasses.asdict(engine.config.chunk), answer_tokens=answer_tokens,
                            budget=args.budget, bench="fidelity")
        print(f"{len(items)} questions of {args.data} ({data.format}; index {items[0][0]}..{items[-1][0]}), "
              f"chunkings {args.chunkings}, modes {modes}, ceilings {args.ceilings or 'none'}")
        step = progress_bar(len(items) * len(args.chunkings), "questions", "question")
        results = fidelity_qa.run(engine, items, modes, args.chunkings, args.ceilings,
                                  args.ceiling_ratios or [r for r in args.ratios if isinstance(r, float)],
                                  answer_tokens=answer_tokens, budget=args.budget, journal=journal, progress=step)
    rows = fidelity_qa.summarize(results)
    report.add("KL(full || mode) over full attention's own answer, teacher-forced; share: of reuse's KL on the same "
               "questions (95% bootstrap over questions); whole: answers reproduced whole")
    report.add(fidelity_qa.table(rows))
    labels = args.versus or [r["label"] for r in rows if r["mode"] == "cacheclip"]
    pairs = fidelity_qa.versus(results, labels)
    if pairs:
        report.add("\nPaired differences in shares of reuse's KL on the same questions (negative: closer to full):")
        report.add(fidelity_qa.versus_table(pairs))
    if args.frontier:
        report.add(fidelity_qa.frontier_tables(rows, args.budget_ttft, getattr(args, "plot", None)))
    report.json = lambda path: fidelity_qa.write_json(results, rows, pairs, path)
    return report
