"""`cacheclip bench recompute-profile`: where a request's selective recompute goes, by operator.

Assembles one cacheclip request's cache once, then profiles `recompute_rows` (on copies of that
cache) and the model's own full prefill of the same tokens with torch.profiler, grouped by
operator (self CPU time), each beside its unprofiled wall time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from cacheclip_rag import CacheClipEngine
from cacheclip_rag.analysis import assemble, needle_context, recompute_rows


def run(engine: CacheClipEngine, length: int, ratio: float = 0.2, full: bool = True, rows_shown: int = 14) -> dict:
    """{"tokens", "rows", "runs": [{"name", "seconds", "table", "ops": [{"name", "self_cpu_s", "calls"}]}]}."""
    ctx, question, _ = needle_context(engine.primary.lm.tokenizer, length, 1234 + length)
    ids = engine.ingest([ctx], progress=False)
    prepared = engine.prepare(question, chunk_ids=ids, mode="cacheclip", recompute_ratio=ratio)
    plan = prepared.selector.plan_for(prepared)
    layout, lm = prepared.layout, engine.primary.lm
    rows = torch.unique(torch.cat([layout.uncached_rows(), plan.rows]))
    cache = assemble(lm, layout, prepared.prefix_kv(), prepared.chunk_kvs())

    def recompute():
        recompute_rows(lm, cache.copy(), layout.input_ids, rows)

    def prefill():
        with torch.inference_mode():
            lm.model(input_ids=layout.input_ids[None].to(lm.device), use_cache=True, logits_to_keep=1)

    out = {"tokens": layout.num_tokens, "rows": int(rows.numel()), "runs": []}
    for name, fn in (("recompute", recompute), *((("full", prefill),) if full else ())):
        fn()  # warm-up
        t = time.perf_counter()
        fn()
        wall = time.perf_counter() - t
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        averages = prof.key_averages()
        ops = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:rows_shown]
        out["runs"].append({"name": name, "seconds": wall,
                            "table": averages.table(sort_by="self_cpu_time_total", row_limit=rows_shown,
                                                    max_name_column_width=40),
                            "ops": [{"name": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "calls": e.count}
                                    for e in ops]})
    return out


def report(result: dict) -> str:
    n = result["tokens"]
    lines = [f"{n} tokens, {result['rows']} rows recomputed ({result['rows'] / n:.3f})"]
    for r in result["runs"]:
        lines += [f"\n== {r['name']}: {r['seconds']:.3f} s (unprofiled)", r["table"]]
    return "\n".join(lines)


def write_json(result: dict, path: str | Path, cpu: str) -> None:
    Path(path).write_text(json.dumps({"cpu": cpu, **{k: v for k, v in result.items() if k != "runs"},
                                      "runs": [{k: v for k, v in r.items() if k != "table"} for r in result["runs"]]},
                                     indent=1))
