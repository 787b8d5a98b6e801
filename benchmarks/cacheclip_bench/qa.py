"""`cacheclip bench qa --data FILE` (and `cacheclip eval`): QA over given passages, every mode on
the same questions, paired.

Each question's passages become its chunks (ingested unsplit, in order; the retriever is
bypassed, as in the papers), under the prompt of the dataset's own harness (`qa_data`). Every
(mode, ratio) answers on the same chunk ids; full attention first, as the reference. A mode's
answer is the first non-empty line it generates (as CacheBlend's harness parses it), scored
against the best-matching gold answer (token F1, exact match, whether a gold answer occurs in
it) and against full attention's own answer (`agreement`: the same token F1 with full's answer
as the reference, which measures what reuse loses even where the model is wrong).

Rows are written to a `Journal` as they are measured: the same command with the same
`--results` file resumes where a stopped run ended and prints the table an uninterrupted run
would (TTFT / full of a resumed question compares times of one session, as each question's
modes run together).

Where the answer is: each row also records which passages hold a gold answer and the share of
each passage's tokens the mode recomputed; the table's gold% / rest% are the mean recomputed
share of the passages that hold the answer and of the others.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from cacheclip_rag import CacheClipEngine
from cacheclip_rag.analysis import QAExample

from .journal import Journal, pool, read_rows
from .metrics import best_of, exact_match, normalize, rouge_l, token_f1
from .needle import label, ratio_order, request_for, uses_packets, with_full
from .stats import bootstrap_interval, nanmean

KEY = ("index", "mode", "ratio")
"""What identifies a measured row: the question's index in the file, the mode and its ratio."""


@dataclass
class QAResult:
    index: int
    """The question's position in the dataset file (0-based), stable across --offset / --limit."""
    id: str
    mode: str
    ratio: float | str
    prediction: str
    answer: str
    """The prediction's first non-empty line: what is scored."""
    f1: float
    em: float
    rouge_l: float
    contains: float
    agreement: float
    """Token F1 of this answer against full attention's answer to the same question (1 for full)."""
    ttft: float
    ttft_vs_full: float
    effective_fraction: float
    prompt_tokens: int
    gold_passages: list[int] = field(default_factory=list)
    """Passages (0-based, in order) whose text holds a gold answer: where the answer is."""
    recomputed_by_passage: list[float] = field(default_factory=list)
    """Per passage, the share of its tokens this mode recomputed (1 for full, 0 for reuse)."""


def answer_of(prediction: str) -> str:
    """The first non-empty line of a generation."""
    return next((line.strip() for line in prediction.splitlines() if line.strip()), "")


def run(
    engine: CacheClipEngine,
    examples: list[QAExample],
    modes: list[tuple[str, float | str]],
    max_new_tokens: int = 32,
    offset: int = 0,
    journal: Journal | None = None,
    progress=None,
) -> list[QAResult]:
    """Every mode on examples[i] (file index offset + i); rows already in `journal` are kept, not
    measured again, and each new row is appended to it as soon as it is measured."""
    modes = with_full(modes)
    done = journal.keys(KEY) if journal else set()
    results = [QAResult(**row) for row in journal.rows] if journal else []
    packets = uses_packets(modes)
    for index, ex in enumerate(examples, offset):
        todo = [(m, r) for m, r in modes if (index, m, r) not in done]
        if todo:
            full = next((r for r in results if r.index == index and r.mode == "full"), None)
            ids = engine.ingest([dict(c) for c in ex.contexts], progress=False, split=False, packets=packets)
            spans = passage_spans(engine, ex, ids)
            for mode, ratio in todo:  # full first: with_full puts it there and todo keeps the order
                result = _answer(engine, index, ex, mode, ratio, ids, max_new_tokens, full, spans)
                full = result if mode == "full" else full
                results.append(result)
                if journal:
                    journal.append(asdict(result))
        if progress:
            progress(f"question {index}")
    wanted = range(offset, offset + len(examples))
    return [r for r in results if r.index in wanted and (r.mode, r.ratio) in modes]


def load(paths: list[str | Path]) -> list[QAResult]:
    """Pool the rows of saved QA runs (--results journals or `write_json` files): runs on other
    questions, or other modes on the same ones; "TAG=PATH" puts a run's modes under a tag beside
    the untagged run (another profile or model: "qa/cacheclip@0.2"), whose `full` stays the
    reference of % of full (a tagged row's agreement is against its own run's full answer)."""
    def read(path: str) -> list[QAResult]:
        rows = read_rows(path)
        rows = rows if rows is not None else json.loads(Path(path).read_text(encoding="utf-8"))["examples"]
        return [QAResult(**row) for row in rows]

    return pool(paths, read, lambda r, tag: replace(r, mode=f"{tag}/{r.mode}"), lambda r: (r.index, r.mode, r.ratio),
                lambda r: (r.answer, r.f1), "a QA bench journal or JSON (expected a journal's rows, or 'examples')")


def passage_spans(engine: CacheClipEngine, ex: QAExample, ids: list[str]) -> list[tuple[int, int, bool]]:
    """Per passage in the request's layout: (first row, end row, whether its text holds a gold
    answer). A passage is one chunk (ingested unsplit), so the chunk segments are the passages."""
    return spans_of(engine.prepare(ex.question, ids, mode="full").layout, ex.answers)


def spans_of(layout, answers: list[str]) -> list[tuple[int, int, bool]]:
    """`passage_spans` of a request's layout, given the gold answers."""
    golds = [normalize(a) for a in answers]
    return [(seg.start, seg.end, any(g and g in normalize(seg.text) for g in golds)) for seg in layout.chunk_segments()]


def _answer(engine, index: int, ex: QAExample, mode: str, ratio, ids: list[str], max_new_tokens: int,
            full: QAResult | None, spans: list[tuple[int, int, bool]]) -> QAResult:
    ans = engine.answer(ex.question, chunk_ids=ids, recompute_ratio=ratio, max_new_tokens=max_new_tokens,
                        **request_for(mode, "keep"))
    answer = answer_of(ans.text)
    ttft = ans.timings["ttft"]
    recomputed = set(ans.recomputed)
    return QAResult(
        index=index, id=ex.id, mode=mode, ratio=ratio, prediction=ans.text, answer=answer,
        f1=best_of(token_f1, answer, ex.answers), em=best_of(exact_match, answer, ex.answers),
        rouge_l=best_of(rouge_l, answer, ex.answers),
        contains=float(any(normalize(a) in normalize(answer) for a in ex.answers)),
        agreement=1.0 if full is None else token_f1(answer, full.answer),
        ttft=ttft, ttft_vs_full=1.0 if full is None else ttft / full.ttft,
        effective_fraction=ans.effective_fraction, prompt_tokens=ans.prompt_tokens,
        gold_passages=[i for i, (_, _, gold) in enumerate(spans) if gold],
        recomputed_by_passage=[len(recomputed.intersection(range(a, b))) / (b - a) for a, b, _ in spans],
    )


def _interval(values: list[float]) -> tuple[float, float]:
    return bootstrap_interval({"questions": values})


def summarize(results: list[QAResult]) -> list[dict]:
    """One row per (mode, ratio) over the questions full attention answered: means with 95%
    bootstrap intervals over questions, % of full's F1 on the same questions, medians of TTFT."""
    full = {r.index: r for r in results if r.mode == "full"}
    keys = sorted({(r.mode, r.ratio) for r in results}, key=lambda k: (k[0] != "full", k[0], ratio_order(k[1])))
    rows = []
    for mode, ratio in keys:
        sel = [r for r in results if (r.mode, r.ratio) == (mode, ratio) and r.index in full]
        if not sel:
            continue
        full_f1 = statistics.mean(full[r.index].f1 for r in sel)
        f1s, agree = [r.f1 for r in sel], [r.agreement for r in sel]
        rows.append(dict(
            mode=mode, ratio=ratio, label=label(mode, ratio), n=len(sel),
            f1=statistics.mean(f1s), f1_ci95=_interval(f1s), em=statistics.mean(r.em for r in sel),
            rouge_l=statistics.mean(r.rouge_l for r in sel), contains=statistics.mean(r.contains for r in sel),
            agreement=statistics.mean(agree), agreement_ci95=_interval(agree),
            pct_of_full=100 * statistics.mean(f1s) / full_f1 if full_f1 else float("nan"),
            effective_fraction=statistics.mean(r.effective_fraction for r in sel),
            ttft=statistics.median(r.ttft for r in sel), ttft_vs_full=statistics.median(r.ttft_vs_full for r in sel),
            prompt_tokens=statistics.median(r.prompt_tokens for r in sel),
            gold_share=nanmean([_share(r, True) for r in sel]), other_share=nanmean([_share(r, False) for r in sel]),
        ))
        rows[-1].update(avg=rows[-1]["f1"], avg_ci95=rows[-1]["f1_ci95"])  # the frontier's names
    return rows


def _share(r: QAResult, gold: bool) -> float:
    """Mean recomputed share of the passages that hold a gold answer (gold) or of the others."""
    shares = [x for i, x in enumerate(r.recomputed_by_passage) if (i in r.gold_passages) == gold]
    return statistics.mean(shares) if shares else float("nan")


def versus(results: list[QAResult], rows: list[dict], label_: str, metric: str = "f1") -> list[dict]:
    """`label_`'s row against every other, question by question: the mean difference of `metric`,
    its 95% bootstrap interval, wins and losses. ValueError when no row has that label."""
    mine = next((r for r in rows if r["label"] == label_), None)
    if mine is None:
        raise ValueError(f"no bench row is labelled {label_!r}; rows: {[r['label'] for r in rows]}")

    def by_question(row: dict) -> dict[int, float]:
        return {r.index: getattr(r, metric) for r in results if (r.mode, r.ratio) == (row["mode"], row["ratio"])}

    own, out = by_question(mine), []
    for other in rows:
        if other is mine:
            continue
        theirs = by_question(other)
        diffs = [own[i] - theirs[i] for i in sorted(own) if i in theirs]
        if diffs:
            out.append(dict(length="qa", label=label_, other=other["label"], metric=metric, samples=len(diffs),
                            diff=statistics.mean(diffs), diff_ci95=_interval(diffs),
                            wins_losses=(sum(d > 0 for d in diffs), sum(d < 0 for d in diffs))))
    return out


def table(rows: list[dict]) -> str:
    head = (f"{'mode':<20} {'n':>3} {'F1':>6} {'95% CI':>12} {'EM':>6} {'contains':>8} {'agree':>6} {'95% CI':>12} "
            f"{'F1 %full':>8} {'eff%':>5} {'gold%':>5} {'rest%':>5} {'TTFT/full':>9}")
    lines = [head, "-" * len(head)]
    ci = lambda pair: "[{:.1f}, {:.1f}]".format(*(100 * x for x in pair))  # noqa: E731
    for r in rows:
        lines.append(f"{r['label']:<20} {r['n']:>3} {100 * r['f1']:>6.1f} {ci(r['f1_ci95']):>12} {100 * r['em']:>6.1f} "
                     f"{100 * r['contains']:>8.1f} {100 * r['agreement']:>6.1f} {ci(r['agreement_ci95']):>12} "
                     f"{r['pct_of_full']:>8.1f} {100 * r['effective_fraction']:>5.1f} {100 * r['gold_share']:>5.1f} "
                     f"{100 * r['other_share']:>5.1f} {r['ttft_vs_full']:>9.3f}")
    return "\n".join(lines)


def write_json(results: list[QAResult], rows: list[dict], path: str | Path, pairs: list[dict] = ()) -> None:
    doc = {"summary": rows, "versus": list(pairs), "examples": [asdict(r) for r in results]}
    Path(path).write_text(json.dumps(doc, indent=2))
