"""How close a reused cache comes to full attention, without labels.

Full attention answers a question greedily; that answer is then teacher-forced through the
request's reused cache in which chosen chunk rows (plus every uncached row and the answer's own
rows) were recomputed, and the next-token distributions are compared with full attention's at
every answer position. Calibration ranks aux-layer candidates by it, and `cacheclip bench
fidelity` compares selectors by it: unlike a needle score (right or wrong per sample) it is
continuous, so a few samples separate selectors that a needle table cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..corpus.encode import tokenize
from ..request.assemble import AssembledCache, Layout
from ..request.pipeline import assemble
from ..request.recompute import recompute_rows

if TYPE_CHECKING:
    from ..engine import CacheClipEngine


@dataclass
class Reference:
    """One request's full-attention reference.

    layout: the request's token layout; base_cache: its reused cache (direct concatenation) with
    room for the answer; answer: [T] full attention's greedy answer tokens; full_logprobs:
    [T, vocab] full attention's next-token log-probabilities at each answer position.
    """

    layout: Layout
    base_cache: AssembledCache
    answer: torch.Tensor
    full_logprobs: torch.Tensor
    embed: Callable | None = None
    """For a packet reference: how its rows embed (soft rows as the adapter vectors)."""
    full_ttft: float = float("nan")
    """Seconds to full attention's first token on this request (the frontier's unit of time)."""
    full_cache: AssembledCache | None = None
    """The cache full attention's forced pass wrote (every chunk row recomputed: what a full
    prefill holds), kept when `reference(keep_full_cache=True)`; None otherwise."""

    def forced(self, engine: CacheClipEngine, selected: torch.Tensor, observe: Callable | None = None) -> torch.Tensor:
        """Log-probabilities [T, vocab] at each answer position with `selected` chunk rows (and every
        uncached row, and the answer) recomputed in a copy of the reused cache. observe: as
        `recompute_rows` takes it (layer, q, rows), and the layer's cache keys as a fourth argument."""
        return self.forced_cache(engine, selected, observe)[0]

    def forced_cache(self, engine: CacheClipEngine, selected: torch.Tensor, observe: Callable | None = None
                     ) -> tuple[torch.Tensor, AssembledCache]:
        """`forced`, and the cache that pass wrote."""
        layout, answer = self.layout, self.answer
        n, t = layout.num_tokens, int(answer.numel())
        cache = self.base_cache.copy()
        ids = torch.cat([layout.input_ids, answer[:-1]])
        rows = torch.unique(torch.cat([layout.uncached_rows(), selected, torch.arange(n, n + t - 1)]))
        watch = None if observe is None else (lambda layer, q, r: observe(layer, q, r, cache.keys[layer]))
        result = recompute_rows(engine.primary.lm, cache, ids, rows, backend=engine.config.attention_backend, tail=t,
                                embed=self.embed, observe=watch)
        logits = result.tail_logits if t > 1 else result.logits[None]
        return torch.log_softmax(logits, dim=-1), cache


@torch.inference_mode()
def reference(engine: CacheClipEngine, question: str, chunk_ids: list[str], answer_tokens: int = 64,
              observe: Callable | None = None, keep_full_cache: bool = False) -> Reference | None:
    """Full attention's answer (at most `answer_tokens` tokens) and its log-probabilities, forced
    through the recompute path with every chunk row recomputed (the 100% oracle: a full prefill).
    None when full attention answers nothing. observe: watches that full pass (`Reference.forced`);
    keep_full_cache: keep the cache it wrote (`Reference.full_cache`: what a full prefill holds,
    for comparing the reused cache with it)."""
    primary = engine.primary
    full = engine.answer(question, chunk_ids=chunk_ids, mode="full", max_new_tokens=answer_tokens)
    answer = tokenize(primary.lm, full.text)[0][:answer_tokens]
    if answer.numel() == 0:
        return None
    prepared = engine.prepare(question, chunk_ids)
    layout = prepared.layout
    base = assemble(primary.lm, layout, prepared.prefix_kv(), prepared.chunk_kvs(), capacity=layout.num_tokens + answer.numel())
    ref = Reference(layout, base, answer, torch.empty(0), full_ttft=full.timings["ttft"])
    ref.full_logprobs, cache = ref.forced_cache(engine, layout.chunk_rows(), observe=observe)
    if keep_full_cache:
        ref.full_cache = cache
    return ref


@torch.inference_mode()
def packet_reference(engine: CacheClipEngine, ref: Reference, question: str, chunk_ids: list[str]) -> Reference:
    """The same request on KV Packet caches: the packet layout (soft rows around each chunk) and
    its reused cache, with `ref`'s answer and full attention's log-probabilities, so forcing
    rows through it measures the packet modes against plain full attention."""
    prepared = engine.prepare(question, chunk_ids, mode="packet")
    layout = prepared.layout
    base = assemble(engine.primary.lm, layout, prepared.prefix_kv(), prepared.chunk_kvs(),
                    capacity=layout.num_tokens + ref.answer.numel())
    return Reference(layout, base, ref.answer, ref.full_logprobs, embed=prepared.embed(), full_ttft=ref.full_ttft)


def kl_positions(full: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(full || other) [T] per position; both [T, vocab] log-probabilities."""
    return (full.exp() * (full - other)).sum(-1).clamp(min=0)


def top1_agreement(full: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """[T] bool: does `other` put its highest probability on full attention's answer token?
    (All true: greedy decoding from `other` reproduces full attention's answer.)"""
    return other.argmax(-1) == full.argmax(-1)
