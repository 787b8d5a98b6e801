"""Probe: where a 4K cacheclip request's aux selection time goes (single thread of work)."""
import sys, time, cProfile, pstats, statistics
import torch
from cacheclip_rag.engine import CacheClipEngine
from cacheclip_rag.haystack import needle_context
from cacheclip_rag.plan import get as get_selector
from cacheclip_rag import select as S

length = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
eng = CacheClipEngine.from_pretrained(store_dir=str(__import__("pathlib").Path.home() / ".cache/cacheclip-rag/bench-store"))
ctx, q, exp = needle_context(eng.primary.lm.tokenizer, length, 1234 + length)
ids = eng.ingest([ctx], progress=False)
sel = get_selector("cacheclip")
def prep():
    eng.store.clear_memory()
    return eng.prepare(q, chunk_ids=ids, recompute_ratio=0.2, budget="keep")
p = prep(); print("select cfg", p.request.select, "tokens", p.layout.num_tokens)
sel.plan_for(p)
ts = []
for _ in range(5):
    p = prep(); t = time.perf_counter(); sel.plan_for(p); ts.append(time.perf_counter() - t)
print("plan_for median %.4f  all %s" % (statistics.median(ts), [round(x, 4) for x in ts]))
# pieces
deep = max(S.scoring_layers(p.aux.lm, p.request.select.score_layers)) + 1
tr = []
for _ in range(5):
    p = prep(); t = time.perf_counter(); kvs = p.aux_kvs(layers=deep); tr.append(time.perf_counter() - t)
print("aux_kvs read median %.4f" % statistics.median(tr), "MB", sum(kv.nbytes for kv in kvs) / 2**20)
qids = p.aux_query_ids(); pre = p.aux_prefix_kv()
cfg = p.request.select
fn = S.score_joint_by_layer if cfg.context == "joint" else S.score_chunks_by_layer
tf = []
for _ in range(5):
    t = time.perf_counter(); fn(p.aux.lm, pre, kvs, qids, cfg.score_layers, cfg.head_agg, cfg.row_agg); tf.append(time.perf_counter() - t)
print("score forward median %.4f  Q=%d" % (statistics.median(tf), qids.numel()))
pr = cProfile.Profile(); pr.enable()
for _ in range(3):
    p = prep(); sel.plan_for(p)
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(25)
