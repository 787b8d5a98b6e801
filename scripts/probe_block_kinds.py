"""Per-layer attention of recompute rows by CPU block kind (split vs matmul), float32 and bf16.

Usage: python scripts/probe_block_kinds.py [--counts]
The default primary's attention shapes (14 query heads over 2 key heads, head size 64), 20% of the
rows of a 4K and an 8K request, spread evenly or weighted late (as calibrated profiles pick them),
7 alternated runs per kind, medians; and each kind's mean distance to the split blocks' output.
Run it under `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2` to
hold torch, oneDNN and MKL to AVX2 on a CPU that has more (what an AVX2-only CPU runs).
--counts: instead, float32 split (and plain) blocks by how many blocks the rows are cut into,
beside a full causal prefill's attention of the same layer and the ideal (its time x the share of
its query-key pairs the rows hold), 5 alternated runs, medians.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from cacheclip_kernels.blocked import BlockPlan, blocked_attention  # noqa: E402

from cacheclip_rag.hardware import describe  # noqa: E402


def rows(n: int, m: int, spread: str) -> torch.Tensor:
    """m sorted row positions of n: evenly spread, or weighted toward the end of the request."""
    if spread == "even":
        return torch.randperm(n)[:m].sort().values
    return torch.sort(n - 1 - (torch.rand(m) ** 2 * n).long().clamp(max=n - 1)).values.unique()


def elapsed_ms(fn) -> float:
    """Milliseconds one call of fn takes."""
    start = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - start)


def counts() -> None:
    """Split blocks by block count, float32, against the full causal attention of the layer."""
    for n in (4096, 8192):
        q, k, v = torch.randn(1, 14, n, 64), torch.randn(1, 2, n, 64), torch.randn(1, 2, n, 64)
        full = statistics.median(
            elapsed_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)) for _ in range(3))
        print(f"N={n} full causal attention: {full:.1f} ms", flush=True)
        for spread in ("even", "late"):
            pos = rows(n, n // 5, spread)
            share = float((pos + 1).sum()) / (n * (n + 1) / 2)  # of the causal query-key pairs
            qq = q[:, :, : pos.numel()]
            plans = {f"split {c}": BlockPlan.build(pos, n, None, kind="split", blocks=c) for c in (1, 2, 4, 8, 16, 32)}
            plans |= {f"plain {c}": BlockPlan.build(pos, n, None, kind="plain", blocks=c) for c in (8, 32)}
            times: dict[str, list[float]] = {name: [] for name in plans}
            for _ in range(5):
                for name, plan in plans.items():
                    times[name].append(elapsed_ms(lambda: blocked_attention(qq, k, v, plan)))
            cells = ", ".join(f"{name}: {statistics.median(t):.1f}" for name, t in times.items())
            print(f"  {spread} rows={pos.numel()} pairs {share:.3f} of full, ideal {share * full:.1f} ms | {cells}", flush=True)


def main() -> None:
    torch.manual_seed(0)
    print(describe(), f"; torch {torch.__version__}, {torch.get_num_threads()} threads")
    if "--counts" in sys.argv[1:]:
        return counts()
    for n in (4096, 8192):
        m = n // 5
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(1, 14, m, 64, dtype=dtype)
            k, v = torch.randn(1, 2, n, 64, dtype=dtype), torch.randn(1, 2, n, 64, dtype=dtype)
            for spread in ("even", "late"):
                pos = rows(n, m, spread)
                qq = q[:, :, : pos.numel()]
                plans = {kind: BlockPlan.build(pos, n, None, kind=kind) for kind in ("split", "matmul")}
                times: dict[str, list[float]] = {kind: [] for kind in plans}
                for _ in range(7):
                    for kind, plan in plans.items():
                        times[kind].append(elapsed_ms(lambda: blocked_attention(qq, k, v, plan)))
                ref = blocked_attention(qq, k, v, plans["split"]).float()
                err = (blocked_attention(qq, k, v, plans["matmul"]).float() - ref).abs().mean().item()
                med = {kind: statistics.median(t) for kind, t in times.items()}
                print(f"N={n} rows={pos.numel()} {str(dtype)[6:]:>8} {spread:>4}: split {med['split']:.1f} ms, "
                      f"matmul {med['matmul']:.1f} ms, matmul/split {med['matmul'] / med['split']:.2f}, "
                      f"mean |matmul - split| {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
