"""Peers outside the library in `cacheclip bench ttft`: what CPU users run today instead.

`llamacpp`: llama.cpp's full prefill (through llama-cpp-python) of the very GGUF file the
primary was converted from, on the same prompt token ids as the `full` request, with the same
thread count, timed to its first token (the prefill, then the greedy pick from the last row's
logits). The embedded primary is that GGUF's weights dequantized, so the two run one model;
llama.cpp runs it in the file's own quantized format with its CPU kernels (sgemm / repack).

llama-cpp-python is the optional `peers` extra, built from source so that llama.cpp is compiled
for this CPU (`INSTALL`); it is not part of `make test`.
"""

from __future__ import annotations

import time
from pathlib import Path

PEERS = ("llamacpp",)
INSTALL = ("CMAKE_ARGS=-DGGML_NATIVE=ON pip install --no-binary llama-cpp-python 'cacheclip-rag[peers]' "
           "(compiles llama.cpp for this CPU; minutes on 2 cores)")


class PeerUnavailable(Exception):
    """The peer cannot run here; the message says why and what to do (it becomes the row's note)."""


class LlamaCpp:
    """llama.cpp holding one GGUF model; `ttft(ids)` times a full prefill of a token sequence."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, threads: int, n_ctx: int):
        try:
            import llama_cpp
        except ImportError:
            raise PeerUnavailable(f"llama-cpp-python is not installed: {INSTALL}") from None

        self.version = llama_cpp.__version__
        self.gguf, self.threads = Path(gguf), threads
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   logits_all=False, verbose=False)

    @classmethod
    def for_model(cls, model: str, threads: int, n_ctx: int) -> LlamaCpp:
        """The peer for the primary named `model` (an embedded name); PeerUnavailable otherwise."""
        from cacheclip_rag.analysis import gguf_path

        gguf = gguf_path(model)
        if gguf is None:
            raise PeerUnavailable(f"primary {model!r} has no GGUF (a folder or hub id); llama.cpp runs GGUF files")
        return cls(gguf, threads, n_ctx)

    def ttft(self, ids: list[int]) -> tuple[float, int]:
        """Seconds from an empty context to the first token after prefilling `ids`, and that token."""
        import llama_cpp
        import numpy as np

        self.llm.reset()  # the next eval starts at position 0 and drops what the context held
        start = time.perf_counter()
        self.llm.eval(ids)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.llm.n_vocab(),))
        first = int(np.argmax(logits))
        return time.perf_counter() - start, first

    def close(self) -> None:
        self.llm.close()


def open_peer(kind: str, model: str, threads: int, n_ctx: int) -> LlamaCpp:
    """The peer named `kind` (one of PEERS) for the primary `model`; ValueError for an unknown
    kind, PeerUnavailable where it cannot run here."""
    if kind not in PEERS:
        raise ValueError(f"peer must be one of {PEERS}, got {kind!r}")
    return LlamaCpp.for_model(model, threads, n_ctx)
