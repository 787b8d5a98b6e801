"""`cacheclip bench fidelity`: how close each selector's recompute comes to full attention.

On the needle samples, full attention's own greedy answer is teacher-forced through the reused
cache with each mode's recomputed rows (`cacheclip_rag.offline.reference`); per answer position the
next-token distribution is compared with full attention's. Columns: mean KL(full || mode) with
its 95% bootstrap interval, the share of answer positions whose top token is full attention's,
and the share of samples where every position agrees (greedy decoding would reproduce full
attention's answer). No label is read; the needle score is `bench niah`'s business.

Modes whose recompute is one set of rows: reuse, random, epic, cacheclip, cacheclip-paper,
oracle, and the packet modes (forced through the request's KV Packet caches, compared with plain
full attention: what the adapters buy, with and without recompute). CacheBlend chooses its rows inside the layer loop and APE changes attention itself, so
neither has a row set to replay; they are refused.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cacheclip_rag import CacheClipEngine
from cacheclip_rag.analysis import (
    Reference,
    kl_positions,
    packet_reference,
    reference,
    top1_agreement,
)
from cacheclip_rag.analysis import (
    selector_registry as registry,
)

from . import frontier
from .needle import BENCH_MODES, by_variants, label, ratio_order, request_for, suite
from .stats import bootstrap_interval, mean_of_means
from .suite import Suite

log = logging.getLogger(__name__)

def row_modes() -> tuple[str, ...]:
    """The modes whose plan is a set of rows a replay can recompute (`Selector.row_set`; `full` is
    the reference itself), and the bench's CacheClip variants."""
    return (*(m for m in registry.modes() if registry.get(m).row_set and m != "full"), *BENCH_MODES)


@dataclass
class FidelityResult:
    length: int
    variant: str
    seed: int
    mode: str
    ratio: float
    kl: float
    """Mean over answer positions of KL(full || mode)."""
    agreement: float
    """Share of answer positions where the mode's top token is full attention's."""
    exact: bool
    """Every answer position agrees."""
    effective_fraction: float
    answer_tokens: int
    ttft_vs_full: float = float("nan")
    """The mode's TTFT on this request over full attention's, same run (nan where not timed)."""


def run(
    engine: CacheClipEngine,
    modes: list[tuple[str, float]],
    suite_of: Suite = Suite(),
    answer_tokens: int = 64,
    budget: str = "keep",
    progress=None,
) -> list[FidelityResult]:
    """modes: (mode, ratio) pairs from `row_modes()`."""
    bad = sorted({m for m, _ in modes} - set(row_modes()))
    if bad:
        raise ValueError(f"bench fidelity replays a mode's recomputed rows; {bad} have none to replay. "
                         f"Modes: {list(row_modes())}")
    results: list[FidelityResult] = []
    for length, variant, sample_seed, sample, ids in suite(engine, suite_of, progress):
        ref = reference(engine, sample.question, ids, answer_tokens)
        if ref is None:
            log.warning("%s %s seed %d: full attention answered nothing; skipped", length, variant, sample_seed)
            continue
        packet_ref = None
        for mode, ratio in modes:
            on = ref
            if mode not in BENCH_MODES and registry.get(mode).packets:
                packet_ref = packet_ref or packet_reference(engine, ref, sample.question, ids)
                on = packet_ref
            rows, ttft = mode_rows(engine, sample.question, ids, on, mode, ratio, sample_seed, budget)
            results.append(replay(engine, on, rows, length, variant, sample_seed, mode, ratio,
                                  ttft_vs_full=ttft / ref.full_ttft if ref.full_ttft else float("nan")))
    return results


def mode_rows(engine: CacheClipEngine, question: str, ids: list[str], ref: Reference, mode: str, ratio: float,
              seed: int, budget: str) -> tuple[torch.Tensor, float]:
    """[S] the chunk rows `mode` recomputes for this request, and its TTFT in seconds (one
    decoding step is enough to know both)."""
    ans = engine.answer(question, chunk_ids=ids, recompute_ratio=ratio, max_new_tokens=1, seed=seed,
                        **request_for(mode, budget))
    chunk_rows = set(ref.layout.chunk_rows().tolist())
    return torch.tensor(sorted(set(ans.recomputed) & chunk_rows), dtype=torch.long), ans.timings["ttft"]


def replay(engine: CacheClipEngine, ref: Reference, rows: torch.Tensor, length: int, variant: str, seed: int,
           mode: str, ratio: float, ttft_vs_full: float = float("nan")) -> FidelityResult:
    """Teacher-force full attention's answer with chunk `rows` [S] recomputed; compare with full."""
    logprobs = ref.forced(engine, rows)
    agree = top1_agreement(ref.full_logprobs, logprobs)
    n_context = int(ref.layout.chunk_rows().numel())
    return FidelityResult(
        length=length, variant=variant, seed=seed, mode=mode, ratio=ratio,
        kl=float(kl_positions(ref.full_logprobs, logprobs).mean()),
        agreement=float(agree.float().mean()), exact=bool(agree.all()),
        effective_fraction=rows.numel() / n_context if n_context else 0.0, answer_tokens=int(ref.answer.numel()),
        ttft_vs_full=ttft_vs_full)


def summarize(results: list[FidelityResult]) -> list[dict]:
    """One row per (length, mode, ratio): mean KL over variants with its 95% interval, agreement,
    exact share, effective fraction."""
    rows = []
    keys = {(r.length, r.mode, r.ratio) for r in results}
    for key in sorted(keys, key=lambda k: (k[0], k[1], ratio_order(k[2]))):  # "auto" after the numbers
        sel = [r for r in results if (r.length, r.mode, r.ratio) == key]
        by_variant = by_variants(sel, "kl")
        rows.append(dict(length=key[0], mode=key[1], ratio=key[2], samples=len(sel),
                         label=label(key[1], key[2]),
                         kl=mean_of_means(by_variant), kl_ci95=bootstrap_interval(by_variant),
                         agreement=statistics.mean(r.agreement for r in sel),
                         exact=statistics.mean(float(r.exact) for r in sel),
                         effective_fraction=statistics.mean(r.effective_fraction for r in sel),
                         ttft_vs_full=_median_timed(sel)))
    rows.sort(key=lambda r: (r["length"], r["kl"]))
    return rows


def _median_timed(results: list[FidelityResult]) -> float:
    timed = [r.ttft_vs_full for r in results if math.isfinite(r.ttft_vs_full)]
    return statistics.median(timed) if timed else float("nan")


def table(rows: list[dict]) -> str:
    head = (f"{'len':>5} {'mode':<23} {'n':>4} {'KL(full||·)':>11} {'95% CI':>17} {'top-1 agree':>11} {'exact':>6} "
            f"{'eff%':>5} {'TTFT/full':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ci = "[{:.4f}, {:.4f}]".format(*r["kl_ci95"])
        lines.append(f"{r['length']:>5} {r['label']:<23} {r['samples']:>4} {r['kl']:>11.4f} {ci:>17} "
                     f"{100 * r['agreement']:>10.1f}% {100 * r['exact']:>5.0f}% {100 * r['effective_fraction']:>5.1f} "
                     f"{r.get('ttft_vs_full', float('nan')):>9.3f}")
    return "\n".join(lines)


def points(rows: list[dict]) -> list[frontier.Point]:
    """Fidelity rows (`summarize`, one length) as frontier points: KL(full || mode) at the mode's
    median TTFT / full (`frontier.KL`: lower is better); rows without a measured TTFT are left out."""
    return [frontier.Point(r["label"], frontier.curve_name(r["mode"], r["ratio"]), r["ratio"], r["ttft_vs_full"],
                           r["kl"], *r["kl_ci95"])
            for r in rows if math.isfinite(r.get("ttft_vs_full", float("nan")))]


def write_json(results: list[FidelityResult], rows: list[dict], path: str | Path, pairs: list[dict] = ()) -> None:
    doc = {"summary": rows, "versus": list(pairs), "samples": [asdict(r) for r in results]}
    Path(path).write_text(json.dumps(doc, indent=2))
