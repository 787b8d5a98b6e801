"""Probe: one cacheclip request under three schedules: the aux selection overlapped with loading;
selected first, then loading layer-wise beside recompute; everything in turn on one thread.

Usage: python scripts/probe_overlap.py [LENGTH] [RUNS]
Two engines share the loaded models and the bench store; requests alternate between them, cold
(memory tier emptied), and the medians of TTFT, selection and recompute are printed per schedule.
"""

import dataclasses
import statistics
import sys
from pathlib import Path

from cacheclip_rag.config import EngineConfig, PipelineConfig
from cacheclip_rag.engine import CacheClipEngine
from cacheclip_rag.hardware import describe
from cacheclip_rag.haystack import needle_context

length = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
store = Path.home() / ".cache/cacheclip-rag/bench-store"
base = CacheClipEngine.from_pretrained(store_dir=store)
engines = {
    name: CacheClipEngine(base.primary.lm, base.aux.lm, store,
                          dataclasses.replace(EngineConfig(), pipeline=PipelineConfig(overlap, layerwise)))
    for name, overlap, layerwise in (("overlapped", True, True), ("select first", False, True),
                                     ("all serial", False, False))
}
ctx, q, _ = needle_context(base.primary.lm.tokenizer, length, 1234 + length)
ids = base.ingest([ctx], progress=False)
keys = ("ttft", "selection", "selection_hidden", "load_wait", "assemble", "recompute")
got = {name: {k: [] for k in keys} for name in engines}
for eng in engines.values():  # warm-up
    eng.answer(q, chunk_ids=ids, max_new_tokens=1)
for _ in range(runs):
    for name, eng in engines.items():
        eng.store.clear_memory()
        t = eng.answer(q, chunk_ids=ids, recompute_ratio=0.2, max_new_tokens=1).timings
        for k in keys:
            got[name][k].append(t.get(k, 0.0))
print(describe(), f"; {length} tokens, {runs} runs each, medians (s)")
print(f"{'schedule':<13}" + "".join(f"{k:>17}" for k in keys))
for name, cols in got.items():
    print(f"{name:<13}" + "".join(f"{statistics.median(v):>17.3f}" for v in cols.values()))
