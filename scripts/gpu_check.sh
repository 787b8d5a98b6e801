#!/usr/bin/env bash
# The GPU check, one command on any machine with an NVIDIA GPU, bare or not (docs/gpu.md):
#
#   bash scripts/gpu_check.sh [OUT_DIR] [--dry-run] [--budget SECONDS]
#
# It needs the repository, a Python with torch and triton, and, where that Python's transformers
# is not the version this project pins, the wheels `make gpu-bundle` put in gpu-bundle/ (carried
# beside the tree; the ones the machine lacks are unpacked under OUT_DIR/site). No network, no
# model weights. Every table and its JSON goes under OUT_DIR (default out/gpu), in the order of
# importance: kernel, oracles, TTFT from host memory, TTFT from a file store.
# --dry-run: the same path on the CPU (tiny shapes, Triton's interpreter); CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="out/gpu"
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then OUT="$1"; shift; fi
PY="${PY:-python3}"
if ! "$PY" -c "import torch, triton" 2>/dev/null; then
    echo "gpu check: $PY cannot import torch and triton; run it with a Python that has both (PY=/path/to/python)" >&2
    exit 2
fi
mkdir -p "$OUT"
SITE="$("$PY" scripts/gpu_bundle.py path "${GPU_BUNDLE:-gpu-bundle}" "$OUT/site")"
export PYTHONPATH="${SITE:+$SITE:}$PWD/src:$PWD/kernels:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
case " $* " in
    *" --dry-run "*) export TRITON_INTERPRET=1 ;;
    *) export TRITON_INTERPRET=0
       command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
           > "$OUT/gpu.txt" || true ;;
esac
exec "$PY" -m cacheclip_bench.gpu --out "$OUT" "$@"
