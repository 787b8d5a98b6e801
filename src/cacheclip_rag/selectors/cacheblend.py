"""`cacheblend`: CacheBlend's selection (arXiv:2405.16444). Every chunk row is recomputed up to
the check layer; there the rows whose K (or V) deviates most from the cached one are kept, the
rest stop; the kept rows run through every later layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..request.plan import Plan
from ..request.recompute import LayerHook
from ..request.selector import Selector, register
from .budget import row_count


@dataclass(frozen=True)
class BlendSpec(LayerHook):
    """CacheBlend's selection, made inside the layer loop.

    Every row is recomputed up to `check_layer`; there the rows among `candidates` ([N] bool,
    N covering the decoded rows too) whose new K (or V) deviates most from the cached one are
    kept (`row_count(ratio, candidates)`), with every non-candidate row; only those continue to
    the later layers. Decoded rows are never candidates, so decoding keeps them.
    """

    candidates: torch.Tensor
    ratio: float
    check_layer: int = 1
    on: str = "k"

    def keep(self, layer, rows, k_new, v_new, k_old, v_old):
        if layer != self.check_layer:
            return None
        return blend_keep(self, rows, k_new, v_new, k_old, v_old)


def blend_keep(spec: BlendSpec, rows, k_new, v_new, k_old, v_old) -> torch.Tensor:
    """Indices (into rows [M]) kept by CacheBlend at its check layer."""
    new, old = (k_new, k_old) if spec.on == "k" else (v_new, v_old)
    candidates = spec.candidates.to(rows.device)
    is_candidate = torch.zeros_like(rows, dtype=torch.bool)
    inside = rows < candidates.numel()
    is_candidate[inside] = candidates[rows[inside]]
    deviation = (new.float() - old.float()).pow(2).sum(dim=(0, 1, 3))  # [M]
    n_keep = row_count(spec.ratio, int(is_candidate.sum()))
    deviation = torch.where(is_candidate, deviation, torch.tensor(float("-inf")))
    chosen = torch.topk(deviation, n_keep).indices if n_keep else torch.empty(0, dtype=torch.long)
    keep = ~is_candidate
    keep[chosen] = True
    return torch.nonzero(keep).flatten()


class CacheBlend(Selector):
    name = "cacheblend"
    row_set = False

    def plan(self, prepared) -> Plan:
        layout, base = prepared.layout, prepared.config.baselines
        chunk_rows = layout.chunk_rows()
        candidates = torch.zeros(layout.num_tokens, dtype=torch.bool)
        candidates[chunk_rows] = True
        blend = BlendSpec(candidates, prepared.request.ratio, base.cacheblend_check_layer, base.cacheblend_on)
        return Plan(rows=chunk_rows, hook=blend)


register(CacheBlend())
