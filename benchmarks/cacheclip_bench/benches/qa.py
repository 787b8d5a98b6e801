"""`cacheclip bench qa` (and `cacheclip eval`): QA over given passages, every mode on the same
questions, written as measured (--results resumes); the table, paired differences of F1 and of
agreement with full attention, and the frontier; `--diagnose`: where each answer is lost."""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path

from cacheclip_rag import EngineConfig
from cacheclip_rag.analysis import (
    add_common,
    cache_dir,
    engine_from_args,
    progress_bar,
    qa_data,
)

from .. import frontier, needle, qa, qa_diagnose
from .. import harness as h
from ..journal import provenance

NAME = "qa"
HELP = ("QA over given passages (CacheBlend's musique_s.json, LongBench's jsonl, or this project's jsonl): every "
        "mode on the same questions, paired, resumable")
MODES = ["full", "reuse", "cacheblend", "cacheclip", "prophetkv"]
"""The modes when none are given (with --frontier, at every ratio of FRONTIER_RATIOS)."""
BUDGETS = [0.25, 0.3]
EVAL_DATA = str(resources.files("cacheclip_rag") / "data" / "qa_invented.jsonl")
"""`cacheclip eval`'s default questions: the invented ones the library ships."""


def arguments(p, data: str | None = None) -> None:
    add_common(p, store_default=str(cache_dir() / "qa-store"))
    p.add_argument("--data", "--dataset", dest="data", default=data,
                   help="the QA file: CacheBlend's inputs/musique_s.json (github.com/YaoJiayi/CacheBlend), a LongBench "
                        "2wikimqa / hotpotqa / musique .jsonl, or {question, contexts, answers} lines")
    p.add_argument("--format", choices=list(qa_data.FORMATS), default="auto")
    p.add_argument("--prompt", choices=["dataset", "engine"], default="dataset",
                   help="dataset: the instruction of the dataset's own harness; engine: the engine's default prompt")
    p.add_argument("--score-layers", type=int, nargs="+", default=None, help="aux scoring layers (default: profile or last)")
    h.mode_flags(p, " ".join(MODES), "default 0.2, with --frontier 0.1 0.2 0.3 0.4")
    p.add_argument("--frontier", action="store_true", help="every mode over the ratios; each mode's F1 at the TTFT "
                   "budgets and the Pareto frontier")
    p.add_argument("--budget-ttft", type=float, nargs="+", default=BUDGETS, help="TTFT / full budgets of the frontier")
    h.versus_flag(p, "the cacheclip rows")
    p.add_argument("--offset", type=int, default=0, help="first question (0-based index in the file)")
    p.add_argument("--limit", type=int, default=None, help="at most N questions from --offset")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--question-first", nargs="?", const="Question: {question}\n\n", default="", metavar="TEMPLATE",
                   help="the question before the passages as well (PromptConfig.question_first; default template "
                        "'Question: {question}' and a blank line)")
    p.add_argument("--diagnose", action="store_true", help="where the answer is lost: each mode's KL from full "
                   "attention on full's own answer, the primary's attention its rows hold, the gold passages' recompute")
    p.add_argument("--indices", type=int, nargs="+", default=None, help="with --diagnose: these questions (0-based)")
    h.results_flag(p)
    h.from_flag(p, "other questions")
    h.out_flags(p, "the frontier at the first budget")


def eval_arguments(p) -> None:
    arguments(p, data=EVAL_DATA)


def measure(args) -> h.Report:
    if args.from_json:
        return _tables(args, _pooled(args))
    if args.data is None:
        raise ValueError("bench qa needs --data FILE (the questions to run) or --from JOURNAL ... (runs to pool)")
    data = qa_data.load(args.data, args.format)
    if args.offset < 0 or args.offset >= len(data.examples):
        raise ValueError(f"--offset must be in [0, {len(data.examples)}) for the {len(data.examples)} questions of "
                         f"{args.data}, got {args.offset}")
    end = args.offset + args.limit if args.limit else None
    examples = data.examples[args.offset:end]
    args.ratios = args.ratios or (h.FRONTIER_RATIOS if args.frontier else [0.2])
    prompt = data.prompt if args.prompt == "dataset" else None
    if args.question_first:
        prompt = dataclasses.replace(prompt or EngineConfig().prompt, question_first=args.question_first)
    if args.indices and not args.diagnose:
        raise ValueError("--indices chooses the questions of --diagnose; a QA run takes --offset / --limit")
    if args.diagnose and (args.results or args.frontier):
        raise ValueError("--diagnose writes its rows with --json; it takes no --results journal and no --frontier")
    if args.diagnose:
        chosen = args.indices or list(range(args.offset, args.offset + len(examples)))
        bad = [i for i in chosen if not 0 <= i < len(data.examples)]
        if bad:
            raise ValueError(f"--indices must be in [0, {len(data.examples)}) for {args.data}, got {bad}")
        return _diagnose(args, [(i, data.examples[i]) for i in chosen], engine_from_args(args, prompt=prompt))
    modes = h.mode_list(args.modes or MODES, args.ratios)
    engine = engine_from_args(args, prompt=prompt)
    print(f"{len(examples)} questions of {args.data} ({data.format}; index {args.offset}..{args.offset + len(examples) - 1}), "
          f"prompt: {args.prompt}'s")
    journal = h.journal(args, engine, data=Path(args.data).name, format=data.format, questions=len(data.examples),
                        prompt=dataclasses.asdict(engine.config.prompt))
    results = qa.run(engine, examples, modes, max_new_tokens=args.max_new_tokens, offset=args.offset,
                     journal=journal, progress=progress_bar(len(examples), "questions", "question"))
    return _tables(args, results)


def _pooled(args) -> list:
    """`bench qa --from`: the saved rows of the questions --offset / --limit choose."""
    if args.diagnose:
        raise ValueError("--diagnose measures; it does not pool saved runs (--from)")
    end = args.offset + args.limit if args.limit else float("inf")
    results = [r for r in qa.load(args.from_json) if args.offset <= r.index < end]
    if not results:
        raise ValueError(f"no saved rows of questions {args.offset}..{end - 1} in {args.from_json}")
    print(provenance(args.from_json))
    return results


def _tables(args, results) -> h.Report:
    """The tables of measured or pooled rows: the modes, paired differences, the frontier."""
    report = h.Report()
    rows = qa.summarize(results)
    report.add(qa.table(rows))
    labels = args.versus or [r["label"] for r in rows if r["mode"] == "cacheclip"]
    pairs = [p for label in labels for metric in ("f1", "agreement") for p in qa.versus(results, rows, label, metric)]
    for metric, what in (("f1", "gold F1"), ("agreement", "agreement with full attention's answer")):
        chosen = [p for p in pairs if p["metric"] == metric]
        if chosen:
            report.add(f"\nPaired differences of {what} on the same questions (x100; 95% bootstrap interval; W/L):")
            report.add(needle.versus_table(chosen))
    if args.frontier:
        report.add(h.mixed_machines_note(args))
        pts = frontier.points(rows)
        metric = frontier.Metric("% of full attention's F1")
        for budget in args.budget_ttft:
            report.add("\n" + frontier.table(pts, budget, None, metric))
        report.add("\n" + frontier.reach_table(pts))
        title = f"QA: {Path(args.data).name}" if args.data and not args.from_json else "QA: pooled runs"
        report.plot = lambda path: frontier.plot(pts, path, args.budget_ttft[0], title, metric)
    report.json = lambda path: qa.write_json(results, rows, path, pairs)
    return report


def _diagnose(args, items, engine) -> h.Report:
    """`--diagnose`: KL from full attention, the oracle's attention held, the gold passages'
    recompute, per mode and per question."""
    names = [m for m in args.modes or ("reuse", "cacheclip", "prophetkv", qa_diagnose.ORACLE) if m != "full"]
    served = [m for m in names if m != qa_diagnose.ORACLE]
    modes = h.mode_list(served, args.ratios) if served else []
    modes += [(qa_diagnose.ORACLE, r) for r in args.ratios if qa_diagnose.ORACLE in names]
    print(f"diagnosis of {len(items)} questions (index {[i for i, _ in items]}), modes {modes}")
    results = qa_diagnose.run(engine, items, modes, answer_tokens=args.max_new_tokens,
                              progress=progress_bar(len(items), "questions", "question"))
    rows = qa_diagnose.summarize(results)
    return h.Report([qa_diagnose.table(rows), "\n" + qa_diagnose.question_table(results)],
                    json=lambda path: qa_diagnose.write_json(results, rows, path))
