"""Probe: where a 4K cacheclip request's selective recompute goes, beside a full prefill.

Usage: python scripts/probe_recompute.py [LENGTH] [--kind plain|split|matmul] [--no-full]
(--kind: the CPU attention's block kind instead of the default for the dtype; --no-full: skip
the full prefill)
Assembles the request's cache once, then profiles `recompute_rows` (copies of that cache) and
the model's own full prefill with torch.profiler, grouped by operator (self CPU time).
"""

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from cacheclip_rag.assemble import assemble
from cacheclip_rag.engine import CacheClipEngine
from cacheclip_rag.hardware import describe
from cacheclip_rag.haystack import needle_context
from cacheclip_rag.plan import get as get_selector
from cacheclip_rag.recompute import recompute_rows

import cacheclip_kernels.blocked as blocked

parser = argparse.ArgumentParser()
parser.add_argument("length", type=int, nargs="?", default=4096)
parser.add_argument("--kind", choices=blocked.KINDS)
parser.add_argument("--no-full", action="store_true")
args = parser.parse_args()
length = args.length
blocked.DEFAULT_KIND = args.kind
eng = CacheClipEngine.from_pretrained(store_dir=Path.home() / ".cache/cacheclip-rag/bench-store")
ctx, q, _ = needle_context(eng.primary.lm.tokenizer, length, 1234 + length)
ids = eng.ingest([ctx], progress=False)
p = eng.prepare(q, chunk_ids=ids, recompute_ratio=0.2, budget="keep")
plan = get_selector("cacheclip").plan_for(p)
layout, lm = p.layout, eng.primary.lm
rows = torch.unique(torch.cat([layout.uncached_rows(), plan.rows]))
kvs = {s.chunk_id: eng.store.get_kv(eng.primary.namespace, s.chunk_id) for s in layout.chunk_segments()}
cache = assemble(lm, layout, eng.primary.prefix(), kvs)
n = layout.num_tokens
print(describe(), f"; {n} tokens, {rows.numel()} rows recomputed ({rows.numel() / n:.3f}), "
      f"mean position {rows.float().mean() / n:.2f}")


def run_recompute():
    recompute_rows(lm, cache.copy(), layout.input_ids, rows)


def run_full():
    with torch.inference_mode():
        lm.model(input_ids=layout.input_ids[None], use_cache=True, logits_to_keep=1)


for name, fn in (("recompute", run_recompute),) + ((("full", run_full),) if not args.no_full else ()):
    fn()
    t = time.perf_counter()
    fn()
    wall = time.perf_counter() - t
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    print(f"\n== {name}: {wall:.3f} s (unprofiled)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))
