"""Benchmark: sparse-query kernel vs its torch reference vs dense causal SDPA over all N rows.

    python -m cacheclip_bench.kernel                 # on a GPU: N in 2K/8K/16K, M/N in 0.1/0.2/0.5
    TRITON_INTERPRET=1 python -m cacheclip_bench.kernel --cpu   # CPU interpreter, tiny shapes

Rows are a random (scattered) subset of positions, as CacheClip's recompute step produces.
Times are medians; ratios are against dense SDPA in the same run. Interpreter numbers measure
the interpreter, not the kernel: they are labelled so and are no speed figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from cacheclip_kernels import (
    causal_position_mask,
    sparse_query_attention,
    sparse_query_attention_ref,
)


def _time(fn, device: str, reps: int) -> float:
    """Median milliseconds of fn()."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=reps * 10, return_mode="median"))
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _flash_ms(q, k, v, reps: int) -> float | None:
    """Dense causal attention through FlashAttention's kernel (torch's SDPA flash backend), or
    None where torch does not expose it for these shapes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), "cuda", reps)
    except RuntimeError:
        return None


def run(lengths, fractions, heads=14, kv_heads=2, head_dim=64, dtype=torch.bfloat16, device="cuda", reps=20, window=None):
    """Dense is causal SDPA over all N rows (with the same sliding window as a boolean mask when one is given)."""
    rows = []
    for n in lengths:
        for frac in fractions:
            m = max(1, int(n * frac))
            g = torch.Generator(device="cpu").manual_seed(n + m)
            q = torch.randn(1, heads, m, head_dim, generator=g).to(device, dtype)
            k = torch.randn(1, kv_heads, n, head_dim, generator=g).to(device, dtype)
            v = torch.randn(1, kv_heads, n, head_dim, generator=g).to(device, dtype)
            pos = torch.sort(torch.randperm(n, generator=g)[:m]).values[None].to(device)
            q_all = torch.randn(1, heads, n, head_dim, generator=g).to(device, dtype)
            if window is None:
                dense = _time(lambda: F.scaled_dot_product_attention(q_all, k, v, is_causal=True, enable_gqa=True), device, reps)
            else:
                band = causal_position_mask(torch.arange(n, device=device)[None], n, window)
                dense = _time(lambda: F.scaled_dot_product_attention(q_all, k, v, attn_mask=band, enable_gqa=True), device, reps)
            flash = _flash_ms(q_all, k, v, reps) if device == "cuda" and window is None else None
            kernel = _time(lambda: sparse_query_attention(q, k, v, pos, window=window), device, reps)
            ref = _time(lambda: sparse_query_attention_ref(q, k, v, pos, window=window), device, reps)
            err = (sparse_query_attention(q, k, v, pos, window=window).float()
                   - sparse_query_attention_ref(q, k, v, pos, window=window).float()).abs().max().item()
            rows.append(dict(n=n, m=m, frac=frac, window=window, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                             kernel_ms=kernel, ref_ms=ref, dense_ms=dense, flash_ms=flash, max_err=err,
                             kernel_vs_dense=kernel / dense, ref_vs_dense=ref / dense))
    return rows


def table(rows, label: str) -> str:
    head = (f"{'N':>6} {'M/N':>5} {'kernel ms':>10} {'torch ref ms':>13} {'dense SDPA ms':>14} {'flash ms':>9} "
            f"{'kernel/dense':>13} {'ref/dense':>10} {'max err':>9}")
    lines = [label, head, "-" * len(head)]
    for r in rows:
        flash = f"{r['flash_ms']:>9.3f}" if r.get("flash_ms") is not None else f"{'-':>9}"
        lines.append(f"{r['n']:>6} {r['frac']:>5.2f} {r['kernel_ms']:>10.3f} {r['ref_ms']:>13.3f} {r['dense_ms']:>14.3f} "
                     f"{flash} {r['kernel_vs_dense']:>13.3f} {r['ref_vs_dense']:>10.3f} {r['max_err']:>9.2e}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run on CPU (needs TRITON_INTERPRET=1); tiny shapes")
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.2, 0.5])
    ap.add_argument("--window", type=int, default=None, help="sliding window (keys) for every row")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.cpu:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--cpu needs TRITON_INTERPRET=1 in the environment before Python starts")
        rows = run(args.lengths or [256, 512], args.fractions, heads=4, kv_heads=2, dtype=torch.float32, device="cpu", reps=3,
                   window=args.window)
        label = "CPU, Triton INTERPRETER (fp32): these times measure the interpreter, NOT kernel speed"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device; use --cpu with TRITON_INTERPRET=1 for a functional run")
        rows = run(args.lengths or [2048, 8192, 16384], args.fractions, window=args.window)
        label = f"{torch.cuda.get_device_name()} bf16, B=1 H=14 H_kv=2 D=64 (Qwen2.5-0.5B shapes), window {args.window}"
    print(table(rows, label))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"label": label, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
