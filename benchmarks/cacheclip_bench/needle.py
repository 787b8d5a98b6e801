"""`cacheclip bench niah`: every mode on the same needle samples, side by side.

Each sample's context is chunked and ingested like any corpus (caches built before timing);
every (mode, ratio) then answers the sample's question on the same chunk ids. The table shows
the mean score per variant (x100), the average with its 95% bootstrap interval, the percentage of
full attention's average, the effective recomputed fraction and TTFT relative to full on the same
samples; per-sample rows go to JSON, from which `load` pools runs. `versus` compares one mode with
every other on the same samples (paired differences, their interval, wins and losses).
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from cacheclip_rag import CacheClipEngine
from cacheclip_rag.analysis import (
    VARIANTS,
    NeedleSample,
)
from cacheclip_rag.analysis import (
    needle_samples as generate,
)
from cacheclip_rag.analysis import (
    needle_score as score,
)
from cacheclip_rag.analysis import (
    selector_registry as registry,
)

from .journal import Journal, pool, read_rows
from .stats import bootstrap_interval, mean_of_means, nanmean
from .suite import Suite

log = logging.getLogger(__name__)

PAPER_MODE = "cacheclip-paper"
"""Bench-only mode name: CacheClip as the paper configures it (aux last layer, top-k candidates
then grouping, whatever fraction remains), beside `cacheclip` with the engine's scoring layers
(calibrated profile) and the bench's budget rule."""
JOINT_MODE = "cacheclip-joint"
"""Bench-only mode name: `cacheclip` with the aux query reading every chunk at once
(`aux_context="joint"`), beside `cacheclip` as the engine config has it."""
CHUNK_MODE = "cacheclip-chunk"
"""Bench-only mode name: `cacheclip` with the aux query reading each chunk alone
(`aux_context="chunk"`), beside a profile that scores jointly (the shipped 4K one)."""
BENCH_MODES = (PAPER_MODE, JOINT_MODE, CHUNK_MODE)


def request_for(mode: str, budget: str) -> dict:
    """The engine options of a mode name (a registered mode or one of `BENCH_MODES`)."""
    if mode == PAPER_MODE:
        return dict(mode="cacheclip", budget="paper", score_layers=(-1,))
    if mode in (JOINT_MODE, CHUNK_MODE):
        return dict(mode="cacheclip", budget=budget, aux_context=mode.removeprefix("cacheclip-"))
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


def with_full(modes: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """The (mode, ratio) pairs a bench runs: `full` (ratio 1), the reference, first unless given."""
    return modes if ("full", 1.0) in modes else [("full", 1.0), *modes]


def run(
    engine: CacheClipEngine,
    modes: list[tuple[str, float]],
    suite_of: Suite = Suite(),
    max_new_tokens: int = 64,
    progress=None,
    budget: str = "paper",
    journal: Journal | None = None,
) -> list[NeedleResult]:
    """modes: (mode, ratio) pairs; full (ratio 1) is always run, as the reference. Rows already in
    `journal` are kept and not measured again (a sample whose every mode is there is not even
    ingested); each new row is appended to it once its sample is done."""
    modes = with_full(modes)
    packets = uses_packets(modes)
    done = journal.keys(KEY) if journal else set()
    results: list[NeedleResult] = [NeedleResult(**row) for row in journal.rows] if journal else []

    def measured(length: int, variant: str, sample_seed: int) -> bool:
        return all((length, variant, sample_seed, m, r) in done for m, r in modes)

    for length, variant, sample_seed, sample, ids in suite(engine, suite_of, progress, packets, skip=measured):
        layouts = {on: _needle_rows(engine, sample, ids, on) for on in {_on_packets(m) for m, _ in modes}}
        oracle: dict[float, set[int]] = {}  # ratio -> the oracle's chunk rows, when it runs
        rows_of: list[tuple[NeedleResult, set[int]]] = []
        full_ttft = None
        for mode, ratio in modes:  # a sample the journal holds only some modes of is measured again whole
            ans = engine.answer(sample.question, chunk_ids=ids, recompute_ratio=ratio,
                                max_new_tokens=max_new_tokens, seed=sample_seed, **request_for(mode, budget))
            needle_rows, chunk_rows = layouts[_on_packets(mode)]
            recomputed = set(ans.recomputed) & chunk_rows
            t = ans.timings
            if mode == "full":
                full_ttft = t["ttft"]
            if mode == "oracle":
                oracle[ratio] = recomputed
            results.append(NeedleResult(
                length=length, variant=variant, seed=sample_seed, mode=mode, ratio=ratio,
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
        if journal:
            for result, _ in rows_of:
                if _key_of(result) not in done:
                    journal.append(asdict(result))
    wanted = {(m, r) for m, r in modes}
    return [r for r in _unique(results) if (r.mode, r.ratio) in wanted and suite_of.holds(r.length, r.variant, r.seed)]


KEY = ("length", "variant", "seed", "mode", "ratio")
"""What identifies a measured needle row."""


def _key_of(r: NeedleResult) -> tuple:
    return tuple(getattr(r, f) for f in KEY)


def _unique(results: list[NeedleResult]) -> list[NeedleResult]:
    """The last row of each key: a sample measured again whole after a stop replaces its earlier
    rows from the journal."""
    return list({_key_of(r): r for r in results}.values())


def _on_packets(mode: str) -> bool:
    return mode not in BENCH_MODES and registry.get(mode).packets


def uses_packets(modes: list[tuple[str, float]]) -> bool:
    """Whether any of the (mode, ratio) pairs runs on KV Packet caches (a bench then builds them
    at ingest, so that no timed request does)."""
    return any(_on_packets(m) for m, _ in modes)


def suite(
    engine: CacheClipEngine,
    suite_of: Suite,
    progress=None,
    packets: bool = False,
    skip=None,
) -> Iterator[tuple[int, str, int, NeedleSample, list[str]]]:
    """The samples a needle-suite bench runs on, generated and ingested (with their KV Packet
    caches when `packets`, so no timed request builds them), one at a time: (length, variant,
    seed, sample, chunk ids). Evaluation seeds must stay below the calibration seeds (ValueError
    before anything runs); progress(message) is called after each sample; skip(length, variant,
    seed) -> True passes a sample over unbuilt (it is already measured)."""
    from cacheclip_rag.analysis import CALIBRATION_SEED_BASE

    seed, samples = suite_of.seed, suite_of.samples
    if seed + samples > CALIBRATION_SEED_BASE:
        raise ValueError(f"evaluation seeds must stay below {CALIBRATION_SEED_BASE} (calibration uses those above)")
    for length in suite_of.lengths:
        for variant in suite_of.variant_names:
            for i in range(samples):
                if skip and skip(length, variant, seed + i):
                    if progress:
                        progress(f"{length} {variant} sample {i + 1}/{samples} (measured before)")
                    continue
                sample = generate(variant, length, seed + i, engine.primary.lm.tokenizer)
                ids = engine.ingest([sample.context], progress=False, packets=packets)
                yield length, variant, seed + i, sample, ids
                if progress:
                    progress(f"{length} {variant} sample {i + 1}/{samples}")


def _needle_rows(engine: CacheClipEngine, sample, ids: list[str], packets: bool = False) -> tuple[set[int], set[int]]:
    """Primary positions of the needle values' tokens, and of all chunk rows, in the request's
    layout (the packet layout, soft rows among the chunk rows, when `packets`)."""
    layout = engine.prepare(sample.question, ids, mode="packet" if packets else "full").layout
    needle, chunk = set(), set()
    for seg in layout.chunk_segments():
        chunk.update(range(seg.start, seg.end))
        text_rows = (seg.ids >= 0).tolist()
        for value in sample.expected:
            start = seg.text.find(value)
            while start >= 0:
                end = start + len(value)
                for t, (s, e) in enumerate(seg.offsets.tolist()):
                    if text_rows[t] and s < end and max(e, s + 1) > start:
                        needle.add(seg.start + t)
                start = seg.text.find(value, end)
    return needle, chunk


def _jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def label(mode: str, ratio: float) -> str:
    """A bench row's name: the mode, with its ratio where it has one; the oracle starred; a run
    pooled under a tag (`load`, "TAG=PATH") keeps its tag in front ("tuned/cacheclip@0.2")."""
    if "/" in mode:
        tag, inner = mode.split("/", 1)
        return f"{tag}/{label(inner, ratio)}"
    selector = registry.get(mode) if mode in registry.modes() else None
    if selector is not None and selector.analysis_only:
        return f"{mode}@{ratio_text(ratio)}*"  # analysis only: costs more than full attention
    return mode if selector is not None and selector.fixed_ratio is not None else f"{mode}@{ratio_text(ratio)}"


def ratio_text(ratio: float | str) -> str:
    """0.2 -> "0.2"; "auto" stays "auto"."""
    return ratio if isinstance(ratio, str) else f"{ratio:g}"


def ratio_order(ratio: float | str) -> tuple:
    """A sort key that puts numeric ratios in order and "auto" after them."""
    return (1, 0.0) if isinstance(ratio, str) else (0, float(ratio))


def _key(r: NeedleResult) -> tuple[int, str, float]:
    return r.length, r.mode, r.ratio


def summarize(results: list[NeedleResult]) -> list[dict]:
    """One row per (length, mode, ratio): per-variant means, average and its 95% interval, % of
    full, eff%, TTFT/full, wins and losses against reuse on the same samples."""
    rows = []
    keys = sorted({_key(r) for r in results}, key=lambda k: (k[0], k[1] != "full", k[1], ratio_order(k[2])))
    for length, mode, ratio in keys:
        sel = [r for r in results if _key(r) == (length, mode, ratio)]
        by_variant = by_variants(sel, "score")
        row = dict(length=length, mode=mode, ratio=ratio, label=label(mode, ratio), samples=len(sel),
                   variants={v: statistics.mean(scores) for v, scores in by_variant.items()},
                   avg=mean_of_means(by_variant), avg_ci95=bootstrap_interval(by_variant),
                   effective_fraction=statistics.mean(r.effective_fraction for r in sel),
                   ttft=statistics.median(r.ttft for r in sel),
                   ttft_vs_full=statistics.median(r.ttft_vs_full for r in sel),
                   selection=statistics.median(r.selection for r in sel),
                   load=statistics.median(r.load for r in sel),
                   assemble=statistics.median(r.assemble for r in sel),
                   recompute=statistics.median(r.recompute for r in sel),
                   needle_coverage=nanmean([r.needle_coverage for r in sel]),
                   oracle_overlap=nanmean([r.oracle_overlap for r in sel]))
        rows.append(row)
    for row in rows:
        full = next((r for r in rows if r["length"] == row["length"] and r["mode"] == "full"), None)
        full_avg = _avg_on_samples_of(results, full, row) if full else float("nan")
        row["pct_of_full"] = 100 * row["avg"] / full_avg if full_avg else float("nan")
        reuse = next((r for r in rows if r["length"] == row["length"] and r["mode"] == "reuse"), None)
        diffs = _paired(results, row, reuse) if reuse else {}
        row["wins_losses_vs_reuse"] = _wins_losses(diffs)
    return rows


def by_variants(records: list, metric: str) -> dict[str, list[float]]:
    """variant -> the records' `metric` values, for the variants present (in suite order)."""
    groups = {v: [getattr(r, metric) for r in records if r.variant == v] for v in VARIANTS}
    return {v: values for v, values in groups.items() if values}


def _by_sample(results: list, row: dict, metric: str) -> dict[tuple[str, int], float]:
    """(variant, seed) -> `metric` of the per-sample records behind a summary row.
    results: any per-sample records with length, variant, seed, mode, ratio and the metric."""
    key = (row["length"], row["mode"], row["ratio"])
    return {(r.variant, r.seed): getattr(r, metric) for r in results if _key(r) == key}


def _paired(results: list, row: dict, other: dict, metric: str = "score") -> dict[str, list[float]]:
    """variant -> differences of `metric` (row's mode minus other's) on the samples both ran."""
    mine, theirs = _by_sample(results, row, metric), _by_sample(results, other, metric)
    diffs: dict[str, list[float]] = {}
    for (variant, seed), s in sorted(mine.items()):
        if (variant, seed) in theirs:
            diffs.setdefault(variant, []).append(s - theirs[(variant, seed)])
    return diffs


def _avg_on_samples_of(results: list, other: dict, row: dict) -> float:
    """`other`'s average score on the samples `row` ran (pooled runs may give rows different
    variants or seeds: % of full must compare like with like); nan when they share none."""
    mine = _by_sample(results, row, "score")
    theirs = [r for r in results if _key(r) == (other["length"], other["mode"], other["ratio"]) and (r.variant, r.seed) in mine]
    return mean_of_means(by_variants(theirs, "score")) if theirs else float("nan")


def _wins_losses(diffs: dict[str, list[float]]) -> tuple[int, int]:
    flat = [d for ds in diffs.values() for d in ds]
    return sum(d > 0 for d in flat), sum(d < 0 for d in flat)


def versus(results: list, rows: list[dict], label: str, metric: str = "score") -> list[dict]:
    """`label`'s row (e.g. "cacheclip@0.2") against every other row of its length, sample by sample:
    mean paired difference of `metric` averaged over variants, its 95% bootstrap interval, wins
    (a higher metric) and losses. Raises ValueError when no row has that label."""
    mine = [r for r in rows if r["label"] == label]
    if not mine:
        raise ValueError(f"no bench row is labelled {label!r}; rows: {sorted({r['label'] for r in rows})}")
    out = []
    for row in mine:
        for other in rows:
            if other["length"] != row["length"] or other is row:
                continue
            diffs = _paired(results, row, other, metric)
            if not diffs:
                continue
            out.append(dict(length=row["length"], label=label, other=other["label"], samples=sum(map(len, diffs.values())),
                            diff=mean_of_means(diffs), diff_ci95=bootstrap_interval(diffs), wins_losses=_wins_losses(diffs)))
    return out


def versus_table(pairs: list[dict], scale: float = 100, digits: int = 1) -> str:
    """Differences (and intervals) times `scale`, with `digits` decimals."""
    fmt = lambda x: f"{scale * x:+.{digits}f}"  # noqa: E731
    width = 2 * (digits + 4) + 4
    head = f"{'len':>5} {'mode':<24} {'minus':<24} {'n':>4} {'diff':>{digits + 5}} {'95% CI':>{width}} {'W/L':>7}"
    lines = [head, "-" * len(head)]
    for p in pairs:
        lo, hi = p["diff_ci95"]
        w, lo_count = p["wins_losses"]
        lines.append(f"{p['length']:>5} {p['label']:<24} {p['other']:<24} {p['samples']:>4} {fmt(p['diff']):>{digits + 5}} "
                     f"{f'[{fmt(lo)}, {fmt(hi)}]':>{width}} {f'{w}/{lo_count}':>7}")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    variants = [v for v in VARIANTS if any(v in r["variants"] for r in rows)]
    short = {v: v.replace("multikey", "mk").replace("single", "s").replace("multivalue", "mv").replace("multiquery", "mq") for v in variants}
    head = f"{'len':>5} {'mode':<24} " + " ".join(f"{short[v]:>5}" for v in variants) + \
        f" {'avg':>6} {'95% CI':>11} {'%full':>6} {'eff%':>5} {'needle%':>7} {'∩oracle':>7} {'TTFT/full':>9} {'W/L vs reuse':>12}"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = " ".join(f"{100 * r['variants'].get(v, float('nan')):>5.0f}" for v in variants)
        w, lo = r["wins_losses_vs_reuse"]
        ci = "[{:.0f}, {:.0f}]".format(*(100 * x for x in r["avg_ci95"]))
        lines.append(f"{r['length']:>5} {r['label']:<24} {cells} {100 * r['avg']:>6.1f} {ci:>11} {r['pct_of_full']:>6.1f} "
                     f"{100 * r['effective_fraction']:>5.1f} {100 * r['needle_coverage']:>7.1f} {r['oracle_overlap']:>7.2f} "
                     f"{r['ttft_vs_full']:>9.3f} {f'{w}/{lo}':>12}")
    return "\n".join(lines)


def write_json(results: list[NeedleResult], rows: list[dict], path: str | Path, pairs: list[dict] = ()) -> None:
    doc = {"summary": rows, "versus": list(pairs), "samples": [asdict(r) for r in results]}
    Path(path).write_text(json.dumps(doc, indent=2))


def _saved_samples(path: str | Path) -> list[dict]:
    """The per-sample rows of a `write_json` file, or of a --results journal."""
    rows = read_rows(path)
    return rows if rows is not None else json.loads(Path(path).read_text(encoding="utf-8"))["samples"]


def load(paths: list[str | Path]) -> list[NeedleResult]:
    """Pool the per-sample rows of saved runs (`write_json` files or --results journals), e.g. runs on disjoint seeds, or
    runs of other modes on the same samples; "TAG=PATH" puts a run's modes under a tag ("tuned/full")
    beside the untagged run, whose `full` stays the reference of every row (`journal.pool`)."""
    return pool(paths, lambda path: [NeedleResult(**d) for d in _saved_samples(path)],
                lambda r, tag: replace(r, mode=f"{tag}/{r.mode}"),
                lambda r: (r.length, r.variant, r.seed, r.mode, r.ratio), lambda r: (r.answer, r.score),
                "a needle bench JSON or journal (expected 'samples' of needle results, or a journal's rows)")
