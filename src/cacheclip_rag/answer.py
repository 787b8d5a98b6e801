"""Stage 4 of a request: decode from the first token's logits, and the `Answer` a caller gets.

`run` drives one prepared request through planning, execution and decoding as a generator of
text pieces; `AnswerStream` is the streaming face of it and `finish` makes the `Answer` (reuse
accounting included) once the text is complete.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from .execute import execute
from .generate import decode
from .plan import Selector
from .prepared import Prepared


@dataclass
class Answer:
    """The result of one request.

    recomputed: positions (in the request's primary token sequence) whose K/V were computed for
        this request: selected chunk tokens plus every uncached token (separators, question).
    cached_tokens / computed_tokens: prompt tokens whose K/V came from the store / were computed.
    effective_fraction: recomputed chunk tokens / all chunk tokens (0 for reuse, 1 for full).
    budget / score_layers: the selection rule and the aux layers that scored (cacheclip mode;
        score_layers is None in every other mode).
    timings: seconds; selection, load, assemble, recompute, ttft, decode, total.
    """

    text: str
    chunk_ids: list[str]
    mode: str
    recompute_ratio: float | str
    timings: dict[str, float]
    recomputed: list[int]
    prompt_tokens: int
    context_tokens: int
    cached_tokens: int
    computed_tokens: int
    effective_fraction: float
    generated_tokens: int
    budget: str = "keep"
    score_layers: tuple[int, ...] | None = None

    def metadata(self) -> dict:
        """Everything but the text and the row list: what a caller needs to see reuse happened."""
        return {
            "reused_chunk_ids": list(self.chunk_ids),
            "mode": self.mode,
            "recompute_ratio": self.recompute_ratio,
            "timings": dict(self.timings),
            "prompt_tokens": self.prompt_tokens,
            "context_tokens": self.context_tokens,
            "cached_tokens": self.cached_tokens,
            "computed_tokens": self.computed_tokens,
            "effective_fraction": self.effective_fraction,
            "generated_tokens": self.generated_tokens,
            "budget": self.budget,
            "score_layers": list(self.score_layers) if self.score_layers is not None else None,
        }


class AnswerStream:
    """Iterates over the text pieces of one request; `.answer` holds the `Answer` once done.

    Bad input is refused when the stream is created (the request is prepared first), not on the
    first iteration.
    """

    def __init__(self, prepared: Prepared, selector: Selector, pool: Executor | None):
        self._prepared, self._selector = prepared, selector
        self._pieces: list[str] = []
        self._iter = run(prepared, selector, pool)
        self.answer: Answer | None = None

    @property
    def trace(self) -> list[dict]:
        """CacheClip mode: per chunk, the aux scores and what was recomputed (after iterating)."""
        return self._prepared.request.trace

    def __iter__(self) -> AnswerStream:
        return self

    def __next__(self) -> str:
        try:
            piece = next(self._iter)
        except StopIteration:
            if self.answer is None:
                self.answer = finish(self._prepared, self._selector, "".join(self._pieces))
            raise
        self._pieces.append(piece)
        return piece

    def collect(self) -> Answer:
        """Run to the end; the `Answer`."""
        for _ in self:
            pass
        assert self.answer is not None
        return self.answer


def run(prepared: Prepared, selector: Selector, pool: Executor | None) -> Iterator[str]:
    """Plan, build the cache and stream the decoded text of one request."""
    request = prepared.request
    t0 = time.perf_counter()
    executed = execute(prepared, selector, pool)
    request.rows = executed.rows
    request.full_prefill = executed.plan.full_prefill
    request.trace.extend(executed.plan.trace)
    request.timings["ttft"] = time.perf_counter() - t0
    t = time.perf_counter()
    # `decode` enters inference mode around each of its steps itself: a `with` held across this
    # generator's yields would leave the consuming thread in inference mode while it is suspended,
    # and an abandoned stream's late exit would switch it back in whatever thread collects it.
    for _, piece in decode(prepared.primary.lm, executed.step, executed.logits, request.options):
        request.generated += 1
        yield piece
    request.timings["decode"] = time.perf_counter() - t
    request.timings["total"] = time.perf_counter() - t0


def finish(prepared: Prepared, selector: Selector, text: str) -> Answer:
    """The `Answer` of a finished request: text, rows recomputed, reuse accounting, timings."""
    request, layout = prepared.request, prepared.layout
    assert request.rows is not None
    chunk_rows = layout.chunk_rows()
    n_context = int(chunk_rows.numel())
    recomputed_context = int(torch.isin(request.rows, chunk_rows).sum()) if n_context else 0
    cached = 0 if request.full_prefill else layout.prefix_len + n_context - recomputed_context
    return Answer(
        text=text.strip(),
        chunk_ids=list(request.chunk_ids),
        mode=request.mode,
        recompute_ratio=request.ratio,
        timings=dict(request.timings),
        recomputed=request.rows.tolist(),
        prompt_tokens=layout.num_tokens,
        context_tokens=n_context,
        cached_tokens=cached,
        computed_tokens=layout.num_tokens - cached,
        effective_fraction=recomputed_context / n_context if n_context else 0.0,
        generated_tokens=request.generated,
        budget=request.budget,
        score_layers=request.select.score_layers if selector.uses_aux else None,
    )
