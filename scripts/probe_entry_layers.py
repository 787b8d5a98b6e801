"""Probe: recompute some rows only in the upper layers, entering from their reused hidden state.

Usage: python scripts/probe_entry_layers.py [--samples 4] [--lengths 2048] [--json PATH]

A recomputed row costs the same in every layer, so a row recomputed from layer e on costs
(L - e) / L of one recomputed from layer 0. It needs its hidden state at layer e, which reuse
does not keep; the chunk's own prefill (prefix + chunk, as `encode` runs it) has it. If the
reused cache's error that matters to the answer sat in the upper layers, twice the rows from
the middle layer would beat the same cost spent from layer 0. This measures that on the needle
suite without labels (`bench fidelity`'s KL(full || mode) over full attention's teacher-forced
answer): ProphetKV's ranking (its top rows are nested across ratios), each condition a set of
rows entering at layer 0 and a set entering at layer e, at equal cost in row-layers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from cacheclip_kernels import sparse_query_attention_ref

from cacheclip_rag import CacheClipEngine
from cacheclip_rag.config import ChunkConfig, EngineConfig
from cacheclip_rag.eval import needle
from cacheclip_rag.eval.fidelity import mode_rows
from cacheclip_rag.fidelity import kl_positions, reference, top1_agreement
from cacheclip_rag.hardware import describe
from cacheclip_rag.paths import cache_dir

VARIANTS = ["multikey_1", "multivalue", "multiquery"]


def bench_engine() -> CacheClipEngine:
    """The engine the needle benches run: the default pair, the bench store, 256-token chunks
    without overlap."""
    return CacheClipEngine.from_pretrained(store_dir=str(cache_dir() / "bench-store"),
                                           config=EngineConfig(chunk=ChunkConfig(chunk_tokens=256, overlap_tokens=0)))


@torch.inference_mode()
def isolated_hidden(engine, layout, layer: int) -> torch.Tensor:
    """[N, hidden]: each chunk row's input to `layer` in its chunk's own prefill (zeros elsewhere)."""
    lm = engine.primary.lm
    prefix = layout.input_ids[: layout.prefix_len]
    out = torch.zeros(layout.num_tokens, lm.config.hidden_size, dtype=lm.dtype)
    for seg in layout.chunk_segments():
        ids = torch.cat([prefix, seg.ids])[None].to(lm.device)
        hs = lm.model.model(input_ids=ids, output_hidden_states=True).hidden_states[layer]
        out[seg.start : seg.end] = hs[0, layout.prefix_len :].to(out.dtype).cpu()
    return out


@torch.inference_mode()
def forced(engine, ref, first: torch.Tensor, later: torch.Tensor, entry: int, hidden: torch.Tensor | None,
           early: torch.Tensor | None = None, exit: int = 0) -> torch.Tensor:
    """ref.forced with chunk rows `first` recomputed from layer 0 and `later` from layer `entry`
    (their hidden state there taken from `hidden`), and rows `early` recomputed only below layer
    `exit` (then dropped, as CacheBlend drops rows); log-probabilities [T, vocab]."""
    lm, layout, answer = engine.primary.lm, ref.layout, ref.answer
    fam = lm.family
    n, t = layout.num_tokens, int(answer.numel())
    cache = ref.base_cache.copy()
    ids = torch.cat([layout.input_ids, answer[:-1]])
    rows = torch.unique(torch.cat([layout.uncached_rows(), first, torch.arange(n, n + t - 1)]))
    later = later[~torch.isin(later, rows)]
    keep = rows
    if early is not None:
        rows = torch.unique(torch.cat([rows, early]))
    h = fam.embed(ids[rows])[None]
    last = len(fam.layers) - 1
    for layer in range(len(fam.layers)):
        if layer == entry and later.numel():
            merged = torch.cat([rows, later])
            order = torch.argsort(merged)
            rows = merged[order]
            h = torch.cat([h, hidden[later][None].to(h.dtype)], dim=1)[:, order]
        if early is not None and layer == exit:
            kept = torch.isin(rows, keep)
            rows, h = rows[kept], h[:, kept]
        rope = fam.rope(h, rows[None])
        keys, values = cache.keys[layer], cache.values[layer]
        q, k, v = fam.qkv(layer, h, rope)
        keys[:, :, rows] = k
        values[:, :, rows] = v
        q_rows = rows
        if layer == last:
            q, h, q_rows = q[:, :, -t:], h[:, -t:], rows[-t:]
        out = sparse_query_attention_ref(q, keys, values, q_rows[None], scale=fam.scaling(layer), window=fam.window(layer))
        h = fam.finish(layer, h, out)
    return torch.log_softmax(fam.logits(h[:, -t:])[0].float(), dim=-1)


def exit_conditions(layers: int) -> list[tuple[str, float, float, int]]:
    """(name, full-depth ratio, ratio below the exit layer, exit layer): nested, more rows low."""
    half, third = layers // 2, layers // 3
    return [(f"p@0.4 below {half}", 0.0, 0.4, half), (f"p@0.1 + to 0.3 below {half}", 0.1, 0.3, half),
            (f"p@0.1 + to 0.4 below {third}", 0.1, 0.4, third), (f"p@0.1 + to 0.5 below {half}", 0.1, 0.5, half),
            (f"p@0.2 + to 0.4 below {third}", 0.2, 0.4, third)]


def exit_cost(full: float, low: float, exit: int, layers: int) -> float:
    return full + (low - full) * exit / layers


def conditions(layers: int) -> list[tuple[str, float, float, int]]:
    """(name, first ratio, later ratio, entry layer); cost = first + (later - first) x (L - e) / L."""
    out = [("reuse", 0.0, 0.0, 0), ("p@0.2 from 0", 0.2, 0.2, 0), ("p@0.3 from 0", 0.3, 0.3, 0),
           ("p@0.5 from 0", 0.5, 0.5, 0)]
    half = layers // 2
    out += [(f"p@0.4 from {half}", 0.0, 0.4, half), (f"p@0.3 from {layers // 3}", 0.0, 0.3, layers // 3),
            (f"p@0.2 from 0 + to 0.4 from {half}", 0.2, 0.4, half), (f"all from {half}", 0.0, 1.0, half),
            ("all from 4", 0.0, 1.0, 4)]
    return out


def measure(ref, logprobs: torch.Tensor, **fields) -> dict:
    """One record: `fields` with the mean KL(full || these log-probabilities) over the answer and
    the share of answer positions whose top token is full attention's."""
    return dict(fields, kl=float(kl_positions(ref.full_logprobs, logprobs).mean()),
                agree=float(top1_agreement(ref.full_logprobs, logprobs).float().mean()))


def report(records: list[dict], lengths: list[int], path: str | None) -> None:
    """Print one line per (length, condition, cost), means over samples; write the records as JSON."""
    print(f"{'len':>5} {'condition':<34} {'cost':>5} {'KL(full||.)':>11} {'top-1':>6} {'n':>3}")
    for length in lengths:
        keys = dict.fromkeys((r["condition"], r["cost"]) for r in records if r["length"] == length)
        for name, c in keys:
            sel = [r for r in records if r["length"] == length and (r["condition"], r["cost"]) == (name, c)]
            print(f"{length:>5} {name:<34} {c:>5.2f} {statistics.mean(r['kl'] for r in sel):>11.4f} "
                  f"{100 * statistics.mean(r['agree'] for r in sel):>5.1f}% {len(sel):>3}")
    if path:
        with open(path, "w") as f:
            json.dump(records, f, indent=1)


def cost(first: float, later: float, entry: int, layers: int) -> float:
    return first + (later - first) * (layers - entry) / layers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--json", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exits", action="store_true", help="also rows recomputed only in the lower layers")
    ap.add_argument("--no-entries", action="store_true", help="skip the late-entry conditions")
    args = ap.parse_args()
    print(describe(), flush=True)
    engine = bench_engine()
    layers = engine.primary.lm.num_layers
    records = []
    start = time.time()
    for length, variant, seed, sample, ids in needle.suite(engine, VARIANTS, args.lengths, args.samples, args.seed):
        ref = reference(engine, sample.question, ids, 64)
        if ref is None:
            continue
        chunk_rows = ref.layout.chunk_rows()
        ranked = {r: mode_rows(engine, sample.question, ids, ref, "prophetkv", r, seed, "keep")[0] for r in (0.1, 0.2, 0.3, 0.4, 0.5)}
        ranked[0.0], ranked[1.0] = torch.empty(0, dtype=torch.long), chunk_rows
        hidden = {}
        conds = conditions(layers)
        if args.no_entries:
            conds = [c for c in conds if c[3] == 0]
        for name, r_first, r_later, entry in conds:
            if entry not in hidden:
                hidden[entry] = isolated_hidden(engine, ref.layout, entry)
            lp = forced(engine, ref, ranked[r_first], ranked[r_later], entry, hidden[entry])
            records.append(measure(ref, lp, length=length, variant=variant, seed=seed, condition=name,
                                   cost=cost(r_first, r_later, entry, layers)))
        for name, r_full, r_low, exit in exit_conditions(layers) if args.exits else ():
            lp = forced(engine, ref, ranked[r_full], ranked[r_full], 0, None, early=ranked[r_low], exit=exit)
            records.append(measure(ref, lp, length=length, variant=variant, seed=seed, condition=name,
                                   cost=exit_cost(r_full, r_low, exit, layers)))
        # the probe's loop against the library's replay, on one shared condition
        check = float(kl_positions(ref.forced(engine, ranked[0.2]), forced(engine, ref, ranked[0.2], ranked[0.2], 0, hidden[0])).mean())
        print(f"{length} {variant} seed {seed} done, {time.time() - start:.0f} s (loop vs replay KL {check:.2e})", flush=True)
    report(records, args.lengths, args.json)


if __name__ == "__main__":
    main()
