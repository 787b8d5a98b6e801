"""`cacheclip bench gpu`: the GPU check (on a bare machine run `scripts/gpu_check.sh` instead)."""

from __future__ import annotations

from .. import gpu
from .. import harness as h

NAME = "gpu"
HELP = ("the GPU check: kernel, oracles on the device, TTFT with the primary on the GPU (docs/gpu.md); "
        "--dry-run: the same on the CPU")
HEADER = False  # the check writes its own tables under --out


def arguments(p) -> None:
    p.add_argument("--out", default="out/gpu", help="folder for every table and its JSON")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, Triton's interpreter")
    p.add_argument("--budget", type=float, default=450.0, help="seconds after which the remaining parts are skipped")


def measure(args) -> h.Report:
    code = gpu.main(["--out", args.out, "--budget", str(args.budget), *(["--dry-run"] if args.dry_run else [])])
    return h.Report(code=code)
