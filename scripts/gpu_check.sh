#!/usr/bin/env bash
# The GPU checks of the TTFT issue, as one script for a machine with an NVIDIA GPU.
#
#   bash scripts/gpu_check.sh [OUT_DIR]        (about 6-8 minutes on an H200, models converted)
#
# 1. The Triton sparse-query kernel against dense causal SDPA and its torch reference, bf16,
#    N = 4K..32K, M/N = 0.1, 0.2, 0.5, Qwen2.5-0.5B head shapes, with and without a sliding window.
# 2. End-to-end TTFT on CUDA (primary on cuda:0, aux on the CPU: the paper's placement) for full,
#    reuse, cacheblend and cacheclip (per-chunk and joint aux scoring) at 20%, 4K and 8K, caches
#    read from disk.
# 3. The recompute oracles on CUDA in bf16 (the kernel path), as a test run.
# Everything it prints is also written under OUT_DIR (default: out/gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/gpu}"
mkdir -p "$OUT"
PY="${PY:-.venv/bin/python}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
unset TRITON_INTERPRET
export HF_HUB_OFFLINE=1

"$PY" -m cacheclip_kernels.bench --lengths 4096 8192 16384 32768 --fractions 0.1 0.2 0.5 \
    --json "$OUT/kernel.json" | tee "$OUT/kernel.txt"
"$PY" -m cacheclip_kernels.bench --lengths 16384 --fractions 0.2 --window 512 \
    --json "$OUT/kernel-window.json" | tee "$OUT/kernel-window.txt"

"$PY" -m pytest -q -p no:cacheprovider tests/test_kernel.py tests/test_recompute.py 2>&1 | tail -3 | tee "$OUT/tests.txt"

.venv/bin/cacheclip bench ttft --store "$OUT/store" --lengths 4096 8192 --modes reuse cacheblend cacheclip cacheclip-joint \
    --ratios 0.2 --runs 3 --budget keep --json "$OUT/ttft.json" 2>&1 | tee "$OUT/ttft.txt"
