"""Selective recompute: run chosen rows through the primary model, layer by layer, in context.

The rows (selected chunk tokens, every uncached segment, the question) are computed at their
full-context positions. At each layer their new K/V are written into the assembled cache first,
then each row attends causally, by absolute position, to the whole cache, where rows recomputed
at this layer already hold their new K/V. With every non-prefix row selected this is exactly a
full prefill; with only the uncached rows it is exactly direct reuse.

The decoder layers are driven through their own submodules by the model's family adapter
(`cacheclip_rag.models.families`: norms, RoPE per layer type, projections, MLP), so the weights and
numerics are transformers' own; only the attention call is ours, behind `attend`, with each
layer's sliding window (if any) applied by index distance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from cacheclip_kernels import (
    BlockPlan,
    blocked_attention,
    causal_position_mask,
    default_kind,
    sparse_query_attention,
    sparse_query_attention_ref,
)

from ..models.loading import LoadedModel
from .assemble import AssembledCache


def uses_kernel(backend: str, on_cuda: bool) -> bool:
    """Whether `attend` runs the Triton kernel (else a torch path) for this backend and device."""
    return backend == "triton" or (backend == "auto" and on_cuda)


def attention_path(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """In words, what `recompute_rows` attends with for this backend, device and dtype (on layers
    without a sliding window), for tables that name their code path."""
    if uses_kernel(backend, device.type == "cuda"):
        return "the Triton kernel"
    return f"{default_kind(device, dtype, None)} blocks ({str(dtype).removeprefix('torch.')})"


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float, backend: str = "auto",
    window: int | None = None, plan: BlockPlan | None = None,
) -> torch.Tensor:
    """Sparse-query attention: each row sees keys at positions <= its own (and, with a window,
    > its own - window). Shapes as the kernel's.

    backend "auto" runs the Triton kernel on CUDA tensors and, elsewhere, the blocked torch path
    when the caller built a `BlockPlan` for the rows (once for all layers), else the reference;
    "torch" and "triton" force one (triton on CPU works only under TRITON_INTERPRET=1).
    """
    if uses_kernel(backend, q.is_cuda):
        return sparse_query_attention(q, k, v, q_pos, scale=scale, window=window)
    if plan is not None:
        return blocked_attention(q, k, v, plan, scale=scale)
    return sparse_query_attention_ref(q, k, v, q_pos, scale=scale, window=window)


@dataclass(frozen=True)
class ApeSpec:
    """APE's query-phase calibration (see `attend_ape`).

    context: [N] bool, True for chunk tokens (the parallel-encoded contexts); everything else
    (shared prefix, plain text, the query, generated tokens) is the other group.
    temperature T and scale S act on that other group, as in APE's reference code.
    """

    context: torch.Tensor
    temperature: float = 1.0
    scale: float = 1.0


@dataclass(frozen=True)
class BlendSpec:
    """CacheBlend's selection, made inside the layer loop.

    Every row is recomputed up to `check_layer`; there the rows among `candidates` ([N] bool)
    whose new K (or V) deviates most from the cached one are kept (round(ratio x candidates)),
    with every non-candidate row; only those continue to the later layers.
    """

    candidates: torch.Tensor
    ratio: float
    check_layer: int = 1
    on: str = "k"


@dataclass
class RecomputeResult:
    """logits: [vocab] for the token after the last row; rows: [M] the rows recomputed at the last
    layer; tail_logits: [tail, vocab] for the tokens after each of the last `tail` rows (fp32)."""

    logits: torch.Tensor
    rows: torch.Tensor
    tail_logits: torch.Tensor | None = None


def attend_ape(q, k, v, q_idx, scale: float, ape: ApeSpec, window: int | None = None) -> torch.Tensor:
    """APE's attention for the rows computed after the parallel contexts (torch path).

    As APE's reference code computes it (`prefill_query`: two attention calls merged through
    their log-sum-exps), keys fall in two groups: C, the parallel contexts, attended as usual;
    and A, every other visible key (shared prefix, plain text, the query so far), whose logits
    are divided by T and whose log-sum-exp is multiplied by S * T before the merge. In one
    softmax that is, per row, logit s/T + (S*T - 1) * lse_A(s/T) for a key in A and s for a key
    in C. T = S = 1 is ordinary attention. Causal by sequence index, like `attend`.
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


def _blend_keep(spec: BlendSpec, rows, k_new, v_new, k_old, v_old) -> torch.Tensor:
    """Indices (into rows) kept by CacheBlend at its check layer."""
    new, old = (k_new, k_old) if spec.on == "k" else (v_new, v_old)
    deviation = (new.float() - old.float()).pow(2).sum(dim=(0, 1, 3))  # [M]
    is_candidate = spec.candidates.to(rows.device)[rows]
    n_keep = round(spec.ratio * int(is_candidate.sum()))
    deviation = torch.where(is_candidate, deviation, torch.tensor(float("-inf")))
    chosen = torch.topk(deviation, n_keep).indices if n_keep else torch.empty(0, dtype=torch.long)
    keep = ~is_candidate
    keep[chosen] = True
    return torch.nonzero(keep).flatten()


@torch.inference_mode()
def recompute_rows(
    lm: LoadedModel,
    cache: AssembledCache,
    input_ids: torch.Tensor,
    rows: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    backend: str = "auto",
    ape: ApeSpec | None = None,
    blend: BlendSpec | None = None,
    layer_ready: Callable[[int], None] | None = None,
    tail: int = 1,
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
    observe: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
) -> RecomputeResult:
    """Recompute `rows` of the request in place in `cache`; return the last row's logits.

    input_ids: [>= rows[-1] + 1] the request's tokens by sequence index. rows: [M] sorted unique
    sequence indices; the last one is the row whose next token is predicted. Each row attends
    causally by sequence index. positions: [>= rows[-1] + 1] RoPE position of each index
    (default: the index itself; APE's parallel chunks share positions). layer_ready(l) is
    called before layer l runs: the pipelined loader fills that layer of the cache meanwhile.
    tail: how many of the last rows get logits (teacher-forced scoring; CacheBlend must not
    drop those rows). embed: ids [M] -> input rows [M, hidden], for requests whose rows are not
    all vocabulary tokens (KV Packet's soft rows, `packets.embed`); default the model's embedding.
    observe(layer, q, rows): called at each layer once the rows' K/V are in the cache, with
    their queries q [1, heads, M, head_dim] (rotated) and sequence indices [M], before they
    attend (ProphetKV's first stage reads the attention it would have).
    """
    assert rows.numel() > 0, "nothing to recompute"
    last_row = int(rows[-1])
    assert last_row < cache.num_tokens and input_ids.numel() > last_row
    fam = lm.family
    rows = rows.to(lm.device)
    rope_pos = (rows if positions is None else positions.to(lm.device)[rows])[None]  # [1, M]
    h = (embed or fam.embed)(input_ids.to(lm.device)[rows])[None]  # [1, M, hidden]
    rope = fam.rope(h, rope_pos)
    plans: dict[int | None, BlockPlan] = {}  # per sliding window: depends only on the rows

    def block_plan(window: int | None, dtype: torch.dtype) -> BlockPlan | None:
        if uses_kernel(backend, rows.is_cuda):
            return None  # the kernel skips unseen keys itself
        if window not in plans:
            plans[window] = BlockPlan.build(rows, cache.num_tokens, window, dtype=dtype)
        return plans[window]

    last = len(fam.layers) - 1
    for layer in range(len(fam.layers)):
        if layer_ready is not None:
            layer_ready(layer)
        keys, values = cache.keys[layer], cache.values[layer]
        q, k, v = fam.qkv(layer, h, rope)
        if blend is not None and layer == blend.check_layer:
            keep = _blend_keep(blend, rows, k, v, keys[:, :, rows], values[:, :, rows])
            rows, h, q, k, v = rows[keep], h[:, keep], q[:, :, keep], k[:, :, keep], v[:, :, keep]
            rope = {t: (cos[:, keep], sin[:, keep]) for t, (cos, sin) in rope.items()}
            plans.clear()
        keys[:, :, rows] = k
        values[:, :, rows] = v
        if observe is not None:
            observe(layer, q, rows)
        scale, window = fam.scaling(layer), fam.window(layer)
        q_rows, plan = rows, block_plan(window, q.dtype)
        if layer == last and rows.numel() > tail:
            # Every row's K/V is written; only the last `tail` rows' outputs reach the logits.
            q, h, q_rows, plan = q[:, :, -tail:], h[:, -tail:], rows[-tail:], None
        if ape is not None:
            out = attend_ape(q, keys, values, q_rows[None], scale, ape, window)
        else:
            out = attend(q, keys, values, q_rows[None], scale, backend, window, plan)
        h = fam.finish(layer, h, out)
    logits = fam.logits(h[:, -tail:])[0].float().cpu()  # [tail, vocab], on the host for decoding
    return RecomputeResult(logits[-1], rows.cpu(), logits if tail > 1 else None)
