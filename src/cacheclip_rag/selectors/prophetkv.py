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

from ..request.pipeline import assemble
from ..request.plan import Plan
from ..request.recompute import recompute_rows
from ..request.selector import Selector, register
from .budget import row_count
from .primary_attention import rows_attention


class ProphetKV(Selector):
    """fuse, heads: the fusion over layers and the reduction over heads, or None for the engine
    config's (`BaselineConfig.prophetkv_fuse`, `prophetkv_heads`). unit: what is chosen, the
    top-scored "token"s, or whole "word"s ranked by their best token (`top_words`; measured level
    with tokens at 2K and 4K, so a bench variant only). A subclass fixing one is how a bench
    compares it with the default on the same samples (`eval/variants.py`)."""

    name = "prophetkv"
    fuse: str | None = None
    heads: str | None = None
    unit: str = "token"

    def plan(self, prepared) -> Plan:
        start = time.perf_counter()
        scores = query_attention(prepared, fuse=self.fuse, heads=self.heads)
        chunk_rows = prepared.layout.chunk_rows()
        k = row_count(prepared.request.ratio, chunk_rows.numel())
        if self.unit == "word":
            top = top_words(scores, word_ids(prepared.layout), k)
        else:
            top = torch.topk(scores, k).indices if k > 0 else torch.empty(0, dtype=torch.long)
        return Plan(rows=torch.sort(chunk_rows[top]).values, seconds=time.perf_counter() - start)


def word_ids(layout) -> torch.Tensor:
    """[C] the word each chunk row belongs to, in `layout.chunk_rows()` order, numbered from 0.
    A token continues the previous one's word where its text starts where the previous one's
    ended and both sides of that boundary are letters or digits: a number the tokenizer cut into
    single digits, or a word cut into pieces, is one word; a space or punctuation starts a new
    one. Words never cross chunks; a packet's soft rows (negative ids) are words of their own."""
    out, word = [], -1
    for seg in layout.chunk_segments():
        text, ids, offsets = seg.text, seg.ids.tolist(), seg.offsets.tolist()
        for t, (start, _) in enumerate(offsets):
            prev_end = offsets[t - 1][1] if t else -1
            joined = (t > 0 and ids[t] >= 0 and ids[t - 1] >= 0 and start == prev_end and 0 < start < len(text)
                      and text[start].isalnum() and text[start - 1].isalnum())
            word += 0 if joined else 1
            out.append(word)
    return torch.tensor(out, dtype=torch.long)


def top_words(scores: torch.Tensor, words: torch.Tensor, k: int) -> torch.Tensor:
    """Indices into `scores` [C] of the whole words (`words` [C], as `word_ids` numbers them)
    whose best-scored token ranks highest, taken until they hold at least k tokens: a value the
    query reads is recomputed with all its digits, never some of them."""
    if k <= 0:
        return torch.empty(0, dtype=torch.long)
    n = int(words.max()) + 1
    best = torch.full((n,), float("-inf"), dtype=scores.dtype).scatter_reduce(0, words, scores, "amax")
    sizes = torch.bincount(words, minlength=n)
    order = torch.argsort(best, descending=True, stable=True)
    taken = int(torch.searchsorted(torch.cumsum(sizes[order], 0), k)) + 1
    chosen = torch.zeros(n, dtype=torch.bool)
    chosen[order[:taken]] = True
    return torch.nonzero(chosen[words]).flatten()


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
