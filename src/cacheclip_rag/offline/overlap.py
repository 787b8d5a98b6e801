"""Character-space overlap of two token weightings of one text (two tokenizers compared).
"""

from __future__ import annotations

import torch


def to_chars(weights: torch.Tensor, offsets: torch.Tensor, n_chars: int) -> torch.Tensor:
    """Token weights [T] -> character weights [n_chars] (fp64): each token's weight spread evenly
    over its characters (offsets [T, 2]); characters beyond n_chars are cut."""
    starts = offsets[:, 0].clamp(0, n_chars)
    ends = offsets[:, 1].clamp(0, n_chars)
    ok = ends > starts
    per_char = weights.double()[ok] / (ends - starts)[ok]
    diff = torch.zeros(n_chars + 1, dtype=torch.float64)  # + where a token's span opens, - where it closes
    diff.index_add_(0, starts[ok], per_char)
    diff.index_add_(0, ends[ok], -per_char)
    return diff.cumsum(0)[:n_chars]


def top_positions(x: torch.Tensor, frac: float) -> set[int]:
    """Indices of the top `frac` of x (at least one; ties broken by position)."""
    k = max(1, int(frac * x.numel()))
    return set(torch.argsort(x, descending=True, stable=True)[:k].tolist())


def top_jaccard(a: torch.Tensor, b: torch.Tensor, frac: float = 0.2) -> float:
    sa, sb = top_positions(a, frac), top_positions(b, frac)
    return len(sa & sb) / len(sa | sb)
