"""From token scores to the tokens a selector keeps: candidates, grouping, the budget.

The top k = round(ratio x all chunk tokens) become candidates, sliding-window grouping keeps
dense runs whole and drops isolated candidates (the paper's rule), or candidates are added in
score order until the grouped set reaches the budget ("keep"); kept aux tokens are mapped to
primary tokens through character offsets. recompute_ratio "auto" sizes the budget from the
scores' mass (`mass_ratio`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import SelectConfig


def row_count(ratio: float, n: int, up: bool = False) -> int:
    """How many of n rows a ratio recomputes: round(ratio x n), or ceil with `up` (EPIC's
    per-chunk budget, at least one row of any chunk). The one rule every selector sizes by."""
    return math.ceil(ratio * n) if up else round(ratio * n)


@dataclass
class ChunkSelection:
    """Per chunk, in aux token space: scores [La], candidates and grouped keep masks [La] bool."""

    scores: torch.Tensor
    candidates: torch.Tensor
    kept: torch.Tensor


def top_k_candidates(scores: list[torch.Tensor], ratio: float) -> list[torch.Tensor]:
    """Global top k = round(ratio x total tokens) over all chunks; one bool mask per chunk."""
    total = sum(int(s.numel()) for s in scores)
    k = row_count(ratio, total)
    flat = torch.zeros(total, dtype=torch.bool)
    if k > 0:
        flat[torch.topk(torch.cat(scores), k).indices] = True
    return list(flat.split([int(s.numel()) for s in scores]))


def group_window(candidates: torch.Tensor, window: int, tau: int) -> torch.Tensor:
    """Sliding-window grouping over one chunk's candidate mask [L] -> kept mask [L].

    A window of `window` tokens is evaluated only where it starts on a candidate; it is clipped
    at the sequence end. If it holds at least `tau` candidates, every token in it is kept, gaps
    included. Candidates covered by no passing window are dropped.
    """
    return group_windows(candidates, [int(candidates.numel())], window, tau)


def group_windows(candidates: torch.Tensor, sizes: list[int], window: int, tau: int) -> torch.Tensor:
    """`group_window` of every chunk at once: candidates [sum(sizes)] holds the chunks' masks end
    to end (chunk i has sizes[i] tokens); no window crosses from one chunk into the next.
    Returns the kept mask [sum(sizes)]."""
    n = int(candidates.numel())
    if n == 0:
        return candidates.clone()
    sizes_t = torch.tensor(sizes, dtype=torch.long)
    chunk_start = torch.repeat_interleave(torch.cumsum(sizes_t, 0) - sizes_t, sizes_t)  # [n] first index of its chunk
    chunk_end = chunk_start + torch.repeat_interleave(sizes_t, sizes_t)
    c = torch.cat([torch.zeros(1, dtype=torch.long), candidates.long().cumsum(0)])
    starts = torch.arange(n)
    ends = torch.minimum(starts + window, chunk_end)
    passing = candidates & ((c[ends] - c[starts]) >= tau)
    # Token j is kept if a passing window starts in (j - window, j] within its own chunk.
    s = torch.cat([torch.zeros(1, dtype=torch.long), passing.long().cumsum(0)])
    lo = torch.maximum(starts - window + 1, chunk_start)
    return (s[starts + 1] - s[lo]) > 0


def map_tokens(src_offsets: torch.Tensor, src_selected: torch.Tensor, dst_offsets: torch.Tensor, n_chars: int) -> torch.Tensor:
    """Select every destination token whose character span overlaps a selected source token's span.

    src_offsets [S, 2], src_selected [S] bool, dst_offsets [T, 2] (character spans of the same
    text under two tokenizers). A zero-width span counts as covering its start character.
    Returns [T] bool.
    """
    sel = src_offsets[src_selected].clamp(0, n_chars)
    sel_end = torch.maximum(sel[:, 1], sel[:, 0] + 1)
    diff = torch.zeros(n_chars + 2, dtype=torch.long)  # +1 where a span opens, -1 where it closes
    diff.index_add_(0, sel[:, 0], torch.ones_like(sel[:, 0]))
    diff.index_add_(0, sel_end, -torch.ones_like(sel_end))
    covered = (diff.cumsum(0)[: n_chars + 1] > 0).long()  # [n_chars + 1] character covered?
    cum = torch.cat([torch.zeros(1, dtype=torch.long), covered.cumsum(0)])
    starts = dst_offsets[:, 0].clamp(0, n_chars)
    ends = torch.maximum(dst_offsets[:, 1], dst_offsets[:, 0] + 1).clamp(0, n_chars + 1)
    return (cum[ends] - cum[starts]) > 0


def keep_budget(scores: list[torch.Tensor], ratio: float, window: int, tau: int) -> list[torch.Tensor]:
    """Budget-keeping: the fewest top-scored candidates whose grouped set reaches ratio x tokens.

    Grouping only grows as candidates are added (a window that passes keeps passing and new
    candidates open new windows), so a binary search over the candidate count finds the step
    where the grouped size crosses the target; the side of that step closer to the target is
    returned, so the kept total is within one window of it. Returns one kept mask per chunk.
    """
    sizes = [int(s.numel()) for s in scores]
    total = sum(sizes)
    target = row_count(ratio, total)
    if target <= 0:
        return [torch.zeros(n, dtype=torch.bool) for n in sizes]
    order = torch.argsort(torch.cat(scores), descending=True, stable=True)

    def grouped(k: int) -> list[torch.Tensor]:
        flat = torch.zeros(total, dtype=torch.bool)
        flat[order[:k]] = True
        return list(group_windows(flat, sizes, window, tau).split(sizes))

    def size(kept: list[torch.Tensor]) -> int:
        return sum(int(m.sum()) for m in kept)

    everything = grouped(total)
    if size(everything) < target:  # chunks shorter than tau can never pass a window
        return everything
    lo, hi = 1, total
    while lo < hi:
        mid = (lo + hi) // 2
        if size(grouped(mid)) >= target:
            hi = mid
        else:
            lo = mid + 1
    over, under = grouped(lo), grouped(lo - 1)
    # One more candidate can add up to two windows of tokens; take whichever side is closer.
    return over if size(over) - target <= target - size(under) else under


def mass_ratio(scores: list[torch.Tensor], share: float, floor: float, cap: float) -> float:
    """recompute_ratio "auto": the fraction of tokens that the fewest top-scored ones holding
    `share` of the total score mass make up, kept within [floor, cap]. A question whose answer
    sits in one place concentrates its mass on few tokens and recomputes little; one that reads
    several places spreads it and recomputes more."""
    flat = torch.cat(scores).float()
    total = float(flat.sum())
    if flat.numel() == 0 or total <= 0:
        return cap
    cum = torch.cumsum(torch.sort(flat, descending=True).values, 0)
    needed = int(torch.searchsorted(cum, share * total).item()) + 1
    return min(max(needed / flat.numel(), floor), cap)


def pick(scores: list[torch.Tensor], ratio: float, cfg: SelectConfig, budget: str = "keep") -> list[ChunkSelection]:
    """Scores -> candidates -> kept tokens, under the paper's rule or budget-keeping."""
    if budget == "keep":
        kept = keep_budget(scores, ratio, cfg.window, cfg.tau)
        return [ChunkSelection(s, k.clone(), k) for s, k in zip(scores, kept)]
    candidates = top_k_candidates(scores, ratio)
    sizes = [int(c.numel()) for c in candidates]
    kept = group_windows(torch.cat(candidates), sizes, cfg.window, cfg.tau).split(sizes)
    return [ChunkSelection(s, c, k) for s, c, k in zip(scores, candidates, kept)]
