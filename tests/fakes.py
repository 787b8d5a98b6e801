"""A stand-in for the heavy engine, for adapter unit tests only."""

import threading
from types import SimpleNamespace

from cacheclip_rag.engine import Answer


class FakeStream:
    def __init__(self, pieces, answer, barrier=None):
        self._pieces, self._answer, self._barrier = list(pieces), answer, barrier
        self.answer = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._barrier is not None:  # both requests must be in flight at once to pass
            self._barrier.wait()
            self._barrier = None
        if not self._pieces:
            self.answer = self._answer
            raise StopIteration
        return self._pieces.pop(0)


class FakeEngine:
    """Records calls; answers with fixed pieces."""

    def __init__(self, pieces=("Hel", "lo", " world"), barrier: threading.Barrier | None = None):
        self.pieces = pieces
        self.barrier = barrier
        self.calls = []
        lm = SimpleNamespace(name="fake-primary", max_positions=4096)
        self.primary = SimpleNamespace(lm=lm)
        self.aux = SimpleNamespace(lm=SimpleNamespace(name="fake-aux"))
        self.config = SimpleNamespace(embedder="fake")

    def stream_chat(self, messages, chunk_ids=None, **opts):
        """The chat path: recorded with the messages in the prompt's place."""
        return self.stream_generate(messages, chunk_ids, **opts)

    def stream_generate(self, prompt, chunk_ids=None, **opts):
        self.calls.append((prompt, chunk_ids, opts))
        text = "".join(self.pieces)
        answer = Answer(
            text=text, chunk_ids=list(chunk_ids or ["c1"]), mode=opts.get("mode", "cacheclip"),
            recompute_ratio=opts.get("recompute_ratio", 0.2), timings={"ttft": 0.1}, recomputed=[5, 6],
            prompt_tokens=10, context_tokens=6, cached_tokens=8, computed_tokens=2, effective_fraction=0.3,
            generated_tokens=3,
        )
        return FakeStream(self.pieces, answer, self.barrier)
