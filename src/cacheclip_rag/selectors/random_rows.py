"""`random`: a uniform random choice of round(ratio x chunk rows), seeded by the request."""

from __future__ import annotations

import torch

from ..request.plan import Plan
from ..request.selector import Selector, register
from .budget import row_count


class RandomRows(Selector):
    name = "random"

    def plan(self, prepared) -> Plan:
        chunk_rows = prepared.layout.chunk_rows()
        k = row_count(prepared.request.ratio, chunk_rows.numel())
        gen = torch.Generator().manual_seed(prepared.request.seed)
        return Plan(rows=chunk_rows[torch.randperm(chunk_rows.numel(), generator=gen)[:k]])


register(RandomRows())
