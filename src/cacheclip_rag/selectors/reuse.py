"""`reuse`: the chunk caches concatenated behind one shared prefix; only plain text is computed."""

from __future__ import annotations

from ..request.plan import Plan
from ..request.selector import Selector, register


class Reuse(Selector):
    name = "reuse"
    fixed_ratio = 0.0

    def plan(self, prepared) -> Plan:
        return Plan()


register(Reuse())
