"""Probe: int8 linear layers for the default primary, on the needle suite, beside float32.

Usage: python scripts/probe_int8.py [--samples 2] [--lengths 2048] [--json PATH]
Runs `full` and `cacheclip@0.2` (budget-keeping) on needle samples (multikey_1, multivalue,
multiquery) with the primary in its auto dtype, then quantizes every `nn.Linear` of its decoder
layers in place (torch's dynamic int8 quantization: weights int8 per tensor, activations quantized
per call; fbgemm/oneDNN integer kernels) and runs the same samples again. The chunk caches stay
the ones encoded before quantizing, so cacheclip's int8 score mixes the two; its TTFT is what the
probe measures. Issue #32's bar for shipping int8: cacheclip@0.2's TTFT down by >= 25% with full
attention's needle score within 2 points.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict

import torch
from torch.ao.quantization import quantize_dynamic

from cacheclip_rag import CacheClipEngine
from cacheclip_rag.config import ChunkConfig, EngineConfig
from cacheclip_rag.eval import needle
from cacheclip_rag.hardware import describe
from cacheclip_rag.paths import cache_dir

VARIANTS = ["multikey_1", "multivalue", "multiquery"]
MODES = [("full", 1.0), ("cacheclip", 0.2)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(describe(), flush=True)
    engine = CacheClipEngine.from_pretrained(store_dir=str(cache_dir() / "bench-store"),
                                             config=EngineConfig(chunk=ChunkConfig(chunk_tokens=256, overlap_tokens=0)))
    results = {}
    for name in (str(engine.primary.lm.dtype).removeprefix("torch."), "int8"):
        if name == "int8":
            quantize_dynamic(engine.primary.lm.model.model.layers, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
        start = time.time()
        results[name] = needle.run(engine, MODES, variants=VARIANTS, lengths=args.lengths, samples=args.samples,
                                   budget="keep", progress=lambda m: print(name, m, f"{time.time() - start:.0f} s", flush=True))
    base, quant = results.values()
    print(f"{'len':>5} {'mode':<10} {'score':>7} {'int8':>7} {'TTFT s':>7} {'int8':>7} {'int8/base':>9} {'same answers':>12}")
    for length in args.lengths:
        for mode, _ in MODES:
            pairs = [(a, b) for a, b in zip(base, quant) if a.mode == mode and a.length == length]
            t_a, t_b = (statistics.median(r.ttft for r in rs) for rs in zip(*pairs))
            s_a, s_b = (100 * statistics.mean(r.score for r in rs) for rs in zip(*pairs))
            same = sum(a.answer == b.answer for a, b in pairs)
            print(f"{length:>5} {mode:<10} {s_a:>7.1f} {s_b:>7.1f} {t_a:>7.2f} {t_b:>7.2f} {t_b / t_a:>9.2f} {same:>9}/{len(pairs)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: [asdict(r) for r in v] for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
