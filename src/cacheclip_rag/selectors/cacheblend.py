"""`cacheblend`: CacheBlend's selection (arXiv:2405.16444). Every chunk row is recomputed up to
the check layer; there the rows whose K (or V) deviates most from the cached one are kept, the
rest stop; the kept rows run through every later layer."""

from __future__ import annotations

import torch

from ..request.plan import Plan
from ..request.recompute import BlendSpec
from ..request.selector import Selector, register


class CacheBlend(Selector):
    name = "cacheblend"
    row_set = False

    def plan(self, prepared) -> Plan:
        layout, base = prepared.layout, prepared.config.baselines
        chunk_rows = layout.chunk_rows()
        candidates = torch.zeros(layout.num_tokens, dtype=torch.bool)
        candidates[chunk_rows] = True
        blend = BlendSpec(candidates, prepared.request.ratio, base.cacheblend_check_layer, base.cacheblend_on)
        return Plan(rows=chunk_rows, blend=blend)


register(CacheBlend())
