"""`cacheclip bench gpu`: the GPU check, one command for a bare CUDA machine, or --dry-run on a CPU.

It needs the repository, torch, triton, transformers, tokenizers, safetensors, xxhash, numpy and
tqdm; nothing else (no faiss, no embedder, no model weights: the models are built from the real
models' configurations with random weights, since time does not depend on the weights' values,
and a byte-level tokenizer is trained on the haystack text at start). `scripts/gpu_check.sh`
runs it with the wheels `make gpu-bundle` prepared where the machine's versions do not fit.

The parts run in order of importance, so that a run cut off by its time limit still returns the
first ones, each written as a table (.txt) and JSON under one folder as soon as it is done:

1. kernel: the Triton sparse-query kernel against dense causal SDPA (and FlashAttention's kernel
   where torch exposes it) and against its torch reference (max error), bf16, N = 4K..32K,
   M/N = 0.1 / 0.2 / 0.5, the default primary's head shapes and a 7B model's, with and without a
   sliding window;
2. oracles: the recompute oracles (ratio 1 == full prefill, 0 == direct reuse, re-rotated keys ==
   keys at the shifted position) on tiny random models of every family, on the device;
3. ttft-memory: end-to-end TTFT of full / reuse / cacheblend / cacheclip@0.2 / prophetkv@0.2 at
   4K, 8K, 16K, the primary on the GPU and the aux on the CPU (the paper's placement), caches
   loaded from host memory layer by layer; the default pair's configurations, then a 7B
   primary's;
4. ttft-files: the same from a local file store, if time is left.

A part that raises is recorded as failed (its traceback in its .txt) and the next part runs: on a
machine lent for minutes, one broken part must not cost the others. The exit status is then 1.

--dry-run runs the same code path on the CPU with tiny shapes and Triton's interpreter (what CI
runs, so the check cannot rot between the times a GPU is available); its times are no speed
figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
"""The repository (the check runs from a working tree: the oracle tests live in tests/)."""

PRIMARY_CONFIGS = {
    # The published config.json fields that set the compute (Qwen2.5-Coder-0.5B-Instruct,
    # SmolLM2-135M-Instruct, Qwen2.5-7B-Instruct); the rest are transformers' defaults.
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False),
}
AUX_CONFIG = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                  rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
"""--dry-run: the same model types, this small."""

MODES = (("full", 1.0), ("reuse", 0.0), ("cacheblend", 0.2), ("cacheclip", 0.2), ("prophetkv", 0.2))
KERNEL_SHAPES = (("qwen2.5-0.5b", 14, 2, 64), ("qwen2.5-7b", 28, 4, 128))


class GpuUnavailable(RuntimeError):
    """What this machine lacks for the check (raised before anything is timed)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sizes one run uses: the GPU's, or the dry run's."""

    device: str
    kernel_lengths: tuple[int, ...]
    fractions: tuple[float, ...]
    window: int
    ttft_lengths: tuple[int, ...]
    primaries: tuple[str, ...]
    runs: int
    chunk_tokens: int
    tiny: bool

    @classmethod
    def of(cls, dry_run: bool) -> Plan:
        if dry_run:
            return cls("cpu", (64, 128), (0.2,), 32, (160,), ("qwen2.5-0.5b",), 1, 32, True)
        return cls("cuda", (4096, 8192, 16384, 32768), (0.1, 0.2, 0.5), 4096, (4096, 8192, 16384),
                   ("qwen2.5-0.5b", "qwen2.5-7b"), 3, 256, False)


def environment(dry_run: bool) -> dict:
    """Versions and the device; a GpuUnavailable naming what is missing (no traceback)."""
    import torch

    if dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        raise GpuUnavailable("--dry-run runs the kernel under Triton's interpreter: set TRITON_INTERPRET=1 in the "
                             "environment before Python starts")
    if not dry_run and not torch.cuda.is_available():
        raise GpuUnavailable(f"no CUDA device: torch {torch.__version__} (CUDA build {torch.version.cuda}) sees none; "
                             "this check needs an NVIDIA GPU (or --dry-run for the CPU path)")
    try:
        import transformers
        import triton
    except ImportError as err:
        raise GpuUnavailable(f"{err.name} is not importable: run through scripts/gpu_check.sh, which puts the "
                             "bundle from `make gpu-bundle` on the path") from None
    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "transformers": transformers.__version__, "dry_run": dry_run,
           "device": "cpu (dry run)" if dry_run else torch.cuda.get_device_name(),
           "cpu_threads": torch.get_num_threads()}
    if not dry_run:
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return env


def kernel_part(plan: Plan) -> tuple[list[dict], str]:
    import torch

    from . import kernel as bench

    rows, text = [], []
    for name, heads, kv_heads, head_dim in KERNEL_SHAPES[: 1 if plan.tiny else None]:
        dtype = torch.float32 if plan.tiny else torch.bfloat16
        h, kv = (4, 2) if plan.tiny else (heads, kv_heads)
        for window in (None, plan.window):
            got = bench.run(list(plan.kernel_lengths), list(plan.fractions), heads=h, kv_heads=kv,
                            head_dim=16 if plan.tiny else head_dim, dtype=dtype, device=plan.device,
                            reps=2 if plan.tiny else 20, window=window)
            for r in got:
                r["shape"] = name
            rows += got
            label = (f"{name} heads ({h}/{kv}), window {window}, "
                     + ("Triton INTERPRETER on the CPU: no speed figures" if plan.tiny else str(dtype)))
            text.append(bench.table(got, label))
    return rows, "\n\n".join(text)


def oracle_part(plan: Plan, out: Path) -> tuple[dict, str]:
    """The recompute oracle tests on the device, every family (a pytest run in a subprocess)."""
    if not (ROOT / "tests" / "conftest.py").is_file():
        return {"returncode": None, "summary": "skipped: the oracle tests need the repository's tests/"}, \
            "skipped: the oracle tests need the repository's tests/ (run from a working tree)"
    env = {**os.environ, "CACHECLIP_TEST_DEVICE": plan.device, "TRITON_INTERPRET": "1" if plan.tiny else "0"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests/request/test_recompute.py"),
           "-k", "full_recompute or zero_recompute or rerotated or oracles_hold or windows_matter",
           f"--junitxml={out / 'oracles.xml'}"]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
    return {"returncode": done.returncode, "summary": tail.splitlines()[-1] if tail else ""}, tail


def _tokenizer(text: str):
    """A byte-level BPE trained on the haystack text: token counts like a real model's, no files."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(vocab_size=4000, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _model(fields: dict, tokenizer, device: str, dtype, tiny: bool, name: str):
    """A model of the configuration, random weights, on `device` (weights made there)."""
    import torch
    import transformers

    from cacheclip_rag.analysis import wrap

    fields = {**fields, **(TINY if tiny else {}), "eos_token_id": tokenizer.eos_token_id,
              "bos_token_id": tokenizer.eos_token_id}
    config = transformers.AutoConfig.for_model(**fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return wrap(model.to(device), tokenizer, name=f"random-{name}")


def _corpus(n_tokens: int, seed: int) -> str:
    from cacheclip_rag.analysis import prose

    return prose(random.Random(seed), max(8, n_tokens // 12))


def ttft_part(plan: Plan, store: str, deadline: float) -> tuple[list[dict], str]:
    """TTFT of every mode over the same requests, alternated run by run, per primary and length."""
    import torch

    from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig, ModelConfig
    from cacheclip_rag.analysis import split_document

    text = _corpus(max(plan.ttft_lengths) + 512, 7)
    tokenizer = _tokenizer(text)
    dtype = torch.float32 if plan.tiny else torch.bfloat16
    aux = _model(AUX_CONFIG, tokenizer, "cpu", torch.float32 if plan.tiny else torch.bfloat16, plan.tiny, "smollm2-135m")
    rows, lines = [], []
    for primary_name in plan.primaries:
        if time.monotonic() > deadline:
            lines.append(f"{primary_name}: skipped, out of time")
            break
        primary = _model(PRIMARY_CONFIGS[primary_name], tokenizer, plan.device, dtype, plan.tiny, primary_name)
        cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=plan.chunk_tokens, overlap_tokens=0),
                           model=ModelConfig(primary_device=plan.device))
        with tempfile.TemporaryDirectory(prefix="cacheclip-gpu-") as scratch:
            # one store per primary (a store is bound to its models): host memory, or a folder
            location = f"{store}-{primary_name}" if store.startswith("memory://") else str(Path(scratch) / "store")
            with CacheClipEngine(primary, aux, location, cfg) as engine:
                for length in plan.ttft_lengths:
                    rows += _time_length(engine, tokenizer, text, length, plan, primary_name, split_document)
                    if time.monotonic() > deadline:
                        break
        del primary
        if plan.device == "cuda":
            torch.cuda.empty_cache()
    lines.append(ttft_table(rows))
    return rows, "\n".join(lines)


def _time_length(engine, tokenizer, text: str, length: int, plan: Plan, primary_name: str, split) -> list[dict]:
    from cacheclip_rag import ChunkConfig

    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:length]
    context = tokenizer.decode(ids)
    chunks = split(context, tokenizer, ChunkConfig(chunk_tokens=plan.chunk_tokens, overlap_tokens=0), "gpu-check")
    for chunk in chunks:  # stored without the index (no embedder here), caches encoded before timing
        engine.store.put_chunk(chunk)
        engine.primary.get(chunk.id, chunk.text)
        engine.aux.get(chunk.id, chunk.text)
    chunk_ids = [c.id for c in chunks]
    question = "What does the record say about the archive?"
    got: dict[tuple[str, float], list[dict]] = {m: [] for m in MODES}
    for _ in range(1 + plan.runs):  # the first round warms up (kernels compiled, caches touched)
        for mode, ratio in MODES:
            answer = engine.answer(question, chunk_ids=chunk_ids, mode=mode, recompute_ratio=ratio, max_new_tokens=1)
            got[(mode, ratio)].append({**answer.timings, "tokens": answer.prompt_tokens})
    out = []
    full = statistics.median(t["ttft"] for t in got[("full", 1.0)][1:])
    for (mode, ratio), runs in got.items():
        timed = runs[1:]
        med = {k: statistics.median(t.get(k, 0.0) for t in timed)
               for k in ("ttft", "selection", "selection_hidden", "load", "assemble", "load_wait", "recompute")}
        out.append({"primary": primary_name, "length": length, "tokens": timed[0]["tokens"], "mode": mode,
                    "ratio": ratio, "runs": len(timed), **med, "vs_full": med["ttft"] / full})
    return out


def ttft_table(rows: list[dict]) -> str:
    head = (f"{'primary':<13} {'len':>6} {'mode':<11} {'ratio':>5} {'TTFT s':>8} {'/full':>6} {'select':>7} "
            f"{'hidden':>7} {'asm':>7} {'wait':>7} {'recomp':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['primary']:<13} {r['length']:>6} {r['mode']:<11} {r['ratio']:>5.2f} {r['ttft']:>8.3f} "
                     f"{r['vs_full']:>6.3f} {r['selection']:>7.3f} {r['selection_hidden']:>7.3f} {r['assemble']:>7.3f} "
                     f"{r['load_wait']:>7.3f} {r['recompute']:>7.3f}")
    lines.append("timeline per request: select = the aux selection on the CPU (hidden: the part overlapped with "
                 "loading), asm = loading + re-rotation of the chunk layers on their thread, wait = recompute "
                 "waiting for a layer, recomp = recompute on the primary's device")
    return "\n".join(lines)


def check(out: str | Path, dry_run: bool = False, budget_s: float = 450.0) -> dict:
    """Run the parts in order under `out`; returns the summary (also out/summary.json)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    deadline = start + budget_s
    plan = Plan.of(dry_run)
    summary: dict = {"environment": environment(dry_run), "plan": dataclasses.asdict(plan), "parts": {}}
    _write(out, "env", summary["environment"], json.dumps(summary["environment"], indent=1))

    def part(name: str, fn) -> None:
        if time.monotonic() > deadline:
            summary["parts"][name] = "skipped: out of time"
            return
        t = time.monotonic()
        try:
            data, text = fn()
        except Exception as err:  # noqa: BLE001 - one part's failure must not cost the parts after it
            log.exception("gpu check: part %s failed", name)
            data, text = {"error": repr(err)}, traceback.format_exc()
            summary["parts"][name] = f"failed after {time.monotonic() - t:.1f} s: {err!r}"
        else:
            summary["parts"][name] = f"done in {time.monotonic() - t:.1f} s"
        _write(out, name, data, text)
        print(f"\n== {name}\n{text}", flush=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))

    part("kernel", lambda: kernel_part(plan))
    part("oracles", lambda: oracle_part(plan, out))
    part("ttft-memory", lambda: ttft_part(plan, "memory://gpu-check", deadline))
    part("ttft-files", lambda: ttft_part(dataclasses.replace(plan, primaries=plan.primaries[:1]), "files", deadline))
    summary["seconds"] = round(time.monotonic() - start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _write(out: Path, name: str, data, text: str) -> None:
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
    (out / f"{name}.txt").write_text(text + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cacheclip bench gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/gpu", help="folder for every table and its JSON")
    ap.add_argument("--dry-run", action="store_true", help="the same path on the CPU: tiny shapes, Triton's interpreter")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds after which the remaining parts are skipped")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        summary = check(args.out, dry_run=args.dry_run, budget_s=args.budget)
    except GpuUnavailable as why:
        print(f"gpu check: {why}", file=sys.stderr)
        return 2
    print(f"\nwritten under {args.out}: {', '.join(sorted(p.name for p in Path(args.out).iterdir()))} "
          f"({summary['seconds']} s)")
    failed = [name for name, state in summary["parts"].items() if state.startswith("failed")]
    if failed:
        print(f"gpu check: these parts failed (traceback in their .txt): {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
