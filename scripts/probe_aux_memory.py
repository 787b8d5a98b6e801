"""Probe: what keeping the aux scoring pass's layers in the memory tier saves a request.

The aux pass reads each chunk's aux cache up to its deepest scoring layer. Before partial
memory entries it read them from the store on every request (a whole aux cache was in memory
only after an encode); now a request whose chunks were read before finds them in memory. This
times, on one request of `--length` tokens over a store (a folder or a redis:// URL), with the
default pair and its profile:

- the aux reads alone (`Prepared.aux_kvs(layers=deepest)`): memory tier cleared first (what every
  request paid before) against a warm tier (what a repeated chunk pays now);
- the selection (`plan_for`), cold and warm likewise;
- TTFT of `cacheclip@0.2` end to end, cold tier against warm tier (primary and aux both warm).

Cold and warm runs alternate; medians.

    python scripts/probe_aux_memory.py --store redis://127.0.0.1:6390/0 --length 4096 --runs 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from cacheclip_rag.engine import CacheClipEngine
from cacheclip_rag.haystack import needle_context
from cacheclip_rag.plan import get as get_selector
from cacheclip_rag.selectors.cacheclip import CacheClip


def alternated(runs: int, fn, eng) -> tuple[float, float]:
    """Medians of `fn` over `runs` pairs, each a run on a cleared memory tier then one on the tier
    that run filled (alternated, so the host's drift falls on both)."""
    cold, warm = [], []
    for _ in range(runs):
        for times, clear in ((cold, True), (warm, False)):
            if clear:
                eng.store.clear_memory()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(cold), statistics.median(warm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="a folder or a redis:// URL")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    eng = CacheClipEngine.from_pretrained(store_dir=args.store)
    ctx, question, _ = needle_context(eng.primary.lm.tokenizer, args.length, 1234 + args.length)
    ids = eng.ingest([ctx], progress=False)
    selector = get_selector("cacheclip")

    def prepared():
        return eng.prepare(question, chunk_ids=ids, recompute_ratio=0.2, budget="keep")

    p = prepared()
    _, aux_kvs, _ = CacheClip.scoring(p)  # what the selector reads: up to its deepest scoring layer
    deepest = len(aux_kvs[0].keys)
    read = [kv.nbytes for kv in aux_kvs]
    print(f"store {eng.store.location}; {p.layout.num_tokens} tokens, {len(read)} chunks; aux layers read: "
          f"{deepest} of {p.aux.lm.num_layers}, {sum(read) / 2**20:.1f} MB")

    rows = []
    for what, fn in [("aux reads", lambda: prepared().aux_kvs(layers=deepest)),
                     ("selection", lambda: selector.plan_for(prepared())),
                     ("TTFT cacheclip@0.2", lambda: eng.answer(question, chunk_ids=ids, recompute_ratio=0.2,
                                                               budget="keep", max_new_tokens=1))]:
        fn()  # warm up
        rows.append((what, *alternated(args.runs, fn, eng)))
    print(f"{'':20s} {'cold tier s':>12s} {'warm tier s':>12s} {'saved s':>8s}")
    for what, cold, warm in rows:
        print(f"{what:20s} {cold:12.4f} {warm:12.4f} {cold - warm:8.4f}")
    eng.close()


if __name__ == "__main__":
    main()
