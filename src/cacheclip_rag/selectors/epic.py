"""`epic`: EPIC's static selection (arXiv:2410.15332): the first tokens of every chunk, where each
chunk's own attention sink sits."""

from __future__ import annotations

import torch

from ..request.plan import Plan
from ..request.selector import Selector, register
from .budget import row_count


class Epic(Selector):
    name = "epic"

    def plan(self, prepared) -> Plan:
        request = prepared.request
        parts = []
        for seg in prepared.layout.chunk_segments():
            n = request.epic_tokens if request.epic_tokens is not None else row_count(request.ratio, seg.end - seg.start, up=True)
            parts.append(torch.arange(seg.start, min(seg.end, seg.start + n)))
        return Plan(rows=torch.cat(parts) if parts else torch.empty(0, dtype=torch.long))


register(Epic())
