"""`cacheclip bench schedules`: one request under the three schedules of its stages.

overlapped: the aux selection runs on its worker thread while the primary caches are loaded
layer by layer beside recompute (CacheClip's placement); select first: the selection, then the
layer-wise loading beside recompute; all serial: everything in turn on one thread. Engines
sharing the loaded models and one store alternate request by request, cold (memory tier
emptied before each), and the medians of the stage timings are reported.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from cacheclip_rag import CacheClipEngine
from cacheclip_rag.analysis import PipelineConfig, needle_context

SCHEDULES = (("overlapped", True, True), ("select first", False, True), ("all serial", False, False))
KEYS = ("ttft", "selection", "selection_hidden", "load_wait", "assemble", "recompute")


def run(engine: CacheClipEngine, length: int, runs: int = 3, ratio: float = 0.2, seed: int = 0,
        progress=None) -> list[dict]:
    """Per schedule: the median of each of `KEYS` (seconds) over `runs` cold requests of
    cacheclip@ratio on one needle haystack of `length` tokens."""
    ctx, question, _ = needle_context(engine.primary.lm.tokenizer, length, 1234 + length + seed)
    ids = engine.ingest([ctx], progress=False)
    engines = {name: CacheClipEngine(engine.primary.lm, engine.aux.lm, engine.store.location,
                                     dataclasses.replace(engine.config, pipeline=PipelineConfig(overlap, layerwise)))
               for name, overlap, layerwise in SCHEDULES}
    got = {name: {k: [] for k in KEYS} for name in engines}
    try:
        for eng in engines.values():  # warm-up
            eng.answer(question, chunk_ids=ids, mode="cacheclip", recompute_ratio=ratio, max_new_tokens=1)
        for _ in range(runs):
            for name, eng in engines.items():
                eng.store.clear_memory()
                timings = eng.answer(question, chunk_ids=ids, mode="cacheclip", recompute_ratio=ratio,
                                     max_new_tokens=1).timings
                for k in KEYS:
                    got[name][k].append(timings.get(k, 0.0))
                if progress:
                    progress(name)
    finally:
        for eng in engines.values():
            eng.close()
    return [{"schedule": name, "length": length, "runs": runs, **{k: statistics.median(v) for k, v in cols.items()}}
            for name, cols in got.items()]


def table(rows: list[dict]) -> str:
    lines = [f"{'schedule':<13}" + "".join(f"{k:>17}" for k in KEYS)]
    lines += [f"{r['schedule']:<13}" + "".join(f"{r[k]:>17.3f}" for k in KEYS) for r in rows]
    return "\n".join(lines)


def write_json(rows: list[dict], path: str | Path, cpu: str) -> None:
    Path(path).write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1))
