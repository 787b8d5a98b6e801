"""Probe: the primary layer loader's time for one 4K request, run inline (not pipelined)."""
import time, statistics, cProfile, pstats, pathlib
import torch
from cacheclip_rag.engine import CacheClipEngine
from cacheclip_rag.haystack import needle_context
from cacheclip_rag.pipeline import LayerFeeder
from cacheclip_rag.recompute import AssembledCache
from cacheclip_rag.assemble import write_prefix
eng = CacheClipEngine.from_pretrained(store_dir=str(pathlib.Path.home() / ".cache/cacheclip-rag/bench-store"))
ctx, q, exp = needle_context(eng.primary.lm.tokenizer, 4096, 1234 + 4096)
ids = eng.ingest([ctx], progress=False)
def once():
    eng.store.clear_memory()
    p = eng.prepare(q, chunk_ids=ids, recompute_ratio=0.2, budget="keep")
    t = time.perf_counter()
    srcs = {s.chunk_id: p.primary.open_layers(s.chunk_id, s.text) for s in p.layout.chunk_segments()}
    cache = AssembledCache.empty(p.primary.lm, p.layout.num_tokens + 32)
    write_prefix(cache, p.layout, p.primary.prefix())
    f = LayerFeeder(p.primary.lm, p.layout, srcs, torch.arange(p.layout.num_tokens), cache, p.primary.rebuild, pipelined=False)
    return time.perf_counter() - t, f.busy
once()
r = [once() for _ in range(5)]
print("open+feed median %.4f busy %.4f" % (statistics.median(x[0] for x in r), statistics.median(x[1] for x in r)))
pr = cProfile.Profile(); pr.enable()
for _ in range(3): once()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(15)
