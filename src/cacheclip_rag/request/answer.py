"""The last stage of a request: decode after execution, and the `Answer` a caller gets.

`AnswerStream` runs one prepared request: `execute` returns an `Executed` (first logits, rows,
plan, timings), `decode.decode` streams the text, and `finish` makes the `Answer` (reuse
accounting included) from what those returned. Nothing is written back into the request.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from .context import Prepared
from .decode import decode
from .execute import Executed, execute


@dataclass
class Answer:
    """The result of one request.

    recomputed: positions (in the request's primary token sequence) whose K/V were computed for
        this request: selected chunk tokens plus every uncached token (separators, question).
    cached_tokens / computed_tokens: prompt tokens whose K/V came from the store / were computed.
    effective_fraction: recomputed chunk tokens / all chunk tokens (0 for reuse, 1 for full).
    budget / score_layers: the selection rule and the aux layers that scored (None wherever
        no aux model scored: a method without one, or ratio 0 or 1).
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

    def __init__(self, prepared: Prepared, pool: Executor | None):
        self._prepared, self._pool = prepared, pool
        self._executed: Executed | None = None
        self._iter = self._run()
        self.answer: Answer | None = None

    @property
    def trace(self) -> list[dict]:
        """Per chunk, what the selector saw and chose (CacheClip: the aux scores and what was
        recomputed); empty before the first piece or for a method that traces nothing."""
        return list(self._executed.trace) if self._executed is not None else []

    def __iter__(self) -> AnswerStream:
        return self

    def __next__(self) -> str:
        return next(self._iter)

    def collect(self) -> Answer:
        """Run to the end; the `Answer`."""
        for _ in self:
            pass
        assert self.answer is not None
        return self.answer

    def _run(self) -> Iterator[str]:
        prepared = self._prepared
        t0 = time.perf_counter()
        executed = self._executed = execute(prepared, self._pool)
        ttft = time.perf_counter() - t0
        t = time.perf_counter()
        pieces: list[str] = []
        # `decode` enters inference mode around each of its steps itself: a `with` held across this
        # generator's yields would leave the consuming thread in inference mode while it is suspended,
        # and an abandoned stream's late exit would switch it back in whatever thread collects it.
        for _, piece in decode(prepared.primary.lm, executed.step, executed.logits, prepared.request.options):
            pieces.append(piece)
            yield piece
        end = time.perf_counter()
        timings = {**executed.timings, "ttft": ttft, "decode": end - t, "total": end - t0}
        self.answer = finish(prepared, executed, "".join(pieces), len(pieces), timings)


def finish(prepared: Prepared, executed: Executed, text: str, generated: int, timings: dict[str, float]) -> Answer:
    """The `Answer` of a finished request from what its stages returned: the text and how many
    tokens made it, the rows recomputed, reuse accounting, timings. The aux scoring layers are
    reported only where the aux model scored (an aux selector at a ratio strictly inside (0, 1))."""
    request, layout = prepared.request, prepared.layout
    chunk_rows = layout.chunk_rows()
    n_context = int(chunk_rows.numel())
    recomputed_context = int(torch.isin(executed.rows, chunk_rows).sum()) if n_context else 0
    cached = 0 if executed.full_prefill else layout.prefix_len + n_context - recomputed_context
    return Answer(
        text=text.strip(),
        chunk_ids=list(request.chunk_ids),
        mode=request.mode,
        recompute_ratio=request.ratio,
        timings=timings,
        recomputed=executed.rows.tolist(),
        prompt_tokens=layout.num_tokens,
        context_tokens=n_context,
        cached_tokens=cached,
        computed_tokens=layout.num_tokens - cached,
        effective_fraction=recomputed_context / n_context if n_context else 0.0,
        generated_tokens=generated,
        budget=request.budget,
        score_layers=request.select.score_layers if prepared.selector.wants_aux(prepared) else None,
    )
