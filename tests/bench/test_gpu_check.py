"""The GPU check cannot rot between the times a GPU is lent: its dry run takes the same path on
the CPU (tiny shapes, Triton's interpreter) and writes the same files; without a GPU the real run
stops with a sentence, not a traceback; the wheels it carries stay under their limit."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("env", "kernel", "oracles", "ttft-memory", "ttft-files")


def _bundle_module():
    spec = importlib.util.spec_from_file_location("gpu_bundle", ROOT / "scripts" / "gpu_bundle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_writes_every_table_and_its_json(tmp_path):
    out = tmp_path / "gpu"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), "--dry-run"], cwd=ROOT,
                          env={**os.environ, "PY": sys.executable, "GPU_BUNDLE": str(tmp_path / "none")},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for part in PARTS:
        assert (out / f"{part}.json").is_file() and (out / f"{part}.txt").is_file(), part
    summary = json.loads((out / "summary.json").read_text())
    assert summary["environment"]["dry_run"] and all(summary["parts"][p].startswith("done") for p in PARTS[1:])
    kernel = json.loads((out / "kernel.json").read_text())
    assert {r["window"] for r in kernel} == {None, 32} and all(r["max_err"] < 1e-4 for r in kernel)
    assert json.loads((out / "oracles.json").read_text())["returncode"] == 0
    for part in ("ttft-memory", "ttft-files"):
        rows = json.loads((out / f"{part}.json").read_text())
        assert [r["mode"] for r in rows] == ["full", "reuse", "cacheblend", "cacheclip", "prophetkv"]
        assert rows[0]["vs_full"] == 1.0 and all(r["ttft"] > 0 for r in rows)


def test_without_a_gpu_the_real_run_stops_with_a_sentence(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run([sys.executable, "-m", "cacheclip_bench.gpu", "--out", str(tmp_path)], cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "gpu check: no CUDA device" in done.stderr


def test_the_bundle_stays_under_its_limit_and_is_used_only_where_needed(tmp_path):
    bundle = _bundle_module()
    folder = tmp_path / "bundle"
    wheels = bundle.build(folder)
    assert sum(w.stat().st_size for w in wheels) < bundle.LIMIT_MIB * 2**20
    names = {w.name.split("-")[0] for w in wheels}
    assert {"transformers", "tokenizers", "huggingface_hub"} <= names and "torch" not in names
    assert bundle.choose(folder) == []  # this environment already has the pinned transformers
    info = json.loads((folder / "bundle.json").read_text())
    info["pins"]["transformers"] = "0.0.1"  # a machine whose transformers is another version
    (folder / "bundle.json").write_text(json.dumps(info))
    taken = bundle.choose(folder)
    assert [w.name.split("-")[0] for w in taken] == ["transformers"]  # its dependencies are satisfied here
    bundle.unpack(taken, tmp_path / "site")
    assert (tmp_path / "site" / "transformers" / "__init__.py").is_file()


def test_a_failing_part_is_recorded_and_the_next_parts_still_run(tmp_path, monkeypatch):
    from cacheclip_bench import gpu

    def broken(plan):
        raise RuntimeError("kernel launch failed")

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(gpu, "kernel_part", broken)
    monkeypatch.setattr(gpu, "oracle_part", lambda plan, out: ({"returncode": 0}, "oracles ok"))
    monkeypatch.setattr(gpu, "ttft_part", lambda plan, store, deadline: ([], f"ttft {store}"))
    summary = gpu.check(tmp_path, dry_run=True)
    assert summary["parts"]["kernel"].startswith("failed") and "kernel launch failed" in summary["parts"]["kernel"]
    assert "RuntimeError: kernel launch failed" in (tmp_path / "kernel.txt").read_text()
    assert [summary["parts"][p][:4] for p in PARTS[2:]] == ["done"] * 3
    assert json.loads((tmp_path / "summary.json").read_text())["parts"] == summary["parts"]
