"""How sure a bench average is: stratified bootstrap intervals over samples.

The needle bench reports the average over variants of each variant's mean score, on a handful of
samples per variant, so one flipped answer moves it by several points. These intervals resample
samples within each variant (the strata), which keeps every variant's weight fixed, and are
seeded, so a table is reproducible. For a difference between two modes, pass the per-sample
differences on the same samples (paired): the interval then excludes the sample-to-sample spread
both modes share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

RESAMPLES = 4000
LEVEL = 0.95


def mean_of_means(groups: Mapping[str, Sequence[float]]) -> float:
    """The average over groups of each group's mean (the bench's `avg`)."""
    return float(np.mean([np.mean(v) for v in groups.values()]))


def bootstrap_interval(
    groups: Mapping[str, Sequence[float]], *, resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0
) -> tuple[float, float]:
    """Percentile interval of `mean_of_means`, resampling each group's values with replacement.

    groups: name -> values (one per sample); every group needs at least one value. A group of one
    value contributes no spread, so with one sample per group the interval collapses to a point.
    """
    if not groups or any(len(v) == 0 for v in groups.values()):
        raise ValueError(f"every group needs at least one value, got sizes {({k: len(v) for k, v in groups.items()})}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    total = np.zeros(resamples)
    for name in sorted(groups):
        values = np.asarray(groups[name], dtype=float)
        picks = rng.integers(0, len(values), size=(resamples, len(values)))
        total += values[picks].mean(axis=1)
    total /= len(groups)
    tail = (1 - level) / 2
    lo, hi = np.quantile(total, [tail, 1 - tail])
    return float(lo), float(hi)


def nanmean(values: Sequence[float]) -> float:
    """The mean of the values that are not nan (nan where none is)."""
    kept = [v for v in values if v == v]
    return float(np.mean(kept)) if kept else float("nan")


def median_or_zero(values: Sequence[float]) -> float:
    """The median of the values (0 where there are none: a stage a request never timed)."""
    return float(np.median(values)) if len(values) else 0.0
