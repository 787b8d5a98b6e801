"""Full prefill of the default primary in float32 and bf16 on this CPU, interleaved runs.

Usage: python scripts/probe_dtype.py [--tokens 2048] [--runs 2] [--int8] [--torchao] [--no-bf16] [--text]
Prints seconds per prefill (median) per dtype and the bf16/float32 ratio, with the CPU flags.
--int8 adds the float32 model with int8 linear layers (torch's dynamic quantization: weights
int8, activations quantized per call, fbgemm/oneDNN integer kernels), the option issue #32 asks
to measure, and its greedy next-token agreement with float32 on the same tokens.
--torchao adds torchao's int8 weight-only and int8 dynamic-activation (per-token) versions of
the decoder's linear layers. --no-bf16 skips bf16 (emulated, slow, on CPUs without it).
--text prefills a needle haystack instead of random tokens and compares the greedy picks on
its last 64 positions (8 on random tokens).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from cacheclip_rag.config import ModelConfig
from cacheclip_rag.hardware import describe
from cacheclip_rag.models import DEFAULT_PRIMARY, load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--int8", action="store_true", help="add int8 linear layers (dynamic quantization)")
    ap.add_argument("--torchao", action="store_true", help="add torchao's int8 weight-only and dynamic-activation layers")
    ap.add_argument("--no-bf16", action="store_true")
    ap.add_argument("--text", action="store_true", help="a needle haystack instead of random tokens")
    args = ap.parse_args()
    name = args.model or DEFAULT_PRIMARY
    models = {d: load(name, ModelConfig(dtype=d)) for d in ("float32",) + (() if args.no_bf16 else ("bfloat16",))}
    if args.int8:
        from torch.ao.quantization import quantize_dynamic

        quantized = copy.deepcopy(models["float32"])
        quantized.model = quantize_dynamic(quantized.model, {torch.nn.Linear}, dtype=torch.qint8)
        models["int8"] = quantized
    if args.torchao:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

        for label, config in (("ao-int8-weights", Int8WeightOnlyConfig()), ("ao-int8-dynamic", Int8DynamicActivationInt8WeightConfig())):
            quantized = copy.deepcopy(models["float32"])
            quantize_(quantized.model.model.layers, config)
            models[label] = quantized
    if args.text:
        from cacheclip_rag.haystack import needle_context

        context, question, _ = needle_context(models["float32"].tokenizer, args.tokens, 5)
        ids = models["float32"].tokenizer(context + "\n" + question, return_tensors="pt").input_ids[:, : args.tokens]
    else:
        ids = torch.randint(100, 20000, (1, args.tokens))
    keep = 64 if args.text else 8
    times = {d: [] for d in models}
    picks = {}
    with torch.inference_mode():
        for d, lm in models.items():  # warm-up
            lm.model(input_ids=ids[:, :64], use_cache=False, logits_to_keep=1)
        for _ in range(args.runs):
            for d, lm in models.items():
                t = time.perf_counter()
                out = lm.model(input_ids=ids, use_cache=True, logits_to_keep=keep)
                times[d].append(time.perf_counter() - t)
                picks[d] = out.logits[0].float().argmax(-1)
    print(describe(), f"; torch {torch.__version__}, {torch.get_num_threads()} threads")
    med = {d: statistics.median(v) for d, v in times.items()}
    for d, v in times.items():
        print(f"{d:<9} {args.tokens} tokens prefill: median {med[d]:.2f} s  runs {[round(x, 2) for x in v]}")
    for d in models:
        if d != "float32":
            same = (picks[d] == picks["float32"]).float().mean().item()
            print(f"{d} / float32 = {med[d] / med['float32']:.2f}; greedy picks as float32's on the last {keep} "
                  f"positions: {100 * same:.0f}%")


if __name__ == "__main__":
    main()
