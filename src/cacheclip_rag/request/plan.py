"""What a selector returns: the `Plan` of one request (selector.py holds the methods' registry).

A plan says which chunk rows the primary recomputes (plain-text rows, the question and
separators, are always recomputed), and any change to attention the method makes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .recompute import LayerHook


@dataclass(frozen=True)
class Plan:
    """What a request recomputes.

    rows: [S] chunk rows (sequence indices) to recompute, besides every plain-text row.
    full_prefill: run an ordinary prefill of the whole sequence instead (the `full` mode).
    positions: [N] RoPE position per sequence index, where a method moves tokens; None: the
        index itself. hook: what the method changes inside the layer loop (rows it drops at a
        layer, attention of its own), in recompute and decoding; None: nothing.
    trace: per chunk, what the selector saw and chose (for display: `AnswerStream.trace`).
    seconds: time spent planning.
    """

    rows: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    full_prefill: bool = False
    positions: torch.Tensor | None = None
    hook: LayerHook | None = None
    trace: tuple[dict, ...] = ()
    seconds: float = 0.0


