"""`cacheclip bench fidelity --data FILE`: teacher-forced fidelity on real questions, the bench
that decides which rows to recompute.

Per question and chunking, full attention answers greedily (at most `answer_tokens` tokens) and
that answer is teacher-forced through the reused cache with each mode's rows recomputed
(`analysis.reference`, as `bench fidelity` does on needles): KL(full || mode) at every answer
position says how far the mode's next-token distribution is from full attention's, continuous
where greedy agreement flips a whole answer on one token. Per mode a row holds the mean KL over
the answer, the KL at the first answer token, the share of positions whose top token is full's,
whether all are (the answer reproduced whole), and the mode's TTFT over full attention's on the
same request in the same run.

Two chunkings side by side: `passage` (each passage one chunk, as the papers run MuSiQue) and
`engine` (the engine's own chunker: what `ingest` gives a user).

The ceilings are rankings no request can have, computed here from full attention's own pass
(analysis only, never modes of the library): the rows whose reused K and V deviate most from
the full prefill's (`dev`: relative deviation, K and V, mean over layers; `dev-L<l>`: layer l
alone), the rows the question attends to most in the full prefill (`attn-last`: the last layer;
`attn-mean`: mean over layers; mean over query rows, max over heads, each layer normalised over
the chunk rows), and their product (`dev*attn`). Each is replayed like a mode.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from cacheclip_rag import CacheClipEngine
from cacheclip_rag.analysis import (
    QAExample,
    kl_positions,
    reference,
    rows_attention,
    top1_agreement,
)

from . import frontier
from .deviation import rows_deviation, top_rows
from .fidelity import mode_rows, row_modes
from .journal import Journal, pool, read_rows
from .needle import label, ratio_order
from .stats import LEVEL, RESAMPLES

log = logging.getLogger(__name__)

CHUNKINGS = ("passage", "engine")
CEILINGS = ("dev", "attn-last", "attn-mean", "dev*attn")
"""The ceilings `--ceilings` names (and `dev-L<l>` for one layer's deviation)."""
KEY = ("index", "chunking", "mode", "ratio")
"""What identifies a measured row."""


@dataclass
class QAFidelityRow:
    index: int
    chunking: str
    mode: str
    ratio: float
    kl: float
    """Mean over the answer's positions of KL(full || mode)."""
    kl_first: float
    """KL(full || mode) at the first answer token."""
    top1: float
    """Share of answer positions whose top token is full attention's."""
    exact: bool
    """Every position agrees: greedy decoding reproduces full attention's answer whole."""
    effective_fraction: float
    ttft_vs_full: float
    """The mode's TTFT over full attention's on this request, same run (nan for a ceiling)."""
    answer_tokens: int
    context_tokens: int


def is_ceiling(mode: str) -> bool:
    return mode in CEILINGS or (mode.startswith("dev-L") and mode[5:].isdigit())


def check_modes(modes: Sequence[tuple[str, float]], ceilings: Sequence[str]) -> None:
    """ValueError naming what a fidelity run cannot replay."""
    bad = sorted({m for m, _ in modes} - set(row_modes()))
    if bad:
        raise ValueError(f"bench fidelity replays a mode's recomputed rows; {bad} have none. Modes: {list(row_modes())}")
    unknown = [c for c in ceilings if not is_ceiling(c)]
    if unknown:
        raise ValueError(f"unknown ceilings {unknown}; known: {list(CEILINGS)} and dev-L<layer>")


def run(
    engine: CacheClipEngine,
    items: Sequence[tuple[int, QAExample]],
    modes: Sequence[tuple[str, float]],
    chunkings: Sequence[str] = CHUNKINGS,
    ceilings: Sequence[str] = (),
    ceiling_ratios: Sequence[float] = (0.2,),
    answer_tokens: int = 32,
    budget: str = "keep",
    journal: Journal | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[QAFidelityRow]:
    """items: (index in the file, question); modes: (mode, ratio) pairs of row-set modes
    (`fidelity.row_modes`; `reuse` is always measured, as the unit of the KL shares). Rows in
    `journal` are kept; a question whose every row is there is not even ingested; each new row is
    appended once its question is done."""
    check_modes(modes, ceilings)
    if unknown := [c for c in chunkings if c not in CHUNKINGS]:
        raise ValueError(f"unknown chunkings {unknown}; known: {list(CHUNKINGS)}")
    modes = list(dict.fromkeys([("reuse", 0.0), *modes]))
    wanted = [*modes, *((c, r) for c in ceilings for r in ceiling_ratios)]
    done = journal.keys(KEY) if journal else set()
    results = [QAFidelityRow(**row) for row in journal.rows] if journal else []
    for chunking in chunkings:
        for index, ex in items:
            if all((index, chunking, m, r) in done for m, r in wanted):
                if progress:
                    progress(f"{chunking} question {index} (measured before)")
                continue
            rows = question(engine, index, ex, chunking, modes, ceilings, ceiling_ratios, answer_tokens, budget)
            for row in rows:
                if journal and tuple(getattr(row, k) for k in KEY) not in done:
                    journal.append(asdict(row))
            results += rows
            if progress:
                progress(f"{chunking} question {index}")
    keep = {(i, c, m, r) for i, _ in items for c in chunkings for m, r in wanted}
    return list({tuple(getattr(r, k) for k in KEY): r for r in results
                 if tuple(getattr(r, k) for k in KEY) in keep}.values())


def question(engine: CacheClipEngine, index: int, ex: QAExample, chunking: str, modes: Sequence[tuple[str, float]],
             ceilings: Sequence[str], ceiling_ratios: Sequence[float], answer_tokens: int,
             budget: str) -> list[QAFidelityRow]:
    """Every row of one question under one chunking ([] where full attention answers nothing)."""
    ids = engine.ingest([dict(c) for c in ex.contexts], progress=False, split=chunking == "engine")
    attention: list[torch.Tensor] = []
    observe = attention_reader(engine, ex.question, ids, attention) if ceilings else None
    ref = reference(engine, ex.question, ids, answer_tokens, observe=observe, keep_full_cache=bool(ceilings))
    if ref is None:
        log.warning("question %d (%s): full attention answered nothing; skipped", index, chunking)
        return []
    chunk_rows = ref.layout.chunk_rows()
    base = dict(index=index, chunking=chunking, answer_tokens=int(ref.answer.numel()),
                context_tokens=int(chunk_rows.numel()))
    out = []
    for mode, ratio in modes:
        rows, ttft = mode_rows(engine, ex.question, ids, ref, mode, ratio, 0, budget)
        out.append(replay(engine, ref, rows, base, mode, ratio, ttft / ref.full_ttft if ref.full_ttft else float("nan")))
    if ceilings:
        scores = ceiling_scores(ref, torch.stack(attention), ceilings)
        for name in ceilings:
            for ratio in ceiling_ratios:
                out.append(replay(engine, ref, top_rows(chunk_rows, scores[name], ratio), base, name, ratio))
    return out


def attention_reader(engine: CacheClipEngine, question_text: str, ids: list[str], into: list[torch.Tensor]):
    """An observer of full attention's forced pass that appends, per layer, the question's
    attention over the chunk rows (mean over query rows, max over heads, normalised to 1) [C]."""
    lm = engine.primary.lm
    layout = engine.prepare(question_text, ids, mode="full").layout
    chunk_rows, query_start = layout.chunk_rows(), layout.chunk_segments()[-1].end

    def observe(layer: int, q: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor) -> None:
        wanted = (rows >= query_start) & (rows < layout.num_tokens)  # the question, not the forced answer
        seen = rows_attention(lm, layer, q[:, :, wanted], keys, rows[wanted], layout.num_tokens, heads="max")
        on_chunks = seen[chunk_rows.to(seen.device)].float().cpu()
        into.append(on_chunks / on_chunks.sum().clamp_min(1e-12))

    return observe


def ceiling_scores(ref, attention: torch.Tensor, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """name -> [C] the ceiling's score of each chunk row. attention: [layers, C]."""
    rows = ref.layout.chunk_rows()
    full, reused = ref.full_cache, ref.base_cache
    k = torch.stack([rows_deviation(f, r, rows) for f, r in zip(full.keys, reused.keys)])  # [L, C]
    v = torch.stack([rows_deviation(f, r, rows) for f, r in zip(full.values, reused.values)])
    per_layer = (k + v) / 2
    dev, attn_mean = per_layer.mean(0), attention.mean(0)
    out = {"dev": dev, "attn-last": attention[-1], "attn-mean": attn_mean, "dev*attn": dev * attn_mean}
    for name in names:
        if name.startswith("dev-L"):
            layer = int(name[5:])
            if not 0 <= layer < per_layer.shape[0]:
                raise ValueError(f"{name}: the primary has layers 0..{per_layer.shape[0] - 1}")
            out[name] = per_layer[layer]
    return {n: out[n] for n in names}


def replay(engine: CacheClipEngine, ref, rows: torch.Tensor, base: dict, mode: str, ratio: float,
           ttft_vs_full: float = float("nan")) -> QAFidelityRow:
    """Teacher-force full attention's answer with chunk `rows` [S] recomputed; compare with full."""
    logprobs = ref.forced(engine, rows)
    kl = kl_positions(ref.full_logprobs, logprobs)
    agree = top1_agreement(ref.full_logprobs, logprobs)
    return QAFidelityRow(mode=mode, ratio=ratio, kl=float(kl.mean()), kl_first=float(kl[0]),
                         top1=float(agree.float().mean()), exact=bool(agree.all()),
                         effective_fraction=rows.numel() / max(base["context_tokens"], 1),
                         ttft_vs_full=ttft_vs_full, **base)


# -- the tables ------------------------------------------------------------------------------------

def _by_question(rows: Sequence[QAFidelityRow], chunking: str, key: tuple[str, float]) -> dict[int, QAFidelityRow]:
    return {r.index: r for r in rows if r.chunking == chunking and (r.mode, r.ratio) == key}


def summarize(results: Sequence[QAFidelityRow]) -> list[dict]:
    """One row per (chunking, mode, ratio), over the questions reuse was measured on too: means,
    the shares of reuse's KL that remain (mean KL over mean reuse KL, and at the first token), the
    answers reproduced whole, TTFT / full (median), each share with its 95% bootstrap interval."""
    out = []
    for chunking in dict.fromkeys(r.chunking for r in results):
        reuse = _by_question(results, chunking, ("reuse", 0.0))
        keys = sorted({(r.mode, r.ratio) for r in results if r.chunking == chunking},
                      key=lambda k: (is_ceiling(k[0]), k[0], ratio_order(k[1])))
        for key in keys:
            mine = _by_question(results, chunking, key)
            common = sorted(set(mine) & set(reuse))
            if not common:
                continue
            sel = [mine[i] for i in common]
            ref = [reuse[i] for i in common]
            timed = [r.ttft_vs_full for r in sel if r.ttft_vs_full == r.ttft_vs_full]
            out.append(dict(
                chunking=chunking, mode=key[0], ratio=key[1], label=label(*key), n=len(sel),
                ceiling=is_ceiling(key[0]),
                kl=statistics.mean(r.kl for r in sel), kl_first=statistics.mean(r.kl_first for r in sel),
                kl_share=share(sel, ref, "kl"), kl_share_ci95=share_interval(sel, ref, "kl"),
                kl_first_share=share(sel, ref, "kl_first"), kl_first_share_ci95=share_interval(sel, ref, "kl_first"),
                top1=statistics.mean(r.top1 for r in sel), exact=statistics.mean(float(r.exact) for r in sel),
                effective_fraction=statistics.mean(r.effective_fraction for r in sel),
                ttft_vs_full=statistics.median(timed) if timed else float("nan"),
                context_tokens=statistics.mean(r.context_tokens for r in sel)))
    return out


def share(rows: Sequence[QAFidelityRow], reuse: Sequence[QAFidelityRow], metric: str) -> float:
    """The share of reuse's `metric` that remains: mean over the questions / reuse's mean."""
    return float(np.mean([getattr(r, metric) for r in rows]) / max(np.mean([getattr(r, metric) for r in reuse]), 1e-12))


def _resampled_shares(values: np.ndarray, reuse: np.ndarray, seed: int = 0) -> np.ndarray:
    """[RESAMPLES, ...] the share of reuse's mean for each bootstrap resample of the questions.
    values: [Q] or [Q, M] per question (paired with reuse [Q])."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(reuse), size=(RESAMPLES, len(reuse)))
    denominator = np.maximum(reuse[picks].mean(axis=1), 1e-12)
    return values[picks].mean(axis=1) / (denominator if values.ndim == 1 else denominator[:, None])


def _interval(samples: np.ndarray) -> tuple[float, float]:
    tail = (1 - LEVEL) / 2
    lo, hi = np.quantile(samples, [tail, 1 - tail])
    return float(lo), float(hi)


def share_interval(rows: Sequence[QAFidelityRow], reuse: Sequence[QAFidelityRow], metric: str) -> tuple[float, float]:
    values = np.array([getattr(r, metric) for r in rows], dtype=float)
    return _interval(_resampled_shares(values, np.array([getattr(r, metric) for r in reuse], dtype=float)))


def versus(results: Sequence[QAFidelityRow], labels: Sequence[str], metrics: Sequence[str] = ("kl", "kl_first")
           ) -> list[dict]:
    """Paired differences in shares of reuse's KL: for each chunking, each label in `labels`
    against every other row, on the questions all three (it, the other, reuse) were measured on;
    the 95% interval resamples questions (numerator and reuse's denominator together)."""
    out = []
    for chunking in dict.fromkeys(r.chunking for r in results):
        keys = sorted({(r.mode, r.ratio) for r in results if r.chunking == chunking},
                      key=lambda k: (is_ceiling(k[0]), k[0], ratio_order(k[1])))
        reuse = _by_question(results, chunking, ("reuse", 0.0))
        for mine_key in [k for k in keys if label(*k) in labels]:
            mine = _by_question(results, chunking, mine_key)
            for other_key in keys:
                if other_key == mine_key or other_key == ("reuse", 0.0):
                    continue
                other = _by_question(results, chunking, other_key)
                common = sorted(set(mine) & set(other) & set(reuse))
                if len(common) < 2:
                    continue
                for metric in metrics:
                    a = np.array([getattr(mine[i], metric) for i in common])
                    b = np.array([getattr(other[i], metric) for i in common])
                    u = np.array([getattr(reuse[i], metric) for i in common])
                    diffs = _resampled_shares(np.stack([a, b], axis=1), u)
                    out.append(dict(chunking=chunking, label=label(*mine_key), other=label(*other_key),
                                    metric=metric, n=len(common), diff=float((a.mean() - b.mean()) / max(u.mean(), 1e-12)),
                                    ci95=_interval(diffs[:, 0] - diffs[:, 1]),
                                    wins=int((a < b).sum()), losses=int((a > b).sum())))
    return out


KL_SHARE = frontier.Metric("share of reuse's KL(full||mode)", higher_is_better=False, digits=2)
KL_FIRST_SHARE = frontier.Metric("share of reuse's KL at the first answer token", higher_is_better=False, digits=2)


def points(rows: Sequence[dict], first_token: bool = False) -> list[frontier.Point]:
    """One chunking's served modes (`summarize` rows, ceilings left out) as frontier points: the
    share of reuse's KL over the answer (or at its first token) at the mode's TTFT / full."""
    metric = "kl_first_share" if first_token else "kl_share"
    return [frontier.Point(r["label"], frontier.curve_name(r["mode"], r["ratio"]), r["ratio"], r["ttft_vs_full"],
                           r[metric], *r[f"{metric}_ci95"])
            for r in rows if not r["ceiling"] and r["ttft_vs_full"] == r["ttft_vs_full"]]


def frontier_tables(rows: Sequence[dict], budget: float, plot: str | None = None) -> str:
    """Per chunking, both shares at the TTFT budget and their Pareto frontiers (and plots)."""
    out = []
    for chunking in dict.fromkeys(r["chunking"] for r in rows):
        mine = [r for r in rows if r["chunking"] == chunking]
        for first, metric in ((False, KL_SHARE), (True, KL_FIRST_SHARE)):
            pts = points(mine, first)
            if not pts:
                continue
            out.append(f"\n{chunking} chunking: " + frontier.table(pts, budget, None, metric))
            if plot:
                stem = Path(plot)
                name = f"{stem.stem}-{chunking}-{'first' if first else 'answer'}.png"
                frontier.plot(pts, str(stem.with_name(name)), budget, f"Fidelity on real questions, {chunking} chunks",
                              metric)
    return "\n".join(out)


def table(rows: Sequence[dict]) -> str:
    head = (f"{'chunking':<8} {'mode':<22} {'n':>4} {'KL':>7} {'share':>6} {'95% CI':>14} {'KL 1st':>7} {'share':>6} "
            f"{'95% CI':>14} {'top-1':>6} {'whole':>6} {'eff%':>5} {'TTFT/full':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ci = "[{:.2f}, {:.2f}]".format(*r["kl_share_ci95"])
        ci1 = "[{:.2f}, {:.2f}]".format(*r["kl_first_share_ci95"])
        name = r["label"] + (" *" if r["ceiling"] else "")
        lines.append(f"{r['chunking']:<8} {name:<22} {r['n']:>4} {r['kl']:>7.3f} {r['kl_share']:>6.2f} {ci:>14} "
                     f"{r['kl_first']:>7.3f} {r['kl_first_share']:>6.2f} {ci1:>14} {100 * r['top1']:>5.1f}% "
                     f"{100 * r['exact']:>5.0f}% {100 * r['effective_fraction']:>5.1f} {r['ttft_vs_full']:>9.3f}")
    if any(r["ceiling"] for r in rows):
        lines.append("* a ceiling: rows ranked by what only full attention's own pass knows (analysis only)")
    return "\n".join(lines)


def versus_table(pairs: Sequence[dict]) -> str:
    head = f"{'chunking':<8} {'rows':<22} {'minus':<22} {'metric':<8} {'n':>4} {'diff':>7} {'95% CI':>16} {'W/L':>7}"
    lines = [head, "-" * len(head)]
    for p in pairs:
        ci = "[{:+.2f}, {:+.2f}]".format(*p["ci95"])
        lines.append(f"{p['chunking']:<8} {p['label']:<22} {p['other']:<22} {p['metric']:<8} {p['n']:>4} "
                     f"{p['diff']:>+7.2f} {ci:>16} {p['wins']:>3}/{p['losses']:<3}")
    return "\n".join(lines)


def load(paths: Sequence[str]) -> list[QAFidelityRow]:
    """Pool the rows of saved fidelity journals (`--from`): other questions, chunkings or modes;
    "TAG=PATH" puts a run's modes under a tag (another profile or aux: "tuned/cacheclip@0.2")."""
    def read(path: str) -> list[QAFidelityRow]:
        rows = read_rows(path)
        if rows is None:
            raise ValueError("its first line is no journal header")
        return [QAFidelityRow(**row) for row in rows]

    return pool(paths, read, lambda r, tag: replace(r, mode=f"{tag}/{r.mode}"),
                lambda r: tuple(getattr(r, k) for k in KEY), lambda r: (r.kl, r.kl_first),
                "a fidelity journal (`bench fidelity --data ... --results`)")


def write_json(results: Sequence[QAFidelityRow], rows: Sequence[dict], pairs: Sequence[dict], path) -> None:
    doc = {"summary": list(rows), "versus": list(pairs), "questions": [asdict(r) for r in results]}
    Path(path).write_text(json.dumps(doc, indent=2))
