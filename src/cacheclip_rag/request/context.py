"""What a request is once prepared: the value every later stage reads.

Its selector plans from it (selector.py), the executor assembles and recomputes from it
(execute.py), and analysis code (calibration, benches) gets from it the same caches and aux
query that serving uses. It is made per call by `prepare.Preparer` and never changed after, so
concurrent requests share nothing mutable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import EngineConfig
from ..corpus import packets as packet_lib
from ..corpus.caches import ChunkCaches
from ..corpus.encode import tokenize
from ..storage.record import ChunkKV
from .assemble import Layout
from .options import Request
from .selector import Selector

MAX_AUX_QUERY_TOKENS = 256
"""The aux query is the question's last tokens at most (its attention rows score the chunks)."""


@dataclass(frozen=True)
class Prepared:
    """A validated request with its primary-model layout and access to both models' caches.

    request: what was asked (frozen). selector: the mode's method, looked up once when the
    request was prepared. layout: the primary token sequence [N] with its segments. primary,
    aux: the two models' caches (for a packet mode, `primary` holds the packet caches and the
    layout their soft rows). config: the engine's settings (baseline modes, pipeline switches,
    attention backend).
    """

    request: Request
    selector: Selector
    layout: Layout
    primary: ChunkCaches
    aux: ChunkCaches
    config: EngineConfig

    @property
    def chunk_segments(self):
        return self.layout.chunk_segments()

    def embed(self):
        """ids [M] -> input rows [M, hidden] for recompute: None (the model's embedding) unless
        the request runs on packets, whose soft rows embed as the adapter vectors."""
        adapters = self.primary.adapters
        if adapters is None:
            return None
        return lambda ids: packet_lib.embed(self.primary.lm, adapters, ids)

    def chunk_kvs(self) -> dict[str, ChunkKV]:
        """chunk id -> the primary's whole cache of each chunk in the request."""
        return {seg.chunk_id: self.primary.get(seg.chunk_id, seg.text) for seg in self.chunk_segments}

    def prefix_kv(self) -> ChunkKV:
        return self.primary.prefix()

    def aux_kvs(self, layers: int | None = None) -> list[ChunkKV]:
        """The aux model's cache of each chunk, in request order; with `layers`, only the first
        that many layers (read from the store no further)."""
        if layers is None:
            return [self.aux.get(seg.chunk_id, seg.text) for seg in self.chunk_segments]
        return [self.aux.get_layers(seg.chunk_id, seg.text, layers) for seg in self.chunk_segments]

    def aux_prefix_kv(self) -> ChunkKV:
        return self.aux.prefix()

    def aux_query_ids(self) -> torch.Tensor:
        """[Q] aux tokens of the query rows: the question, then the assistant turn's opening."""
        lm = self.aux.lm
        ids = torch.cat([tokenize(lm, self.request.aux_query)[0], tokenize(lm, self.aux.template.suffix, True)[0]])
        return ids[-MAX_AUX_QUERY_TOKENS:]
