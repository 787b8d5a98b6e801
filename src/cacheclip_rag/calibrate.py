"""Calibrate which aux layers score tokens for a model pair (label-free).

On generated needle-style inputs whose seeds are disjoint from every evaluation seed, the
primary model's own last-layer attention from the question rows over the context (a full
prefill, projected into character space) is the reference. Each aux layer, and each run of 2 or
3 adjacent layers (their character-space distributions averaged), is scored by the Jaccard index
of its top-20% characters against the reference's top 20%, and by the recall of the reference's
top-5% characters inside its own top 20%. The best candidate by Jaccard (recall breaks ties)
becomes the pair's profile, stored with the store and used by the engine by default.
"""

from __future__ import annotations

import datetime as _dt
import statistics
from dataclasses import dataclass

import torch

from .chunking import encode_text
from .eval.alignment import to_chars, top_jaccard
from .eval.niah import generate
from .models import LoadedModel
from .select import attention_from_rows

CALIBRATION_SEED_BASE = 1_000_000
"""Calibration seeds start here; evaluation seeds (bench niah --seed) must stay below it."""
VARIANTS = ("multikey_1", "multivalue", "multiquery", "single_2")


@dataclass
class LayerScore:
    layers: tuple[int, ...]
    jaccard: float
    recall: float


def _top(x: torch.Tensor, frac: float) -> set[int]:
    k = max(1, int(frac * x.numel()))
    return set(torch.argsort(x, descending=True, stable=True)[:k].tolist())


def _context_attention(lm: LoadedModel, text: str, n_context: int, layers: list[int]) -> dict[int, torch.Tensor]:
    """Attention of the question rows (tokens after the context) over the context, per layer,
    in character space normalised to sum 1."""
    ids, offsets = encode_text(lm.tokenizer, text)
    ids_t, offsets_t = torch.tensor(ids), torch.tensor(offsets).reshape(-1, 2)
    rows = torch.nonzero(offsets_t[:, 0] >= n_context).flatten()
    attention = attention_from_rows(lm, ids_t, rows, layers)
    out = {}
    for layer, weights in attention.items():
        chars = to_chars(weights, offsets_t, n_context)
        out[layer] = chars / chars.sum() if chars.sum() > 0 else chars
    return out


def calibrate(
    primary: LoadedModel,
    aux: LoadedModel,
    lengths: tuple[int, ...] = (1024,),
    samples: int = 8,
    seed: int = CALIBRATION_SEED_BASE,
    max_run: int = 3,
) -> tuple[dict, list[LayerScore]]:
    """Returns (profile, every candidate's mean score, best first)."""
    if seed < CALIBRATION_SEED_BASE:
        raise ValueError(f"calibration seeds must be >= {CALIBRATION_SEED_BASE} (evaluation uses the ones below), got {seed}")
    n_aux = aux.num_layers
    candidates = [tuple(range(i, i + r)) for r in range(1, max_run + 1) for i in range(n_aux - r + 1)]
    jac: dict[tuple[int, ...], list[float]] = {c: [] for c in candidates}
    rec: dict[tuple[int, ...], list[float]] = {c: [] for c in candidates}
    seeds = []
    for length in lengths:
        for i in range(samples):
            s = seed + 1000 * length + i
            seeds.append(s)
            sample = generate(VARIANTS[i % len(VARIANTS)], length, s, primary.tokenizer)
            text = sample.context + "\n\nQuestion: " + sample.question + "\nAnswer:"
            n_ctx = len(sample.context)
            reference = _context_attention(primary, text, n_ctx, [-1])[-1]
            ref_top5 = _top(reference, 0.05)
            per_layer = _context_attention(aux, text, n_ctx, list(range(n_aux)))
            for cand in candidates:
                mixed = torch.stack([per_layer[layer] for layer in cand]).mean(dim=0)
                jac[cand].append(top_jaccard(mixed, reference))
                rec[cand].append(len(_top(mixed, 0.2) & ref_top5) / len(ref_top5))
    scores = sorted(
        (LayerScore(c, statistics.mean(jac[c]), statistics.mean(rec[c])) for c in candidates),
        key=lambda x: (-x.jaccard, -x.recall, len(x.layers)),
    )
    best = scores[0]
    last = next(x for x in scores if x.layers == (n_aux - 1,))
    profile = {
        "primary": primary.fingerprint,
        "aux": aux.fingerprint,
        "primary_name": primary.name,
        "aux_name": aux.name,
        "aux_layers": list(best.layers),
        "head_agg": "mean",
        "row_agg": "mean",
        "jaccard": best.jaccard,
        "recall": best.recall,
        "last_layer": {"jaccard": last.jaccard, "recall": last.recall, "rank": scores.index(last) + 1},
        "candidates": len(scores),
        "lengths": list(lengths),
        "seeds": seeds,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    return profile, scores


def table(scores: list[LayerScore], n_aux: int, top: int = 12) -> str:
    """The best candidates, then every single layer (the per-layer view)."""
    lines = [f"{'aux layers':<12} {'Jaccard':>8} {'recall@5%':>10}", "-" * 32]
    for s in scores[:top]:
        lines.append(f"{'-'.join(map(str, s.layers)):<12} {s.jaccard:>8.3f} {s.recall:>10.3f}")
    lines += ["", "per single layer:", f"{'layer':<6} {'Jaccard':>8} {'recall@5%':>10}"]
    for s in sorted((x for x in scores if len(x.layers) == 1), key=lambda x: x.layers):
        lines.append(f"{s.layers[0]:<6} {s.jaccard:>8.3f} {s.recall:>10.3f}")
    return "\n".join(lines)
