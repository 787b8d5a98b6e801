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
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from cacheclip_kernels import (
    BlockPlan,
    blocked_attention,
    default_kind,
    sparse_query_attention,
    sparse_query_attention_ref,
)
from torch.profiler import record_function

from ..models.loading import LoadedModel
from .assemble import AssembledCache

STAGES = {"dense": "cacheclip.recompute.dense", "writes": "cacheclip.recompute.writes",
          "attention": "cacheclip.recompute.attention", "logits": "cacheclip.recompute.logits"}
"""The profiler ranges `recompute_rows` marks (`profile_range`): the rows' projections, norms,
RoPE and MLP; writing their K/V into the cache (and a hook's keep); their attention; the logits.
A profile of a request groups its time by them (`cacheclip bench stages`)."""


def profile_range(name: str):
    """torch.profiler's range `name` while a profiler runs, else nothing: an open range costs
    about 8 us even without a profiler (2-core EPYC), about 1 ms a decoded token over the default
    primary's 24 layers. (Where this torch lacks the flag, ranges are always marked.)"""
    return record_function(name) if getattr(torch.autograd.profiler, "_is_profiler_enabled", True) else nullcontext()


def uses_kernel(backend: str, on_cuda: bool) -> bool:
    """Whether `attend` runs the Triton kernel (else a torch path) for this backend and device."""
    return backend == "triton" or (backend == "auto" and on_cuda)


def attention_path(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """In words, what `recompute_rows` attends with for this backend, device and dtype (on layers
    without a sliding window), for tables that name their code path."""
    if uses_kernel(backend, device.type == "cuda"):
        return "the Triton kernel"
    return f"{default_kind(device, dtype, None)} blocks ({str(dtype).removeprefix('torch.')})"


def loop_prefills_faster(backend: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a whole prefill runs faster through `recompute_rows` over every row than through
    the model's own forward: where the loop attends with matmul blocks (half precision on a CPU
    without AMX), whose batched bf16 matmuls beat the CPU flash kernel transformers' SDPA path
    calls (it runs half precision at about float32 speed there). Measured on an AMD EPYC with
    avx512_bf16 and no AMX (bf16, 2 threads, the default primary): 2,262 tokens 3.9-4.2 s against
    5.1 s, 4,462 tokens 9.2-11.5 s against 13.4-14.1 s."""
    return not uses_kernel(backend, device.type == "cuda") and default_kind(device, dtype, None) == "matmul"


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


class LayerHook:
    """What a method changes inside the layer loop; its selector returns one in the `Plan`, and
    the loop calls it at every layer, in recompute and in decoding alike. This base changes
    nothing; a method overrides one or both calls (a selector that drops rows at a check layer,
    one that attends with its own temperature: see `selectors/`).
    """

    def keep(self, layer: int, rows: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
             k_old: torch.Tensor, v_old: torch.Tensor) -> torch.Tensor | None:
        """Which of `rows` [M] go on from this layer, as indices into rows (None: all of them).
        k_new, v_new: [1, H_kv, M, D] the rows' K/V at this layer; k_old, v_old: the cache's."""
        return None

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_rows: torch.Tensor, scale: float,
               window: int | None) -> torch.Tensor | None:
        """The rows' attention output [1, H, M, D] at this layer, or None for the loop's own
        (`attend`). q [1, H, M, D]; keys, values [1, H_kv, N, D]; q_rows [1, M] sequence indices."""
        return None


@dataclass
class RecomputeResult:
    """logits: [vocab] for the token after the last row; rows: [M] the rows recomputed at the last
    layer; tail_logits: [tail, vocab] for the tokens after each of the last `tail` rows (fp32)."""

    logits: torch.Tensor
    rows: torch.Tensor
    tail_logits: torch.Tensor | None = None


@torch.inference_mode()
def recompute_rows(
    lm: LoadedModel,
    cache: AssembledCache,
    input_ids: torch.Tensor,
    rows: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    backend: str = "auto",
    hook: LayerHook | None = None,
    layer_ready: Callable[[int], None] | None = None,
    tail: int = 1,
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
    observe: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
) -> RecomputeResult:
    """Recompute `rows` of the request in place in `cache`; return the last row's logits.

    input_ids: [>= rows[-1] + 1] the request's tokens by sequence index. rows: [M] sorted unique
    sequence indices; the last one is the row whose next token is predicted. Each row attends
    causally by sequence index. positions: [>= rows[-1] + 1] RoPE position of each index
    (default: the index itself; a method may move chunks, as parallel encoding does). hook: the
    plan's changes inside the layer loop (`LayerHook`). layer_ready(l) is
    called before layer l runs: the pipelined loader fills that layer of the cache meanwhile.
    tail: how many of the last rows get logits (teacher-forced scoring; a hook must not drop
    those rows). embed: ids [M] -> input rows [M, hidden], for requests whose rows are not
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
        with profile_range(STAGES["dense"]):
            q, k, v = fam.qkv(layer, h, rope)
        with profile_range(STAGES["writes"]):
            keep = hook.keep(layer, rows, k, v, keys[:, :, rows], values[:, :, rows]) if hook is not None else None
            if keep is not None:
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
        with profile_range(STAGES["attention"]):
            out = hook.attend(q, keys, values, q_rows[None], scale, window) if hook is not None else None
            if out is None:
                out = attend(q, keys, values, q_rows[None], scale, backend, window, plan)
        with profile_range(STAGES["dense"]):
            h = fam.finish(layer, h, out)
    with profile_range(STAGES["logits"]):
        logits = fam.logits(h[:, -tail:])[0].float().cpu()  # [tail, vocab], on the host for decoding
    return RecomputeResult(logits[-1], rows.cpu(), logits if tail > 1 else None)
