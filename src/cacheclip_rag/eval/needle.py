"""`cacheclip bench niah`: every mode on the same needle samples, side by side.

Each sample's context is chunked and ingested like any corpus (caches built before timing);
every (mode, ratio) then answers the sample's question on the same chunk ids. The table shows
the mean score per variant (x100), the average, the percentage of full attention's average, the
effective recomputed fraction and TTFT relative to full on the same samples; per-sample rows go
to JSON for win/loss counts.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from ..engine import CacheClipEngine
from .niah import VARIANTS, generate, score

log = logging.getLogger(__name__)

PAPER_MODE = "cacheclip-paper"
"""Bench-only mode name: CacheClip as the paper configures it (aux last layer, top-k candidates
then grouping, whatever fraction remains), beside `cacheclip` with the engine's scoring layers
(calibrated profile) and the bench's budget rule."""


def request_for(mode: str, budget: str) -> dict:
    """The engine options of a bench mode name."""
    if mode == PAPER_MODE:
        return dict(mode="cacheclip", budget="paper", score_layers=(-1,))
    return dict(mode=mode, budget=budget)


@dataclass
class NeedleResult:
    length: int
    variant: str
    seed: int
    mode: str
    ratio: float
    score: float
    answer: str
    ttft: float
    ttft_vs_full: float
    selection: float
    load: float
    assemble: float
    recompute: float
    effective_fraction: float
    prompt_tokens: int
    needle_coverage: float
    """Fraction of the needle values' primary tokens that were recomputed (1 for full)."""
    oracle_overlap: float
    """Jaccard of the recomputed chunk rows with the oracle mode's at the same ratio (nan if not run)."""


def run(
    engine: CacheClipEngine,
    modes: list[tuple[str, float]],
    variants: list[str] | None = None,
    lengths: list[int] = (2048,),
    samples: int = 5,
    seed: int = 0,
    max_new_tokens: int = 64,
    progress=None,
    budget: str = "paper",
) -> list[NeedleResult]:
    """modes: (mode, ratio) pairs; full (ratio 1) is always run, as the reference."""
    from ..calibrate import CALIBRATION_SEED_BASE

    if seed + samples > CALIBRATION_SEED_BASE:
        raise ValueError(f"evaluation seeds must stay below {CALIBRATION_SEED_BASE} (calibration uses those above)")
    if ("full", 1.0) not in modes:
        modes = [("full", 1.0), *modes]
    variants = list(variants or VARIANTS)
    results: list[NeedleResult] = []
    tokenizer = engine.primary.lm.tokenizer
    for length in lengths:
        for variant in variants:
            for i in range(samples):
                sample = generate(variant, length, seed + i, tokenizer)
                ids = engine.ingest([sample.context], progress=False)
                needle_rows, chunk_rows = _needle_rows(engine, sample, ids)
                oracle: dict[float, set[int]] = {}  # ratio -> the oracle's chunk rows, when it runs
                rows_of: list[tuple[NeedleResult, set[int]]] = []
                full_ttft = None
                for mode, ratio in modes:
                    ans = engine.answer(sample.question, chunk_ids=ids, recompute_ratio=ratio,
                                        max_new_tokens=max_new_tokens, seed=seed + i, **request_for(mode, budget))
                    recomputed = set(ans.recomputed) & chunk_rows
                    t = ans.timings
                    if mode == "full":
                        full_ttft = t["ttft"]
                    if mode == "oracle":
                        oracle[ratio] = recomputed
                    results.append(NeedleResult(
                        length=length, variant=variant, seed=seed + i, mode=mode, ratio=ratio,
                        score=score(ans.text, sample.expected), answer=ans.text, ttft=t["ttft"],
                        ttft_vs_full=t["ttft"] / full_ttft if full_ttft else float("nan"),
                        selection=t["selection"], load=t["load"], assemble=t["assemble"], recompute=t["recompute"],
                        effective_fraction=ans.effective_fraction, prompt_tokens=ans.prompt_tokens,
                        needle_coverage=len(recomputed & needle_rows) / len(needle_rows) if needle_rows else float("nan"),
                        oracle_overlap=float("nan"),
                    ))
                    rows_of.append((results[-1], recomputed))
                for result, recomputed in rows_of:  # overlap with the oracle's rows at the same ratio
                    if result.ratio in oracle:
                        result.oracle_overlap = _jaccard(recomputed, oracle[result.ratio])
                if progress:
                    progress(f"{length} {variant} sample {i + 1}/{samples}")
    return results


def _needle_rows(engine: CacheClipEngine, sample, ids: list[str]) -> tuple[set[int], set[int]]:
    """Primary positions of the needle values' tokens, and of all chunk tokens, in the request."""
    request = engine._question_request(sample.question, ids)
    layout = engine._layout(engine.primary, request)
    needle, chunk = set(), set()
    for seg in layout.chunk_segments():
        chunk.update(range(seg.start, seg.end))
        for value in sample.expected:
            start = seg.text.find(value)
            while start >= 0:
                end = start + len(value)
                for t, (s, e) in enumerate(seg.offsets.tolist()):
                    if s < end and max(e, s + 1) > start:
                        needle.add(seg.start + t)
                start = seg.text.find(value, end)
    return needle, chunk


def _jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def _label(mode: str, ratio: float) -> str:
    if mode == "oracle":
        return f"oracle@{ratio:g}*"  # analysis only: selects with a full prefill
    return mode if mode in ("full", "reuse", "ape") else f"{mode}@{ratio:g}"


def summarize(results: list[NeedleResult]) -> list[dict]:
    """One row per (length, mode, ratio): per-variant means, average, % of full, eff%, TTFT/full."""
    rows = []
    keys = sorted({(r.length, r.mode, r.ratio) for r in results}, key=lambda k: (k[0], k[1] != "full", k[1], k[2]))
    for length, mode, ratio in keys:
        sel = [r for r in results if (r.length, r.mode, r.ratio) == (length, mode, ratio)]
        per_variant = {}
        for v in VARIANTS:
            scores = [r.score for r in sel if r.variant == v]
            if scores:
                per_variant[v] = statistics.mean(scores)
        row = dict(length=length, mode=mode, ratio=ratio, label=_label(mode, ratio), samples=len(sel),
                   variants=per_variant, avg=statistics.mean(per_variant.values()),
                   effective_fraction=statistics.mean(r.effective_fraction for r in sel),
                   ttft=statistics.median(r.ttft for r in sel),
                   ttft_vs_full=statistics.median(r.ttft_vs_full for r in sel),
                   selection=statistics.median(r.selection for r in sel),
                   load=statistics.median(r.load for r in sel),
                   assemble=statistics.median(r.assemble for r in sel),
                   recompute=statistics.median(r.recompute for r in sel),
                   needle_coverage=_nanmean([r.needle_coverage for r in sel]),
                   oracle_overlap=_nanmean([r.oracle_overlap for r in sel]))
        rows.append(row)
    for row in rows:
        full = next((r for r in rows if r["length"] == row["length"] and r["mode"] == "full"), None)
        row["pct_of_full"] = 100 * row["avg"] / full["avg"] if full and full["avg"] else float("nan")
        row["wins_losses_vs_reuse"] = _wins_losses(results, row, "reuse")
    return rows


def _nanmean(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.mean(values) if values else float("nan")


def _wins_losses(results: list[NeedleResult], row: dict, other: str) -> tuple[int, int]:
    mine = {(r.variant, r.seed): r.score for r in results
            if (r.length, r.mode, r.ratio) == (row["length"], row["mode"], row["ratio"])}
    theirs = {(r.variant, r.seed): r.score for r in results if r.length == row["length"] and r.mode == other}
    wins = sum(1 for k, s in mine.items() if k in theirs and s > theirs[k])
    losses = sum(1 for k, s in mine.items() if k in theirs and s < theirs[k])
    return wins, losses


def table(rows: list[dict]) -> str:
    variants = [v for v in VARIANTS if any(v in r["variants"] for r in rows)]
    short = {v: v.replace("multikey", "mk").replace("single", "s").replace("multivalue", "mv").replace("multiquery", "mq") for v in variants}
    head = f"{'len':>5} {'mode':<16} " + " ".join(f"{short[v]:>5}" for v in variants) + \
        f" {'avg':>6} {'%full':>6} {'eff%':>5} {'needle%':>7} {'∩oracle':>7} {'TTFT/full':>9} {'W/L vs reuse':>12}"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = " ".join(f"{100 * r['variants'].get(v, float('nan')):>5.0f}" for v in variants)
        w, lo = r["wins_losses_vs_reuse"]
        lines.append(f"{r['length']:>5} {r['label']:<16} {cells} {100 * r['avg']:>6.1f} {r['pct_of_full']:>6.1f} "
                     f"{100 * r['effective_fraction']:>5.1f} {100 * r['needle_coverage']:>7.1f} {r['oracle_overlap']:>7.2f} "
                     f"{r['ttft_vs_full']:>9.3f} {f'{w}/{lo}':>12}")
    return "\n".join(lines)


def write_json(results: list[NeedleResult], rows: list[dict], path: str | Path) -> None:
    Path(path).write_text(json.dumps({"summary": rows, "samples": [asdict(r) for r in results]}, indent=2))
