"""`cacheclip calibrate --auto-share`: calibrate recompute_ratio="auto" for a model pair, the aux
attention share whose mean recomputed fraction equals a fixed ratio (`calibrate_share`)."""

from __future__ import annotations

import dataclasses
import logging
import statistics
import tempfile

import torch
from tqdm.auto import tqdm

from ..engine import CacheClipEngine
from ..selectors.aux_scores import aux_scores
from ..selectors.budget import mass_ratio
from ..selectors.cacheclip import CacheClip
from ..storage.profiles import Profile
from .calibrate import CALIBRATION_SEED_BASE, needle_input

log = logging.getLogger(__name__)


@torch.inference_mode()
def calibrate_share(engine: CacheClipEngine, lengths: tuple[int, ...] = (2048,), samples: int = 6, ratio: float = 0.2,
                    seed: int = CALIBRATION_SEED_BASE, progress: bool = True) -> list[Profile]:
    """Calibrate recompute_ratio="auto" for the model pair of `engine`: per length, the aux
    attention share whose mean recomputed fraction over generated inputs (seeds from `seed`, in a
    scratch store) equals `ratio`, so that "auto" spends on average what that fixed ratio spends
    and differs only in where: less on questions whose scores concentrate, more where they spread.
    Scores come from the profile each request would use; the profiles, with `auto_share` set, are
    written to the engine's store and returned."""
    if seed < CALIBRATION_SEED_BASE:
        raise ValueError(f"calibration seeds must be >= {CALIBRATION_SEED_BASE} (evaluation uses the ones below), got {seed}")
    if not 0 < ratio < 1:
        raise ValueError(f"calibration ratio must be in (0, 1), got {ratio}")
    out = []
    with tempfile.TemporaryDirectory(prefix="cacheclip-calibrate-") as scratch, \
            CacheClipEngine(engine.primary.lm, engine.aux.lm, scratch, engine.config) as work:
        for length in lengths:
            profile = engine.profiles.nearest(length)
            if profile is None:
                raise ValueError(f"no calibrated profile for this pair near {length} tokens: run `cacheclip calibrate` first")
            scores, cfg = [], None
            for i in tqdm(range(samples), desc=f"auto share at {length}", disable=not progress):
                sample = needle_input(length, seed, i, work.primary.lm.tokenizer)
                ids = work.ingest(sample.documents, progress=False, split=sample.split)
                prepared = work.prepare(sample.question, ids, recompute_ratio=ratio)
                # scored as the calibrated engine would (the scratch engine's store has no profile)
                select = engine.profiles.settings(prepared.layout.num_tokens)
                prepared = dataclasses.replace(prepared, request=dataclasses.replace(prepared.request, select=select))
                cfg, aux_kvs, query_ids = CacheClip.scoring(prepared)
                scores.append(aux_scores(work.aux.lm, cfg, prepared.aux_prefix_kv(), aux_kvs, query_ids))
            share = share_for(scores, ratio, cfg.auto_floor, cfg.auto_cap)
            log.info("auto share at %d tokens: %.4f (mean fraction %.3f)", length, share, ratio)
            updated = dataclasses.replace(profile, auto_share=share, source="store")
            engine.profiles.write(updated)
            out.append(updated)
    return out


def share_for(scores: list[list[torch.Tensor]], ratio: float, floor: float, cap: float) -> float:
    """The share in (0, 1] whose mean `mass_ratio` over the samples is `ratio` (bisection: the
    mean grows with the share)."""
    def mean_fraction(share: float) -> float:
        return statistics.mean(mass_ratio(s, share, floor, cap) for s in scores)

    lo, hi = 1e-4, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_fraction(mid) < ratio else (lo, mid)
    return round(hi, 4)
