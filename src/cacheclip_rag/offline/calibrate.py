"""Calibrate how the aux model scores tokens for a model pair, on generated inputs or the user's questions.

Calibration inputs are needle-style samples whose seeds are disjoint from every evaluation seed,
or questions of the user's own QA file (`qa_inputs`: its passages as chunks, its question under
the engine's prompt; questions held out from evaluation); their answers are never read. Each
input is ingested into a scratch store and asked the way the engine asks, so the aux signal
calibrated is exactly the one served: the query's attention over each chunk
(`select.score_chunks_by_layer`), or over all of them at once where that fits the aux model
(`select.score_joint_by_layer`, `SelectConfig.context`).

Candidates are each aux layer, then each run of 2..max_run adjacent layers (their scores
averaged) that holds one of the best single layers. Every candidate is measured two ways:

- **alignment** with the primary's own last-layer attention from the question rows over the
  chunks (a full prefill), in character space: Jaccard of the top-20% characters and recall of
  the primary's top-5% characters inside the candidate's top 20%;
- **fidelity**, what recomputation is for: the candidate's selection at the calibration ratio
  (budget-keeping) is recomputed in the reused cache, full attention's own greedy answer is
  teacher-forced through it, and the KL divergence KL(full || candidate) of the next-token
  distributions is taken at each answer position (no label is involved). Two summaries: its
  mean over the answer ("kl"), and the share of direct reuse's divergence the candidate leaves
  at the quarter of answer positions where reuse diverges most ("hard": the positions where
  recomputation has something to fix, such as the digits of a retrieved value).

The profile takes the candidate best by the chosen criterion (fewer layers on ties); the
aggregation over heads and query rows, the per-chunk normalization and the aux context (per
chunk or joint) are then chosen the same way for those layers. Measured on the default pair, alignment with the primary's last layer does not pick the
layers that find what the primary needs (docs/notes/2026-12-03-benchmark-record.md); it is reported beside fidelity.
"""

from __future__ import annotations

import datetime as _dt
import logging
import statistics
import tempfile
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..config import AUX_CONTEXTS
from ..engine import CacheClipEngine
from ..selectors.aux_scores import (
    joint_positions,
    mean_over_layers,
    normalized,
    score_chunks_by_layer,
    score_joint_by_layer,
)
from ..selectors.budget import keep_budget, map_tokens
from ..selectors.primary_attention import attention_from_rows
from ..storage.profiles import Profile
from .niah import generate
from .overlap import to_chars, top_jaccard, top_positions
from .reference import Reference, kl_positions, reference

log = logging.getLogger(__name__)

CALIBRATION_SEED_BASE = 1_000_000
"""Calibration seeds start here; evaluation seeds (bench niah --seed) must stay below it."""
VARIANTS = ("multikey_1", "multivalue", "multiquery", "single_2")
AGGREGATIONS = (("mean", "mean"), ("max", "mean"), ("mean", "max"), ("max", "max"))
NORMALIZATIONS = ("none", "chunk")
CRITERIA = ("kl", "hard")
HARD_FRACTION = 0.25
"""The answer positions where direct reuse diverges most from full attention, as a share."""
TOP_SINGLES = 5
"""Runs of adjacent layers are tried around this many of the best single layers."""


@dataclass
class CandidateScore:
    """One candidate's means over the calibration samples."""

    layers: tuple[int, ...]
    head_agg: str = "mean"
    row_agg: str = "mean"
    normalize: str = "none"
    context: str = "chunk"
    kl: float = float("nan")
    jaccard: float = float("nan")
    recall: float = float("nan")
    left_at_hard: float = float("nan")
    """Mean over samples of the share of reuse's divergence left at reuse's hardest positions."""
    per_sample_kl: list[float] = field(default_factory=list)
    per_position_kl: list[list[float]] = field(default_factory=list)

    @property
    def variant(self) -> tuple[str, str, str, str]:
        return self.head_agg, self.row_agg, self.normalize, self.context

    @property
    def name(self) -> str:
        agg = "" if self.variant == DEFAULT_VARIANT else f" {'/'.join(self.variant)}"
        return "-".join(map(str, self.layers)) + agg


DEFAULT_VARIANT = ("mean", "mean", "none", "chunk")


@dataclass(frozen=True)
class CalibrationInput:
    """One request to calibrate on: documents ingested as one engine call (`split`: chunked as the
    engine chunks, or each document one chunk, as QA passages are), then the question asked."""

    question: str
    documents: list
    split: bool = True


def needle_seed(seed: int, length: int, i: int) -> int:
    """The seed of the i-th generated calibration input at `length` tokens, from a run's first seed."""
    return seed + 1000 * length + i


def needle_input(length: int, seed: int, i: int, tokenizer) -> CalibrationInput:
    """The i-th generated needle input of about `length` tokens (`offline.niah`; the variants in
    turn), for the run whose first seed is `seed`."""
    sample = generate(VARIANTS[i % len(VARIANTS)], length, needle_seed(seed, length, i), tokenizer)
    return CalibrationInput(sample.question, [sample.context])


def qa_inputs(examples) -> list[CalibrationInput]:
    """QA examples (`offline.qa_data.QAExample`) as calibration inputs: each passage one chunk, in
    order, as `bench qa` asks them."""
    return [CalibrationInput(ex.question, [dict(c) for c in ex.contexts], split=False) for ex in examples]


@dataclass
class _Sample:
    """What one calibration input needs, computed once: the primary's reference signals, the
    aux's per-layer scores per aggregation, and everything to replay a selection."""

    ref: Reference
    reuse_kl: torch.Tensor
    """[T] KL(full || reuse) per answer position: where direct reuse goes wrong."""
    aux_offsets: list[torch.Tensor]
    pri_offsets: list[torch.Tensor]
    texts: list[str]
    aux_scores: dict[tuple[str, str, str], dict[int, list[torch.Tensor]]]
    """(head_agg, row_agg, context) -> {layer: scores per chunk}; joint only where it fits the aux."""
    reference_chars: torch.Tensor


def calibrate(engine: CacheClipEngine, lengths: tuple[int, ...] = (2048,), samples: int = 6,
              **kwargs) -> tuple[Profile, list[CandidateScore]]:
    """Calibrate the model pair of `engine` at `lengths` and add the profile to its store
    (replacing one calibrated at the same lengths); its requests nearest those lengths use it from
    then on. The generated calibration chunks go to a scratch store, never into the engine's.
    kwargs: seed, max_run, ratio, answer_tokens, criterion, progress, inputs, source (as
    `measure_pair`; with `inputs` the profile's length is theirs, not `lengths`).
    Returns (profile, candidate scores)."""
    with tempfile.TemporaryDirectory(prefix="cacheclip-calibrate-") as scratch:
        with CacheClipEngine(engine.primary.lm, engine.aux.lm, scratch, engine.config) as scratch_engine:
            profile, scores = measure_pair(scratch_engine, lengths, samples, **kwargs)
    engine.profiles.write(profile)
    return profile, scores


def measure_pair(
    engine: CacheClipEngine,
    lengths: tuple[int, ...] = (2048,),
    samples: int = 6,
    seed: int = CALIBRATION_SEED_BASE,
    max_run: int = 3,
    ratio: float = 0.2,
    answer_tokens: int = 64,
    criterion: str = "kl",
    progress: bool = True,
    inputs: list[CalibrationInput] | None = None,
    source: str = "",
) -> tuple[Profile, list[CandidateScore]]:
    """Measure every scoring candidate on `engine` (a scratch one: calibration chunks are
    ingested into its store) and return the best as a profile, without storing it.

    criterion: "kl" ranks candidates by mean KL(full || reused) over the answer; "hard" by the
    share of direct reuse's divergence they leave at reuse's hardest quarter of answer positions.
    inputs: requests to calibrate on instead of generated needles (`qa_inputs`; `lengths`,
    `samples` and `seed` are then unused); the profile's length is their median prompt length,
    and `source` (what they are, e.g. a file and its question range) is kept in its record.

    Returns (profile, every layer candidate's scores, best first, then the aggregation variants
    of the best layers).
    """
    if seed < CALIBRATION_SEED_BASE:
        raise ValueError(f"calibration seeds must be >= {CALIBRATION_SEED_BASE} (evaluation uses the ones below), got {seed}")
    if not 0 < ratio < 1:
        raise ValueError(f"calibration ratio must be in (0, 1), got {ratio}")
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {list(CRITERIA)}, got {criterion!r}")
    rank = (lambda c: c.kl) if criterion == "kl" else (lambda c: c.left_at_hard)  # noqa: E731
    n_aux = engine.aux.lm.num_layers
    given = inputs is not None
    if given and not inputs:
        raise ValueError("no calibration inputs given")
    plan = [] if given else [(length, i) for length in lengths for i in range(samples)]
    seeds = [needle_seed(seed, length, i) for length, i in plan]
    if not given:
        inputs = [needle_input(length, seed, i, engine.primary.lm.tokenizer) for length, i in plan]
    prepared = (_prepare(engine, x, answer_tokens) for x in tqdm(inputs, desc="calibration inputs", unit="input",
                                                                  disable=not progress))
    data = [d for d in prepared if d is not None]
    if not data:
        raise ValueError("no calibration sample gave an answer to calibrate against")
    if given:
        lengths = (round(statistics.median(d.ref.layout.num_tokens for d in data)),)

    window, tau = engine.config.select.window, engine.config.select.tau
    bar = tqdm(total=n_aux, desc="calibration candidates", unit="candidate", disable=not progress)

    def measure(cand: CandidateScore) -> CandidateScore:
        bar.update()
        return _measure(engine, data, cand, ratio, window, tau)

    # Every single layer, then the runs of adjacent layers that hold one of the best singles.
    layer_scores = [measure(CandidateScore((i,))) for i in range(n_aux)]
    best_singles = {c.layers[0] for c in sorted(layer_scores, key=rank)[:TOP_SINGLES]}
    runs = sorted({tuple(range(i, i + r)) for r in range(2, max_run + 1) for i in range(n_aux - r + 1)
                   if best_singles & set(range(i, i + r))})
    contexts = [c for c in AUX_CONTEXTS if all((*AGGREGATIONS[0], c) in d.aux_scores for d in data)]
    bar.total += len(runs) + len(AGGREGATIONS) * len(NORMALIZATIONS) * len(contexts) - 1
    bar.refresh()
    layer_scores += [measure(CandidateScore(run)) for run in runs]
    layer_scores.sort(key=lambda c: (rank(c), len(c.layers), -c.jaccard))
    best = layer_scores[0]
    variants = [measure(CandidateScore(best.layers, h, r, nz, ctx))
                for h, r in AGGREGATIONS for nz in NORMALIZATIONS for ctx in contexts
                if (h, r, nz, ctx) != DEFAULT_VARIANT]
    bar.close()
    chosen = min([best, *variants], key=rank)
    baselines = _baselines(engine, data, ratio, seed)
    last = next(c for c in layer_scores if c.layers == (n_aux - 1,))
    by_alignment = max(layer_scores, key=lambda c: (c.jaccard, c.recall))
    measured = {
        "criterion": criterion,
        "kl": chosen.kl,
        "left_at_hard": chosen.left_at_hard,
        "baseline_kl": baselines,
        "jaccard": chosen.jaccard,
        "recall": chosen.recall,
        "last_layer": {"kl": last.kl, "left_at_hard": last.left_at_hard, "jaccard": last.jaccard, "recall": last.recall,
                       "rank": layer_scores.index(last) + 1},
        "best_by_alignment": {"aux_layers": list(by_alignment.layers), "kl": by_alignment.kl,
                              "left_at_hard": by_alignment.left_at_hard,
                              "jaccard": by_alignment.jaccard, "recall": by_alignment.recall},
        "candidates": len(layer_scores) + len(variants),
        "ratio": ratio,
        "seeds": seeds,
        "inputs": source or (f"{len(inputs)} given requests" if given else "generated needles"),
        "answered": len(data),
    }
    profile = Profile(
        primary=engine.primary.lm.fingerprint, aux=engine.aux.lm.fingerprint, aux_layers=chosen.layers,
        head_agg=chosen.head_agg, row_agg=chosen.row_agg, normalize=chosen.normalize, context=chosen.context,
        lengths=tuple(lengths), primary_name=engine.primary.lm.name, aux_name=engine.aux.lm.name,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), measured=measured,
    )
    return profile, layer_scores + sorted(variants, key=rank)


@torch.inference_mode()
def _prepare(engine: CacheClipEngine, sample: CalibrationInput, answer_tokens: int) -> _Sample | None:
    primary, aux = engine.primary, engine.aux
    ids = engine.ingest(sample.documents, progress=False, split=sample.split)
    ref = reference(engine, sample.question, ids, answer_tokens)
    if ref is None:
        return None
    layout = ref.layout
    segs = layout.chunk_segments()
    reuse_kl = kl_positions(ref.full_logprobs, ref.forced(engine, layout.chunk_rows()[:0]))

    prepared = engine.prepare(sample.question, ids)
    aux_kvs = prepared.aux_kvs()
    query_ids = prepared.aux_query_ids()
    every = tuple(range(aux.lm.num_layers))
    args = (aux.lm, prepared.aux_prefix_kv(), aux_kvs, query_ids, every)
    aux_scores = {(*agg, "chunk"): score_chunks_by_layer(*args, *agg) for agg in AGGREGATIONS}
    if joint_positions(prepared.aux_prefix_kv(), aux_kvs, query_ids) <= aux.lm.max_positions:
        aux_scores |= {(*agg, "joint"): score_joint_by_layer(*args, *agg) for agg in AGGREGATIONS}

    query_rows = torch.arange(segs[-1].end, layout.num_tokens)
    attention = attention_from_rows(primary.lm, layout.input_ids, query_rows, [-1])[-1]
    pri_offsets = [seg.offsets for seg in segs]
    reference_chars = torch.cat([to_chars(attention[seg.start : seg.end], off, len(seg.text))
                                 for seg, off in zip(segs, pri_offsets)])
    return _Sample(ref, reuse_kl, [kv.offsets for kv in aux_kvs], pri_offsets, [seg.text for seg in segs],
                   aux_scores, reference_chars)


def _left_at_hard(kl: torch.Tensor, reuse_kl: torch.Tensor, frac: float = HARD_FRACTION) -> float:
    """Share of direct reuse's divergence a candidate leaves at the positions where reuse
    diverges most (its top `frac` of answer positions): 0 = fixed, 1 = as bad as reuse."""
    k = max(1, round(frac * reuse_kl.numel()))
    hard = torch.topk(reuse_kl, k).indices
    total = float(reuse_kl[hard].sum())
    return float(kl[hard].sum()) / total if total > 0 else 0.0


def _baselines(engine: CacheClipEngine, data: list[_Sample], ratio: float, seed: int) -> dict[str, float]:
    """The scale of the KL column: reuse (nothing recomputed) and random rows at the ratio."""
    gen = torch.Generator().manual_seed(seed)
    reuse, random = [], []
    random_hard = []
    for d in data:
        chunk_rows = d.ref.layout.chunk_rows()
        pick = chunk_rows[torch.randperm(chunk_rows.numel(), generator=gen)[: round(ratio * chunk_rows.numel())]]
        reuse.append(float(d.reuse_kl.mean()))
        kl = kl_positions(d.ref.full_logprobs, d.ref.forced(engine, pick))
        random.append(float(kl.mean()))
        random_hard.append(_left_at_hard(kl, d.reuse_kl))
    return {"reuse": statistics.mean(reuse), "random": statistics.mean(random),
            "random_left_at_hard": statistics.mean(random_hard)}


def _measure(engine: CacheClipEngine, data: list[_Sample], cand: CandidateScore, ratio: float, window: int, tau: int) -> CandidateScore:
    kls, jacs, recs, hards, positions = [], [], [], [], []
    for d in data:
        by_layer = d.aux_scores[(cand.head_agg, cand.row_agg, cand.context)]
        scores = normalized(mean_over_layers({layer: by_layer[layer] for layer in cand.layers}), cand.normalize)
        kept = keep_budget(scores, ratio, window, tau)
        rows = [seg.start + torch.nonzero(map_tokens(a_off, k, p_off, len(text))).flatten()
                for seg, a_off, k, p_off, text in zip(d.ref.layout.chunk_segments(), d.aux_offsets, kept, d.pri_offsets, d.texts)]
        kl = kl_positions(d.ref.full_logprobs, d.ref.forced(engine, torch.cat(rows)))
        kls.append(float(kl.mean()))
        hards.append(_left_at_hard(kl, d.reuse_kl))
        positions.append([round(x, 6) for x in kl.tolist()])
        signal = torch.cat([to_chars(s, off, len(text)) for s, off, text in zip(scores, d.aux_offsets, d.texts)])
        jacs.append(top_jaccard(signal, d.reference_chars))
        ref_top = top_positions(d.reference_chars, 0.05)
        recs.append(len(top_positions(signal, 0.2) & ref_top) / len(ref_top))
    cand.kl, cand.jaccard, cand.recall = statistics.mean(kls), statistics.mean(jacs), statistics.mean(recs)
    cand.per_sample_kl, cand.left_at_hard, cand.per_position_kl = kls, statistics.mean(hards), positions
    log.info("candidate %s: KL %.4f, left at hard %.3f, Jaccard %.3f, recall %.3f",
             cand.name, cand.kl, cand.left_at_hard, cand.jaccard, cand.recall)
    return cand


def table(scores: list[CandidateScore], n_aux: int, top: int = 12) -> str:
    """The best candidates, the aggregation variants of the best layers, then every single layer."""
    def row(name: str, s: CandidateScore) -> str:
        return f"{name:<24} {s.kl:>11.4f} {s.left_at_hard:>8.3f} {s.jaccard:>8.3f} {s.recall:>10.3f}"

    head = f"{'aux layers':<24} {'KL(full||·)':>11} {'hard':>8} {'Jaccard':>8} {'recall@5%':>10}"
    lines = [head, "-" * len(head)]
    lines += [row(s.name, s) for s in scores[:top]]
    variants = [s for s in scores if s.variant != DEFAULT_VARIANT]
    if variants:
        lines += ["", "aggregation of the best layers:"] + [row(s.name, s) for s in variants]
    singles = sorted((x for x in scores if len(x.layers) == 1 and x not in variants), key=lambda x: x.layers)
    lines += ["", "per single layer:", head.replace("aux layers", "layer     "), "-" * len(head)]
    lines += [row(str(s.layers[0]), s) for s in singles]
    lines += ["", "KL: mean KL(full || reused) over full attention's teacher-forced answer; hard: share of direct",
              "reuse's divergence left at its hardest quarter of answer positions; Jaccard / recall@5%: alignment",
              "with the primary's last-layer attention (top-20% characters)."]
    return "\n".join(lines)
