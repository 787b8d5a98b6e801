"""`cacheclip eval --dataset FILE`: QA over given contexts, every mode on the same inputs.

The file is JSON Lines, one example a line:
    {"question": str, "contexts": [str | {"title": str, "text": str}], "answers": [str]}
Each example's contexts become its chunks (ingested unsplit, in order; the retriever is
bypassed, as in the paper). Metrics against the best-matching answer: token F1, exact match,
ROUGE-L, and whether an answer string occurs in the prediction.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from ..engine import CacheClipEngine
from .metrics import best_of, exact_match, normalize, rouge_l, token_f1
from .needle import label, request_for, uses_packets, with_full


@dataclass
class QAExample:
    question: str
    contexts: list[dict]
    answers: list[str]


@dataclass
class QAResult:
    index: int
    mode: str
    ratio: float
    prediction: str
    f1: float
    em: float
    rouge_l: float
    contains: float
    ttft: float
    effective_fraction: float


def load_dataset(path: str | Path) -> list[QAExample]:
    """Read and validate a JSON Lines QA file; errors name the line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset {str(path)!r} does not exist")
    examples = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not valid UTF-8 ({err.reason} at byte {err.start})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n}: not JSON ({err.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{n}: expected an object with question, contexts, answers")
        q, ctxs, answers = obj.get("question"), obj.get("contexts"), obj.get("answers")
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"{path}:{n}: 'question' must be a non-empty string")
        if not isinstance(ctxs, list) or not ctxs:
            raise ValueError(f"{path}:{n}: 'contexts' must be a non-empty list")
        norm = []
        for c in ctxs:
            if isinstance(c, str) and c.strip():
                norm.append({"text": c})
            elif isinstance(c, dict) and isinstance(c.get("text"), str) and c["text"].strip():
                norm.append({"title": str(c.get("title", "")), "text": c["text"]})
            else:
                raise ValueError(f"{path}:{n}: each context must be a non-empty string or {{title, text}}")
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a for a in answers):
            raise ValueError(f"{path}:{n}: 'answers' must be a non-empty list of strings")
        examples.append(QAExample(q, norm, answers))
    if not examples:
        raise ValueError(f"dataset {path} holds no examples")
    return examples


def run(engine: CacheClipEngine, examples: list[QAExample], modes: list[tuple[str, float]], max_new_tokens: int = 32) -> list[QAResult]:
    modes = with_full(modes)
    results = []
    packets = uses_packets(modes)
    for i, ex in enumerate(examples):
        ids = engine.ingest([dict(c) for c in ex.contexts], progress=False, split=False, packets=packets)
        for mode, ratio in modes:
            ans = engine.answer(ex.question, chunk_ids=ids, recompute_ratio=ratio, max_new_tokens=max_new_tokens,
                                **request_for(mode, "keep"))
            pred = ans.text
            results.append(QAResult(
                index=i, mode=mode, ratio=ratio, prediction=pred,
                f1=best_of(token_f1, pred, ex.answers), em=best_of(exact_match, pred, ex.answers),
                rouge_l=best_of(rouge_l, pred, ex.answers),
                contains=float(any(normalize(a) in normalize(pred) for a in ex.answers)),
                ttft=ans.timings["ttft"], effective_fraction=ans.effective_fraction,
            ))
    return results


def summarize(results: list[QAResult]) -> list[dict]:
    rows = []
    for mode, ratio in sorted({(r.mode, r.ratio) for r in results}, key=lambda k: (k[0] != "full", k)):
        sel = [r for r in results if (r.mode, r.ratio) == (mode, ratio)]
        rows.append(dict(mode=mode, ratio=ratio, n=len(sel),
                         f1=statistics.mean(r.f1 for r in sel), em=statistics.mean(r.em for r in sel),
                         rouge_l=statistics.mean(r.rouge_l for r in sel), contains=statistics.mean(r.contains for r in sel),
                         effective_fraction=statistics.mean(r.effective_fraction for r in sel),
                         ttft=statistics.median(r.ttft for r in sel)))
    full = next(r for r in rows if r["mode"] == "full")
    for r in rows:
        r["f1_pct_of_full"] = 100 * r["f1"] / full["f1"] if full["f1"] else float("nan")
        r["ttft_vs_full"] = r["ttft"] / full["ttft"] if full["ttft"] else float("nan")
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'mode':<20} {'n':>3} {'F1':>6} {'EM':>6} {'ROUGE-L':>8} {'contains':>8} {'F1 %full':>8} {'eff%':>5} {'TTFT/full':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{label(r['mode'], r['ratio']):<20} {r['n']:>3} {100 * r['f1']:>6.1f} {100 * r['em']:>6.1f} {100 * r['rouge_l']:>8.1f} "
                     f"{100 * r['contains']:>8.1f} {r['f1_pct_of_full']:>8.1f} {100 * r['effective_fraction']:>5.1f} {r['ttft_vs_full']:>9.3f}")
    return "\n".join(lines)


def write_json(results: list[QAResult], rows: list[dict], path: str | Path) -> None:
    Path(path).write_text(json.dumps({"summary": rows, "examples": [asdict(r) for r in results]}, indent=2))
