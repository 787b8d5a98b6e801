"""`full`: an ordinary prefill of the whole request (the quality reference)."""

from __future__ import annotations

from ..request.plan import Plan
from ..request.selector import Selector, register


class Full(Selector):
    name = "full"
    fixed_ratio = 1.0

    def plan(self, prepared) -> Plan:
        return Plan(rows=prepared.layout.chunk_rows(), full_prefill=True)


register(Full())
