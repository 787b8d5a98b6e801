"""`cacheclip bench qa --diagnose`: where a reuse mode loses the answer to a real question.

For each question, full attention answers greedily and that answer is teacher-forced through
the reused cache with each mode's rows recomputed (`offline.reference`, as `bench fidelity`
does on needles). During full attention's forced pass the primary's own attention from the
query rows (every row after the last passage) over the passages is read at every layer, on the
true caches: normalised per layer to sum 1 over the passage tokens and averaged over layers,
it is ProphetKV's criterion without the staleness of reused caches, the `attention` oracle.

Per (question, mode, ratio):
- kl / kl_first: KL(full || mode) of the next-token distribution, mean over the answer's
  positions / at its first token (the answer's first-token logits, which the last hidden state
  decides);
- top1 / exact: the share of answer positions whose top token is full's / whether all are;
- held: the share of the attention oracle's mass the mode's rows hold; overlap: the share of
  the mode's rows that are among the oracle's top rows of the same count;
- gold: the share of the tokens of the passages that hold a gold answer the mode recomputed.

Per question: full attention's answer and F1, which passages hold the answer, and the share of
the query's attention on them, from the primary (oracle) and from the aux model (the scores of
the first aux mode in `modes`, summed per passage): does the aux look where the primary looks?

The `attention` rows are the oracle's own top rows replayed: what a selector that agreed with the
primary perfectly would keep. Analysis only: every question costs two full prefills.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from cacheclip_rag import CacheClipEngine
from cacheclip_rag.analysis import (
    QAExample,
    kl_positions,
    reference,
    top1_agreement,
)

from .fidelity import row_modes
from .fidelity_qa import attention_reader
from .metrics import best_of, token_f1
from .needle import label, ratio_order, request_for
from .qa import answer_of, spans_of
from .stats import bootstrap_interval, nanmean

log = logging.getLogger(__name__)

ORACLE = "attention"
"""The replayed top rows of the primary's own full-attention scores (see the module docstring)."""


@dataclass
class DiagnosisRow:
    index: int
    mode: str
    ratio: float
    kl: float
    kl_first: float
    top1: float
    exact: bool
    held: float
    overlap: float
    gold: float
    effective_fraction: float


@dataclass
class QuestionDiagnosis:
    index: int
    id: str
    full_answer: str
    full_f1: float
    gold_passages: list[int]
    oracle_mass: list[float]
    """Per passage, the share of the primary's query attention (the oracle's scores) on it."""
    aux_mass: list[float] = field(default_factory=list)
    """Per passage, the share of the aux model's scores on it (empty without an aux mode)."""
    rows: list[DiagnosisRow] = field(default_factory=list)


def run(
    engine: CacheClipEngine,
    items: list[tuple[int, QAExample]],
    modes: list[tuple[str, float]],
    answer_tokens: int = 32,
    budget: str = "keep",
    progress=None,
) -> list[QuestionDiagnosis]:
    """items: (index in the file, question); modes: (mode, ratio) pairs of row-set modes
    (`fidelity.row_modes`) or `ORACLE`, 0 <= ratio < 1."""
    known = set(row_modes()) | {ORACLE}
    bad = sorted({m for m, _ in modes} - known)
    if bad:
        raise ValueError(f"--diagnose replays a mode's recomputed rows; {bad} have none. Modes: {sorted(known)}")
    if not all(isinstance(r, (int, float)) and 0 <= r < 1 for _, r in modes):
        raise ValueError(f"--diagnose needs numeric ratios in [0, 1), got {[r for _, r in modes]!r}")
    out: list[QuestionDiagnosis] = []
    for index, ex in items:
        ids = engine.ingest([dict(c) for c in ex.contexts], progress=False, split=False)
        diagnosis = question(engine, index, ex, ids, modes, answer_tokens, budget)
        if diagnosis is not None:
            out.append(diagnosis)
        if progress:
            progress(f"question {index}")
    return out


def question(engine: CacheClipEngine, index: int, ex: QAExample, ids: list[str], modes: list[tuple[str, float]],
             answer_tokens: int, budget: str) -> QuestionDiagnosis | None:
    """One question's diagnosis; None where full attention answers nothing."""
    lm = engine.primary.lm
    layout = engine.prepare(ex.question, ids, mode="full").layout
    chunk_rows = layout.chunk_rows()
    per_layer: list[torch.Tensor] = []
    observe = attention_reader(engine, ex.question, ids, per_layer)
    ref = reference(engine, ex.question, ids, answer_tokens, observe=observe)
    if ref is None:
        log.warning("question %d: full attention answered nothing; skipped", index)
        return None
    oracle = torch.stack(per_layer).mean(0)  # [C]
    spans = spans_of(layout, ex.answers)
    local = [(int(torch.searchsorted(chunk_rows, a)), int(torch.searchsorted(chunk_rows, b))) for a, b, _ in spans]
    full_answer = answer_of(lm.tokenizer.decode(ref.answer, skip_special_tokens=True))
    diagnosis = QuestionDiagnosis(
        index=index, id=ex.id, full_answer=full_answer, full_f1=best_of(token_f1, full_answer, ex.answers),
        gold_passages=[i for i, (_, _, gold) in enumerate(spans) if gold],
        oracle_mass=[float(oracle[a:b].sum()) for a, b in local])
    gold_rows = torch.cat([torch.arange(a, b) for a, b, gold in spans if gold] or [torch.empty(0, dtype=torch.long)])
    for mode, ratio in modes:
        if mode == ORACLE:
            rows = chunk_rows[torch.topk(oracle, round(ratio * chunk_rows.numel())).indices].sort().values
        else:
            prepared = engine.prepare(ex.question, ids, recompute_ratio=ratio, **request_for(mode, budget))
            plan = prepared.selector.plan_for(prepared)
            rows = plan.rows[torch.isin(plan.rows, chunk_rows)]
            if plan.trace and not diagnosis.aux_mass and "aux_scores" in plan.trace[0]:
                mass = [float(t["aux_scores"].sum()) for t in plan.trace]
                diagnosis.aux_mass = [m / max(sum(mass), 1e-12) for m in mass]
        logprobs = ref.forced(engine, rows)
        kl = kl_positions(ref.full_logprobs, logprobs)
        agree = top1_agreement(ref.full_logprobs, logprobs)
        top = chunk_rows[torch.topk(oracle, rows.numel()).indices] if rows.numel() else rows
        diagnosis.rows.append(DiagnosisRow(
            index=index, mode=mode, ratio=ratio, kl=float(kl.mean()), kl_first=float(kl[0]),
            top1=float(agree.float().mean()), exact=bool(agree.all()),
            held=float(oracle[torch.searchsorted(chunk_rows, rows)].sum()),
            overlap=float(torch.isin(rows, top).float().mean()) if rows.numel() else float("nan"),
            gold=float(torch.isin(gold_rows, rows).float().mean()) if gold_rows.numel() else float("nan"),
            effective_fraction=rows.numel() / chunk_rows.numel()))
    return diagnosis


def summarize(results: list[QuestionDiagnosis], answered_only: bool = True) -> list[dict]:
    """One row per (mode, ratio), means over the questions (only those where full attention's
    answer scores F1 > 0 when `answered_only`), KL with its 95% bootstrap interval."""
    pool = [q for q in results if q.full_f1 > 0 or not answered_only]
    rows = [r for q in pool for r in q.rows]
    out = []
    for key in sorted({(r.mode, r.ratio) for r in rows}, key=lambda k: (ratio_order(k[1]), k[0])):
        sel = [r for r in rows if (r.mode, r.ratio) == key]
        kls = [r.kl for r in sel]
        out.append(dict(
            mode=key[0], ratio=key[1], label=label(*key), n=len(sel), kl=statistics.mean(kls),
            kl_ci95=bootstrap_interval({"questions": kls}), kl_first=statistics.mean(r.kl_first for r in sel),
            top1=statistics.mean(r.top1 for r in sel), exact=statistics.mean(float(r.exact) for r in sel),
            held=statistics.mean(r.held for r in sel), overlap=nanmean([r.overlap for r in sel]),
            gold=nanmean([r.gold for r in sel]), effective_fraction=statistics.mean(r.effective_fraction for r in sel)))
    return out


def table(rows: list[dict]) -> str:
    head = (f"{'mode':<22} {'n':>3} {'KL(full||·)':>11} {'95% CI':>17} {'KL 1st':>7} {'top-1':>6} {'exact':>6} "
            f"{'held':>6} {'overlap':>7} {'gold%':>6} {'eff%':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ci = "[{:.4f}, {:.4f}]".format(*r["kl_ci95"])
        lines.append(f"{r['label']:<22} {r['n']:>3} {r['kl']:>11.4f} {ci:>17} {r['kl_first']:>7.3f} "
                     f"{100 * r['top1']:>5.1f}% {100 * r['exact']:>5.0f}% {100 * r['held']:>5.1f}% "
                     f"{100 * r['overlap']:>6.1f}% {100 * r['gold']:>6.1f} {100 * r['effective_fraction']:>5.1f}")
    return "\n".join(lines)


def question_table(results: list[QuestionDiagnosis]) -> str:
    """Per question: full's F1, the gold passages, the share of the primary's and of the aux's
    attention on them, each one's top passage, and each mode's KL."""
    labels = sorted({label(r.mode, r.ratio) for q in results for r in q.rows})
    head = f"{'q':>4} {'full F1':>7} {'gold':<8} {'oracle→gold':>11} {'aux→gold':>8} {'top o/a':>7} " + " ".join(
        f"{x[:14]:>14}" for x in labels)
    lines = [head, "-" * len(head)]
    for q in results:
        on_gold = lambda mass: sum(mass[i] for i in q.gold_passages) if mass else float("nan")  # noqa: E731
        top = lambda mass: str(max(range(len(mass)), key=mass.__getitem__)) if mass else "-"  # noqa: E731
        kls = {label(r.mode, r.ratio): r.kl for r in q.rows}
        lines.append(f"{q.index:>4} {100 * q.full_f1:>7.1f} {','.join(map(str, q.gold_passages)) or '-':<8} "
                     f"{100 * on_gold(q.oracle_mass):>10.1f}% {100 * on_gold(q.aux_mass):>7.1f}% "
                     f"{top(q.oracle_mass) + '/' + top(q.aux_mass):>7} "
                     + " ".join(f"{kls.get(x, float('nan')):>14.4f}" for x in labels))
    return "\n".join(lines)


def write_json(results: list[QuestionDiagnosis], rows: list[dict], path: str | Path) -> None:
    Path(path).write_text(json.dumps({"summary": rows, "questions": [asdict(q) for q in results]}, indent=2))
