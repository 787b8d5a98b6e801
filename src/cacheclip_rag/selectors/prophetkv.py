"""`prophetkv`: user-query-driven selection with the primary's own layer-wise attention, in two
stages (Wang et al., "ProphetKV: User-Query-Driven Selective Recomputation for Efficient KV Cache
Reuse in Retrieval-Augmented Generation", arXiv:2602.02579).

Only the paper's abstract is public; this is the reading it supports, with each open choice
named (a `BaselineConfig` field where it is a setting):

1. Stage one. The request's cache is assembled from the reused chunk caches (keys re-rotated,
   as every mode does) and only the plain-text rows (separators, the question, the template
   suffix) are recomputed through every layer. At each layer the attention of the query rows
   (every row after the last chunk) over the chunk tokens is read: softmax over all keys a row
   sees, causal and within the layer's sliding window, averaged over the query rows, then the
   max over query heads (`BaselineConfig.prophetkv_heads`). The mean over heads, tried first,
   dilutes the few heads that retrieve: on the same 18 samples at 2K and 20%, it keeps 82.8% of
   full attention's needle score against the max's 92.2%, and leaves more KL from full
   attention; at 4K and 20% the two are level (`docs/benchmarks.md`).
2. Fusion. Each layer's scores are normalised to sum 1 over the chunk tokens (so no layer
   dominates by the share of attention it gives the prefix or the question itself), then fused
   over layers: "mean" (default) or "max" (`BaselineConfig.prophetkv_fuse`). The top
   round(ratio x chunk tokens) tokens are chosen, no grouping (the abstract speaks of tokens).
3. Stage two is the executor's ordinary recompute of the chosen rows plus every plain-text row,
   which now reads repaired keys and values.

Stage one runs on the primary, on the critical path: its time is the plan's `seconds`, counted
in `timings["selection"]` and in TTFT like every other mode's selection.
"""

from __future__ import annotations

import time

import torch

from ..assemble import assemble
from ..plan import Plan, Selector, register
from ..recompute import recompute_rows
from ..select import rows_attention


class ProphetKV(Selector):
    """fuse, heads: the fusion over layers and the reduction over heads, or None for the engine
    config's (`BaselineConfig.prophetkv_fuse`, `prophetkv_heads`). A subclass fixing one is how a
    bench compares it with the default on the same samples (`eval/variants.py`)."""

    name = "prophetkv"
    fuse: str | None = None
    heads: str | None = None

    def plan(self, prepared) -> Plan:
        start = time.perf_counter()
        scores = query_attention(prepared, fuse=self.fuse, heads=self.heads)
        chunk_rows = prepared.layout.chunk_rows()
        k = round(prepared.request.ratio * chunk_rows.numel())
        top = torch.topk(scores, k).indices if k > 0 else torch.empty(0, dtype=torch.long)
        return Plan(rows=torch.sort(chunk_rows[top]).values, seconds=time.perf_counter() - start)


@torch.inference_mode()
def query_attention(prepared, chunk_kvs: dict | None = None, fuse: str | None = None,
                    heads: str | None = None) -> torch.Tensor:
    """Stage one and the fusion: one score per chunk row, [C] in `layout.chunk_rows()` order.
    chunk_kvs: chunk id -> cache to assemble from instead of the stored ones (for the oracle test).
    fuse: "mean" or "max" over layers; None: the engine config's.
    heads: "mean" or "max" over query heads (of each head's attention averaged over query rows);
    None: the engine config's."""
    lm, layout = prepared.primary.lm, prepared.layout
    fuse = fuse or prepared.config.baselines.prophetkv_fuse
    heads = heads or prepared.config.baselines.prophetkv_heads
    cache = assemble(lm, layout, prepared.prefix_kv(), chunk_kvs or prepared.chunk_kvs())
    chunk_rows = layout.chunk_rows()
    query_start = layout.chunk_segments()[-1].end
    per_layer: list[torch.Tensor] = []

    def observe(layer: int, q: torch.Tensor, rows: torch.Tensor) -> None:
        wanted = rows >= query_start
        attention = rows_attention(lm, layer, q[:, :, wanted], cache.keys[layer], rows[wanted], layout.num_tokens,
                                   heads=heads)
        on_chunks = attention[chunk_rows.to(attention.device)].cpu()
        per_layer.append(on_chunks / on_chunks.sum().clamp_min(1e-12))

    recompute_rows(lm, cache, layout.input_ids, layout.uncached_rows(), backend=prepared.config.attention_backend,
                   embed=prepared.embed(), observe=observe)
    stacked = torch.stack(per_layer)  # [layers, C]
    return stacked.mean(dim=0) if fuse == "mean" else stacked.max(dim=0).values


register(ProphetKV())
