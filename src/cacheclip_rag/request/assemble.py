"""Online: lay out a request as one token sequence; the assembled cache it is recomputed in.

A request is [shared prefix][segment]...[segment], where a segment is either a stored chunk
(its cache is reused) or plain text (separators, the question, unrecognised prompt text; always
recomputed). Every mode runs on this identical sequence, so a comparison between modes isolates
the KV method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.loading import LoadedModel
from ..storage.record import ChunkKV


@dataclass(frozen=True)
class Segment:
    """One piece of the request. chunk_id is None for plain text.

    start: global position of the first token; ids [T] and offsets [T, 2] as tokenized alone.
    """

    text: str
    chunk_id: str | None
    start: int
    ids: torch.Tensor
    offsets: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + int(self.ids.numel())

    @property
    def cached(self) -> bool:
        return self.chunk_id is not None


@dataclass(frozen=True)
class Layout:
    """The request's token sequence for one model.

    input_ids: [N]; prefix_len: P (positions [0, P) hold the shared prefix);
    segments: everything after the prefix, in order, covering [P, N).
    """

    input_ids: torch.Tensor
    prefix_len: int
    segments: tuple[Segment, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def chunk_segments(self) -> list[Segment]:
        return [s for s in self.segments if s.cached]

    def uncached_rows(self) -> torch.Tensor:
        """Positions [U] of every plain-text token; always recomputed."""
        parts = [torch.arange(s.start, s.end) for s in self.segments if not s.cached]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)

    def chunk_rows(self) -> torch.Tensor:
        parts = [torch.arange(s.start, s.end) for s in self.segments if s.cached]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


TEMPLATE = "<template>"
"""The chunk-id slot of a piece that is template text (a chat's role markers): its special
tokens are parsed, and it is never a chunk. Chunk ids are hex digests, so this never is one."""


def build_layout(prefix_ids: torch.Tensor, pieces: list[tuple[str, str | None]], tokenize, suffix: str = "",
                 wrap=None) -> Layout:
    """Tokenize each piece on its own and place the pieces after the prefix.

    pieces: (text, chunk_id or None) in order: user content; (text, TEMPLATE) for template text
    between turns of a chat. suffix: the template text that
    closes the request (its special tokens are parsed). tokenize: (text, special) -> (ids [T],
    offsets [T, 2]). wrap: for a packet request, (ids, offsets) -> the chunk's rows as its packet
    cache holds them (`packets.wrap_ids`: soft rows around the tokens); plain text is never wrapped.
    """
    segments = []
    pos = int(prefix_ids.numel())
    ids = [prefix_ids]
    for text, cid, special in [(t, None if c == TEMPLATE else c, c == TEMPLATE) for t, c in pieces] + (
            [(suffix, None, True)] if suffix else []):
        seg_ids, offsets = tokenize(text, special)
        if seg_ids.numel() == 0:
            continue
        if wrap is not None and cid is not None:
            seg_ids, offsets = wrap(seg_ids, offsets)
        segments.append(Segment(text, cid, pos, seg_ids, offsets))
        ids.append(seg_ids)
        pos += int(seg_ids.numel())
    return Layout(torch.cat(ids), int(prefix_ids.numel()), tuple(segments))


def write_prefix(cache: AssembledCache, layout: Layout, prefix_kv: ChunkKV) -> None:
    """The one copy of the shared prefix, positions [0, P), every layer."""
    p = layout.prefix_len
    assert prefix_kv.num_tokens == p, f"prefix cache has {prefix_kv.num_tokens} tokens, layout {p}"
    for layer, (k, v) in enumerate(zip(prefix_kv.keys, prefix_kv.values)):
        cache.keys[layer][0, :, :p] = k
        cache.values[layer][0, :, :p] = v


def write_segment(cache: AssembledCache, layer: int, seg: Segment, k: torch.Tensor, v: torch.Tensor) -> None:
    """One layer of one chunk into its rows, keys already moved to their positions
    (`pipeline.LayerFeeder` re-rotates them on the cache's device first). v may live on the host."""
    cache.keys[layer][0, :, seg.start : seg.end] = k
    cache.values[layer][0, :, seg.start : seg.end] = v.to(cache.values[layer].device, non_blocking=True)


@dataclass
class AssembledCache:
    """Per-layer K/V for one request's whole token sequence.

    keys[l], values[l]: [1, kv_heads, N, head_dim] in the model dtype, preallocated once.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return int(self.keys[0].shape[2])

    def copy(self) -> AssembledCache:
        """An independent copy (recompute writes rows in place)."""
        return AssembledCache([k.clone() for k in self.keys], [v.clone() for v in self.values])

    @classmethod
    def empty(cls, lm: LoadedModel, n_tokens: int) -> AssembledCache:
        shape = (1, lm.config.num_key_value_heads, n_tokens, lm.family.head_dim)
        keys = [torch.zeros(shape, dtype=lm.dtype, device=lm.device) for _ in range(lm.num_layers)]
        values = [torch.zeros(shape, dtype=lm.dtype, device=lm.device) for _ in range(lm.num_layers)]
        return cls(keys, values)
