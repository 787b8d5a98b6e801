"""`ape`: APE's parallel encoding (arXiv:2502.05431). Every chunk sits at the positions right
after the shared prefix, as it was cached (no re-rotation), and the query's attention to context
keys is sharpened by a temperature T and rescaled by S; nothing in the context is recomputed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from cacheclip_kernels import causal_position_mask

from ..request.assemble import Layout
from ..request.plan import Plan
from ..request.recompute import LayerHook
from ..request.selector import Selector, register


def ape_positions(layout: Layout) -> torch.Tensor:
    """RoPE positions for APE: every chunk starts where the first one does, right after the
    prefix and any plain text before it (parallel encoding); plain text after a chunk continues
    after the longest chunk. Returns [N]."""
    positions = torch.arange(layout.num_tokens)
    frontier = layout.prefix_len
    base = None  # where the parallel chunks start
    for seg in layout.segments:
        n = seg.end - seg.start
        if seg.cached and base is None:
            base = frontier
        start = base if seg.cached else frontier
        positions[seg.start : seg.end] = torch.arange(start, start + n)
        frontier = max(frontier, start + n)
    return positions


@dataclass(frozen=True)
class ApeSpec(LayerHook):
    """APE's query-phase calibration, applied at every layer (`attend_ape`).

    context: [N] bool, True for chunk tokens (the parallel-encoded contexts); everything else
    (shared prefix, plain text, the query, generated tokens) is the other group.
    temperature T and scale S act on that other group, as in APE's reference code.
    """

    context: torch.Tensor
    temperature: float = 1.0
    scale: float = 1.0

    def attend(self, q, keys, values, q_rows, scale, window):
        return attend_ape(q, keys, values, q_rows, scale, self, window)


def attend_ape(q, k, v, q_idx, scale: float, ape: ApeSpec, window: int | None = None) -> torch.Tensor:
    """APE's attention for the rows computed after the parallel contexts (torch path).

    As APE's reference code computes it (`prefill_query`: two attention calls merged through
    their log-sum-exps), keys fall in two groups: C, the parallel contexts, attended as usual;
    and A, every other visible key (shared prefix, plain text, the query so far), whose logits
    are divided by T and whose log-sum-exp is multiplied by S * T before the merge. In one
    softmax that is, per row, logit s/T + (S*T - 1) * lse_A(s/T) for a key in A and s for a key
    in C. T = S = 1 is ordinary attention. Causal by sequence index, like `recompute.attend`.
    q [B, H, M, D]; k, v [B, H_kv, N, D]; q_idx [B, M]. Returns [B, H, M, D].
    """
    n = k.shape[2]
    other = ~ape.context[:n].to(k.device)  # [N]: prefix, plain text, query, generated
    k = torch.where(other[None, None, :, None], k / ape.temperature, k)  # their logits / T
    visible = causal_position_mask(q_idx, n, window)  # [B, 1, M, N]
    cols = torch.nonzero(other).flatten()  # few: the contexts are most of the sequence
    group = q.shape[1] // k.shape[1]
    k_other = k[:, :, cols].repeat_interleave(group, dim=1)
    logits = torch.matmul(q.float(), k_other.float().transpose(-1, -2)) * scale  # [B, H, M, |other|]
    lse = logits.masked_fill(~visible[..., cols], float("-inf")).logsumexp(dim=-1, keepdim=True)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # [B, H, M, 1]
    bias = torch.where(other, (ape.scale * ape.temperature - 1.0) * lse, torch.zeros_like(lse))  # [B, H, M, N]
    bias = bias.masked_fill(~visible, float("-inf")).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=group > 1)


class Ape(Selector):
    name = "ape"
    fixed_ratio = 0.0
    row_set = False

    def plan(self, prepared) -> Plan:
        layout, base = prepared.layout, prepared.config.baselines
        context = torch.zeros(layout.num_tokens + prepared.request.options.max_new_tokens, dtype=torch.bool)
        context[layout.chunk_rows()] = True
        return Plan(positions=ape_positions(layout), hook=ApeSpec(context, base.ape_temperature, base.ape_scale))


register(Ape())
