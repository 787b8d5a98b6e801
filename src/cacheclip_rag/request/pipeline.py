"""Layer-wise pipelined cache loading: recompute layer l while layer l + 1 is loaded.

A background thread reads each chunk's K/V a few layers at a time (memory-mapped safetensors,
each tensor verified against its checksum, a compressed record's layers decoded together),
re-rotates the keys and writes them into the preallocated assembled cache; the recompute loop
waits only for the layer it is about to run.
A chunk whose file turns out damaged part-way is re-encoded from its text and the loading goes
on from the fresh cache (its values are identical: encoding is deterministic).

This is the one assembly path: a request starts it with `start_assembly` (pipelined where
layer-wise loading is on), and `assemble` is the same path run to the end at once, for caches
already in memory (ProphetKV's probe of the assembled cache, the full-attention reference).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import torch

from ..models.loading import LoadedModel
from ..models.rope import rerotate
from ..storage.record import ChunkKV, DamagedCacheError, LayerReader
from .assemble import AssembledCache, Layout, write_prefix, write_segment

log = logging.getLogger(__name__)

Source = ChunkKV | LayerReader
"""A chunk's primary cache: fully in memory, or a reader that loads one layer at a time."""


STAGES = ("read", "rotate", "write")
"""What `LayerFeeder.stages` takes its busy time apart into."""

DECODE_BLOCK = 6
"""Layers of a chunk read from the store together: a compressed record's are decoded in one call
(`LayerReader.block`) and their keys re-rotated in one, both dominated by per-call overhead on
CPUs, so a block of layers costs little more than one; the first layer waits for its block, the
rest are then at hand."""


class LayerFeeder:
    """Fills the assembled cache layer by layer, in a thread (pipelined) or all at once.

    cache: preallocated, the prefix rows already written. sources: chunk id -> Source.
    rebuild: (chunk id, error) -> fresh ChunkKV, when a file is found damaged while loading.
    Call `wait(l)` before running layer l; `busy` is the seconds spent loading and assembling,
    `waited` the seconds the caller was blocked, `stages` the busy seconds taken apart: "read"
    (opening, reading and dequantizing the records), "rotate" (moving keys to their positions),
    "write" (copying into the assembled cache).
    """

    def __init__(
        self,
        lm: LoadedModel,
        layout: Layout,
        sources: dict[str, Source],
        positions: torch.Tensor,
        cache: AssembledCache,
        rebuild: Callable[[str, Exception], ChunkKV],
        pipelined: bool = True,
        on_loaded: Callable[[str, ChunkKV], None] | None = None,
    ):
        self._lm, self._layout, self._sources = lm, layout, dict(sources)
        self._positions, self._cache, self._rebuild = positions, cache, rebuild
        self._on_loaded = on_loaded
        self._loaded: dict[str, tuple[list, list]] = {
            cid: ([], []) for cid, src in self._sources.items() if isinstance(src, LayerReader)
        }
        self._moved: dict[str, list[torch.Tensor | None]] = {}
        segments = Counter(seg.chunk_id for seg in layout.chunk_segments())
        self._once = {cid for cid, n in segments.items() if n == 1}
        self._ready = [threading.Event() for _ in range(lm.num_layers)]
        self._error: BaseException | None = None
        self.busy = 0.0
        self.waited = 0.0
        self.stages = dict.fromkeys(STAGES, 0.0)
        if pipelined:
            self._thread = threading.Thread(target=self._run, name="cacheclip-layer-loader", daemon=True)
            self._thread.start()
        else:
            self._thread = None
            self._run()

    def _run(self) -> None:
        try:
            with torch.inference_mode():  # the cache may be an inference tensor (made under inference mode)
                self._fill_all()
        except BaseException as err:  # handed to the waiting recompute thread, re-raised there
            self._error = err
            for event in self._ready:
                event.set()
        finally:
            for source in self._sources.values():
                if isinstance(source, LayerReader):
                    source.close()

    def _fill_all(self) -> None:
        for i in range(self._lm.num_layers):
            start = time.perf_counter()
            self._fill(i)
            self.busy += time.perf_counter() - start
            self._ready[i].set()
        self._publish()

    def _publish(self) -> None:
        """Hand each chunk read from disk, now whole, to the memory tier."""
        if self._on_loaded is None:
            return
        for cid, (keys, values) in self._loaded.items():
            source = self._sources[cid]
            if isinstance(source, LayerReader) and len(keys) == self._lm.num_layers:
                self._on_loaded(cid, ChunkKV(keys, values, source.token_ids, source.offsets, source.start_pos))

    def _read(self, chunk_id: str, i: int, delta: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Layer i of a chunk: K, V and the positions K is still to be moved by. A reader's layers
        are read DECODE_BLOCK at a time and kept for the memory tier; a compressed record's are
        decoded into one tensor, whose keys are moved by `delta` at once (`_move`)."""
        source = self._sources[chunk_id]
        if isinstance(source, ChunkKV):
            return source.keys[i], source.values[i], delta
        keys, values = self._loaded[chunk_id]
        moved = self._moved.setdefault(chunk_id, [])
        if len(keys) <= i:
            if source.compressed:
                block_keys, block_values = source.block(len(keys), i + DECODE_BLOCK)
                if chunk_id in self._once:  # at several places in a request, each segment moves its own
                    moved += self._move(block_keys, len(keys), delta)
                more_keys, more_values = block_keys.unbind(0), block_values.unbind(0)
            else:  # stored as used: no copy before the per-layer move
                more_keys, more_values = source.layers(len(keys), i + DECODE_BLOCK)
            keys += more_keys
            values += more_values
        if len(moved) <= i:
            return keys[i], values[i], delta
        k, moved[i] = moved[i], None  # written once; the request's cache holds it from here
        return k, values[i], 0

    def _move(self, keys: torch.Tensor, first: int, delta: int) -> list[torch.Tensor]:
        """Keys of layers first.. ([layers, H, T, D], decoded) moved by `delta` positions on the
        cache's device, one `rerotate` call for each run of layers that share RoPE frequencies
        (every layer of most families). Only for a block that is one tensor already: stacking
        per-layer tensors (bf16 records, the memory tier) to move them together measured 25-40%
        slower than moving them layer by layer (the stack's copy and a working set past the caches)."""
        start_time = time.perf_counter()
        keys = keys.to(self._cache.keys[0].device, non_blocking=True)
        out: list[torch.Tensor] = []
        start = 0
        while start < keys.shape[0]:
            inv_freq = self._lm.family.inv_freq(first + start)
            stop = start + 1
            while stop < keys.shape[0] and self._lm.family.inv_freq(first + stop) is inv_freq:
                stop += 1
            out += rerotate(keys[start:stop], delta, inv_freq).unbind(0)
            start = stop
        self.stages["rotate"] += time.perf_counter() - start_time
        return out

    def _fill(self, i: int) -> None:
        stages, inv_freq = self.stages, self._lm.family.inv_freq(i)
        for seg in self._layout.chunk_segments():
            start = time.perf_counter()
            rotated = stages["rotate"]
            delta = int(self._positions[seg.start]) - self._sources[seg.chunk_id].start_pos
            try:
                k, v, still = self._read(seg.chunk_id, i, delta)
            except DamagedCacheError as err:
                log.warning("chunk %s: cache damaged at layer %d (%s); re-encoding it", seg.chunk_id, i, err)
                self._sources[seg.chunk_id] = self._rebuild(seg.chunk_id, err)
                delta = int(self._positions[seg.start]) - self._sources[seg.chunk_id].start_pos
                k, v, still = self._read(seg.chunk_id, i, delta)
            read = time.perf_counter()
            stages["read"] += read - start - (stages["rotate"] - rotated)  # a block's move is timed in _move
            device = self._cache.keys[i].device
            k = rerotate(k.to(device, non_blocking=True), still, inv_freq)
            moved = time.perf_counter()
            stages["rotate"] += moved - read
            write_segment(self._cache, i, seg, k, v)
            stages["write"] += time.perf_counter() - moved

    def wait(self, layer: int) -> None:
        start = time.perf_counter()
        self._ready[layer].wait()
        self.waited += time.perf_counter() - start
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        """Block until every layer is in place (decoding reads them all)."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error


def _cannot_rebuild(chunk_id: str, err: Exception) -> ChunkKV:
    raise err


def start_assembly(lm: LoadedModel, layout: Layout, prefix_kv: ChunkKV, sources: dict[str, Source],
                   positions: torch.Tensor | None = None, capacity: int | None = None,
                   rebuild: Callable[[str, Exception], ChunkKV] | None = None, pipelined: bool = False,
                   on_loaded: Callable[[str, ChunkKV], None] | None = None) -> tuple[AssembledCache, LayerFeeder]:
    """Preallocate a request's cache, write its one prefix copy, and start filling the chunk
    layers (on a thread when pipelined; `LayerFeeder.wait(l)` before reading layer l).

    positions: [N] RoPE position per sequence index (default: the index). capacity: rows to
    allocate (>= N; room for decoding). Rows of plain-text segments stay zero: they are
    recomputed before anything reads them. rebuild: (chunk id, error) -> a fresh cache for a
    source found damaged while loading (default: the error is raised).
    """
    positions = positions if positions is not None else torch.arange(layout.num_tokens)
    cache = AssembledCache.empty(lm, max(capacity or 0, layout.num_tokens))
    write_prefix(cache, layout, prefix_kv)
    feeder = LayerFeeder(lm, layout, sources, positions, cache, rebuild or _cannot_rebuild, pipelined=pipelined,
                         on_loaded=on_loaded)
    return cache, feeder


def assemble(lm: LoadedModel, layout: Layout, prefix_kv: ChunkKV, chunk_kvs: dict[str, ChunkKV],
             positions: torch.Tensor | None = None, capacity: int | None = None) -> AssembledCache:
    """The whole assembled cache from chunk caches in memory: `start_assembly` run to the end
    (one prefix copy, then each chunk's cache with keys re-rotated to its position)."""
    for seg in layout.chunk_segments():
        assert torch.equal(chunk_kvs[seg.chunk_id].token_ids, seg.ids), f"cache of {seg.chunk_id} holds other tokens"
    cache, feeder = start_assembly(lm, layout, prefix_kv, chunk_kvs, positions, capacity)
    feeder.finish()
    return cache
