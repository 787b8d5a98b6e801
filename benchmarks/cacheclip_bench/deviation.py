"""`cacheclip bench deviation`: how far a reused cache is from full prefill, where, and whether
the rows that deviate most are the ones worth recomputing.

On the needle samples, the request's reused cache (every chunk encoded alone after the prefix,
keys re-rotated to their place) is compared with the cache a full prefill writes, row by row and
layer by layer: |K_full - K_reused| / |K_full|, mean over KV heads, and the same for V. The first
chunk follows the prefix in both, so its rows differ by rounding only (a built-in check); a later
row differs by what the chunks before it would have told it.

Then chunk rows are chosen three ways at each ratio and teacher-forced like `bench fidelity`:
`deviation` (the rows whose K and V deviate most, averaged over all layers: what a deviation
criterion could pick knowing every layer exactly), `deviation-L<c>` (K deviation at CacheBlend's
check layer c alone: CacheBlend's own criterion, exact), and `oracle` (the primary's last-layer
attention from the question). Analysis only: each needs a full prefill. `modes` adds the rows a
serving mode picks (`cacheclip`, `prophetkv`, ...), replayed the same way, and for every
criterion the share of the deviation its rows hold: a criterion that repairs little deviation
yet answers closer to full is choosing by something else than how stale a row is (ProphetKV's
"crowding-out" reading of CacheBlend's criterion).

With packets=True the reused cache is the request's KV Packet caches and the reference is a full
prefill of the wrapped sequence (the packet modes' 100% oracle); the rows chosen are by
deviation and by `packet+cacheclip`, forced through the packet cache and compared with plain
full attention's answer distribution. Is the deviation smaller, more concentrated?
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from cacheclip_rag import CacheClipEngine
from cacheclip_rag.analysis import (
    AssembledCache,
    Reference,
    packet_reference,
    recompute_rows,
    reference,
    relative_deviation,
)

from .fidelity import FidelityResult, mode_rows, replay
from .needle import label, suite
from .suite import Suite


@dataclass
class DeviationResult:
    """One sample. k_first / v_first, k_later / v_later: [layers] mean relative deviation over the
    first chunk's rows and over every later chunk's rows. top_share: {ratio: share of all rows'
    deviation (mean over layers, K and V) held by the top `ratio` of rows}."""

    length: int
    variant: str
    seed: int
    k_first: list[float]
    v_first: list[float]
    k_later: list[float]
    v_later: list[float]
    top_share: dict[float, float]
    held: dict[str, float] = field(default_factory=dict)
    """{label ("cacheclip@0.2"): share of all chunk rows' deviation held by that criterion's rows}"""


def full_cache(engine: CacheClipEngine, ref: Reference) -> AssembledCache:
    """The cache a full prefill of the request writes (every prompt row recomputed in a copy)."""
    layout = ref.layout
    cache = ref.base_cache.copy()
    rows = torch.unique(torch.cat([layout.uncached_rows(), layout.chunk_rows()]))
    recompute_rows(engine.primary.lm, cache, layout.input_ids, rows, backend=engine.config.attention_backend,
                   embed=ref.embed)
    return cache


def rows_deviation(full: torch.Tensor, reused: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[R] |full - reused| / |full| at sequence indices `rows`, mean over KV heads; tensors
    [1, kv_heads, N, head_dim] (the library's `relative_deviation`, as the staleness selectors read it)."""
    return relative_deviation(full[:, :, rows], reused[:, :, rows])


def kv_deviation(engine: CacheClipEngine, ref: Reference) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V deviation of the reused cache from full prefill: two [layers, C] tensors over the
    request's chunk rows (`ref.layout.chunk_rows()`)."""
    full = full_cache(engine, ref)
    rows = ref.layout.chunk_rows()
    k = torch.stack([rows_deviation(f, r, rows) for f, r in zip(full.keys, ref.base_cache.keys)])
    v = torch.stack([rows_deviation(f, r, rows) for f, r in zip(full.values, ref.base_cache.values)])
    return k, v


def top_rows(chunk_rows: torch.Tensor, scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """[S] sorted: the round(ratio * C) chunk rows with the highest scores [C]."""
    k = round(ratio * chunk_rows.numel())
    return chunk_rows[torch.topk(scores, k).indices].sort().values


def top_share(scores: torch.Tensor, ratio: float) -> float:
    """Share of the total held by the top `ratio` of scores (uniform scores: `ratio`)."""
    k = max(1, round(ratio * scores.numel()))
    return float(torch.topk(scores, k).values.sum() / scores.sum().clamp(min=1e-12))


def held_share(chunk_rows: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor) -> float:
    """Share of the total of scores [C] (over chunk_rows [C], sorted) held by `rows` [S] (a subset)."""
    return float(scores[torch.searchsorted(chunk_rows, rows)].sum() / scores.sum().clamp(min=1e-12))


def run(
    engine: CacheClipEngine,
    ratios: list[float],
    suite_of: Suite = Suite(),
    answer_tokens: int = 64,
    budget: str = "keep",
    progress=None,
    packets: bool = False,
    modes: list[str] = (),
) -> tuple[list[DeviationResult], list[FidelityResult]]:
    """Per sample: the deviation profile, and the fidelity of deviation- and attention-chosen rows
    (packets: of the KV Packet caches; see the module docstring); `modes`: serving modes whose
    rows are replayed too (not with packets)."""
    if not ratios or not all(isinstance(r, (int, float)) and 0 < r < 1 for r in ratios):
        raise ValueError(f"ratios must be fractions strictly between 0 and 1, got {ratios!r}")
    if packets and modes:
        raise ValueError(f"modes {list(modes)!r} are replayed on plain caches; drop them or packets=True")
    check = engine.config.baselines.cacheblend_check_layer
    deviations: list[DeviationResult] = []
    fidelity: list[FidelityResult] = []
    for length, variant, sample_seed, sample, ids in suite(engine, suite_of, progress):
        ref = reference(engine, sample.question, ids, answer_tokens)
        if ref is None:
            continue
        if packets:
            ref = packet_reference(engine, ref, sample.question, ids)
        k, v = kv_deviation(engine, ref)
        first = ref.layout.chunk_segments()[0]
        n_first = first.end - first.start
        overall = (k + v).mean(0) / 2  # [C]
        deviations.append(DeviationResult(
            length=length, variant=variant, seed=sample_seed,
            k_first=k[:, :n_first].mean(1).tolist(), v_first=v[:, :n_first].mean(1).tolist(),
            k_later=k[:, n_first:].mean(1).tolist() if k.shape[1] > n_first else [],
            v_later=v[:, n_first:].mean(1).tolist() if v.shape[1] > n_first else [],
            top_share={r: top_share(overall, r) for r in ratios}))
        chunk_rows = ref.layout.chunk_rows()
        for ratio in ratios:
            chosen = {
                "deviation": top_rows(chunk_rows, overall, ratio),
                f"deviation-L{check}": top_rows(chunk_rows, k[check], ratio),
            }
            for selector in ("packet+cacheclip",) if packets else ("oracle", *modes):
                chosen[selector], _ = mode_rows(engine, sample.question, ids, ref, selector, ratio, sample_seed,
                                                budget)
            if packets:
                chosen = {f"packet-{m}" if m.startswith("deviation") else m: r for m, r in chosen.items()}
            for mode, rows in chosen.items():
                deviations[-1].held[label(mode, ratio)] = held_share(chunk_rows, overall, rows)
                fidelity.append(replay(engine, ref, rows, length, variant, sample_seed, mode, ratio))
    return deviations, fidelity


def layer_table(results: list[DeviationResult]) -> str:
    """Per layer, mean over samples: K and V deviation of the first chunk's rows and of later ones."""
    head = f"{'layer':>5} {'K first':>8} {'V first':>8} {'K later':>8} {'V later':>8}"
    lines = [head, "-" * len(head)]
    later = [r for r in results if r.k_later]
    for layer in range(len(results[0].k_first)):
        cells = [statistics.mean(getattr(r, name)[layer] for r in pool) if pool else float("nan")
                 for name, pool in (("k_first", results), ("v_first", results), ("k_later", later), ("v_later", later))]
        lines.append(f"{layer:>5} " + " ".join(f"{c:>8.3f}" for c in cells))
    return "\n".join(lines)


def concentration(results: list[DeviationResult]) -> str:
    """One line per ratio: the share of the deviation the top rows hold (mean over samples)."""
    ratios = sorted({r for res in results for r in res.top_share})
    return "\n".join(f"the {100 * r:g}% of chunk rows that deviate most hold "
                     f"{100 * statistics.mean(res.top_share[r] for res in results):.1f}% of the deviation "
                     f"(evenly spread: {100 * r:g}%)" for r in ratios)


def held_table(results: list[DeviationResult]) -> str:
    """One line per criterion: the share of the deviation its rows hold, mean over samples (with
    the deviation evenly spread, a criterion's share would be its ratio)."""
    labels = sorted({k for r in results for k in r.held}, key=lambda k: (k.rsplit("@", 1)[-1], k))
    lines = [f"{'rows':<24} {'deviation held':>14}"]
    for key in labels:
        shares = [r.held[key] for r in results if key in r.held]
        lines.append(f"{key:<24} {100 * statistics.mean(shares):>13.1f}%")
    return "\n".join(lines)


def write_json(deviations: list[DeviationResult], fidelity: list[FidelityResult], rows: list[dict],
               path: str | Path, pairs: list[dict] = ()) -> None:
    doc = {"fidelity_summary": rows, "versus": list(pairs), "deviation": [asdict(r) for r in deviations],
           "fidelity": [asdict(r) for r in fidelity]}
    Path(path).write_text(json.dumps(doc, indent=2))
