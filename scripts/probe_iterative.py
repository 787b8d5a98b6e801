"""Probe: ProphetKV's selection read again after a first repair (iterative recompute).

Usage: python scripts/probe_iterative.py [--samples 2] [--lengths 2048] [--json PATH]

ProphetKV reads the question's attention over the *unrepaired* reused cache. If that reading is
misled (at 4K it often answers a later needle's value), reading it again over a cache where the
first rows are already repaired might choose the rest better. Cost: the first rows once, the
second rows once, and the question rows one extra time. Measured without labels on the needle
suite (`bench fidelity`'s KL(full || mode) over full attention's teacher-forced answer):
single-shot ProphetKV at 0.2 and 0.3 against first 0.1 (or 0.2) then the next 0.1 by the second
reading. And the bound on any reading: ProphetKV's scores read over full attention's own cache
(`full-reading`, analysis only: it needs the full prefill it is meant to avoid).
"""

from __future__ import annotations

import argparse
import time

import torch

from cacheclip_rag.eval import needle
from cacheclip_rag.eval.fidelity import mode_rows
from cacheclip_rag.fidelity import reference
from cacheclip_rag.hardware import describe
from cacheclip_rag.recompute import recompute_rows
from cacheclip_rag.select import rows_attention
from probe_entry_layers import VARIANTS, bench_engine, measure, report  # scripts/ is on the path when a script runs


@torch.inference_mode()
def repair_and_read(engine, ref, cache, rows: torch.Tensor) -> torch.Tensor:
    """Recompute chunk `rows` and every plain-text row in `cache` (in place), reading the query rows'
    attention over the chunk rows as ProphetKV's first stage does (max over heads, each layer
    normalised, mean over layers): scores [C] in chunk_rows order."""
    lm, layout = engine.primary.lm, ref.layout
    chunk_rows = layout.chunk_rows()
    query_start = layout.chunk_segments()[-1].end
    per_layer = []

    def observe(layer, q, seen):
        wanted = seen >= query_start
        att = rows_attention(lm, layer, q[:, :, wanted], cache.keys[layer], seen[wanted], layout.num_tokens, heads="max")
        on = att[chunk_rows].cpu()
        per_layer.append(on / on.sum().clamp_min(1e-12))

    all_rows = torch.unique(torch.cat([layout.uncached_rows(), rows]))
    recompute_rows(lm, cache, layout.input_ids, all_rows, observe=observe)  # rows' K/V are written before observe
    return torch.stack(per_layer).mean(0)


@torch.inference_mode()
def force_on(engine, ref, cache, rows: torch.Tensor) -> torch.Tensor:
    """Teacher-force full attention's answer through `cache` (a copy), recomputing chunk `rows`,
    every plain-text row and the answer rows: log-probabilities [T, vocab]."""
    layout, answer = ref.layout, ref.answer
    n, t = layout.num_tokens, int(answer.numel())
    cache = cache.copy()
    ids = torch.cat([layout.input_ids, answer[:-1]])
    all_rows = torch.unique(torch.cat([layout.uncached_rows(), rows, torch.arange(n, n + t - 1)]))
    result = recompute_rows(engine.primary.lm, cache, ids, all_rows, tail=t)
    return torch.log_softmax(result.tail_logits if t > 1 else result.logits[None], dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--json", default=None)
    ap.add_argument("--iterative", type=lambda t: tuple(map(float, t.split("+"))), nargs="*",
                    default=[(0.1, 0.1), (0.2, 0.1), (0.1, 0.2)], help="first+extra pairs, e.g. 0.1+0.1")
    args = ap.parse_args()
    print(describe(), flush=True)
    engine = bench_engine()
    records, start = [], time.time()

    def record(length, variant, seed, name, cost, lp, ref):
        records.append(measure(ref, lp, length=length, variant=variant, seed=seed, condition=name, cost=cost))

    for length, variant, seed, sample, ids in needle.suite(engine, VARIANTS, args.lengths, args.samples, args.seed):
        ref = reference(engine, sample.question, ids, 64)
        if ref is None:
            continue
        chunk_rows = ref.layout.chunk_rows()
        n_c = chunk_rows.numel()
        ranked = {r: mode_rows(engine, sample.question, ids, ref, "prophetkv", r, seed, "keep")[0] for r in (0.1, 0.2, 0.3)}
        for r, rows in ranked.items():
            record(length, variant, seed, f"prophetkv@{r}", r, ref.forced(engine, rows), ref)
        full_scores = repair_and_read(engine, ref, ref.base_cache.copy(), chunk_rows)
        for r in (0.1, 0.2, 0.3):
            rows = torch.sort(chunk_rows[torch.topk(full_scores, round(r * n_c)).indices]).values
            record(length, variant, seed, f"full-reading@{r}", r, ref.forced(engine, rows), ref)
        for first, extra in args.iterative:
            cache = ref.base_cache.copy()
            scores = repair_and_read(engine, ref, cache, ranked[first]).clone()
            scores[torch.isin(chunk_rows, ranked[first])] = float("-inf")
            more = chunk_rows[torch.topk(scores, round(extra * n_c)).indices]
            record(length, variant, seed, f"iterative {first}+{extra}", first + extra, force_on(engine, ref, cache, more), ref)
            # the same rows, all recomputed in one pass: is it the choice or the two passes?
            record(length, variant, seed, f"  same rows in one pass {first}+{extra}", first + extra,
                   ref.forced(engine, torch.unique(torch.cat([ranked[first], more]))), ref)
        print(f"{length} {variant} seed {seed} done, {time.time() - start:.0f} s", flush=True)
    report(records, args.lengths, args.json)


if __name__ == "__main__":
    main()
