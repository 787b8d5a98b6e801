"""`ape`: APE's parallel encoding (arXiv:2502.05431). Every chunk sits at the positions right
after the shared prefix, as it was cached (no re-rotation), and the query's attention to context
keys is sharpened by a temperature T and rescaled by S; nothing in the context is recomputed."""

from __future__ import annotations

import torch

from ..request.assemble import ape_positions
from ..request.plan import Plan
from ..request.recompute import ApeSpec
from ..request.selector import Selector, register


class Ape(Selector):
    name = "ape"
    fixed_ratio = 0.0
    row_set = False

    def plan(self, prepared) -> Plan:
        layout, base = prepared.layout, prepared.config.baselines
        context = torch.zeros(layout.num_tokens + prepared.request.options.max_new_tokens, dtype=torch.bool)
        context[layout.chunk_rows()] = True
        return Plan(positions=ape_positions(layout), ape=ApeSpec(context, base.ape_temperature, base.ape_scale))


register(Ape())
