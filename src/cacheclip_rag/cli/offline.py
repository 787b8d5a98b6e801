"""`cacheclip models`, `calibrate` and `train`: what is done once per model or model pair."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from ..config import EngineConfig, ModelConfig
from ..corpus import packets as packet_lib
from ..engine import CacheClipEngine
from ..offline.qa_data import FORMATS as QA_FORMATS
from ..hardware import describe as describe_cpu
from ..models.loading import DEFAULT_AUX, DEFAULT_PRIMARY
from .common import add_common, add_dtype, engine_from_args, progress_bar


def cmd_models(args) -> int:
    from ..models.loading import EMBEDDED, installed, resolve, verify_embedded

    dtype = ModelConfig(dtype=args.dtype).torch_dtype()
    for name, spec in EMBEDDED.items():
        if spec.extra is not None and not installed(spec):
            print(f"{name}: not installed (optional: {spec.install_hint})")
            continue
        start = time.perf_counter()
        verify_embedded(spec)
        folder = resolve(name, dtype)
        print(f"{name}: verified and ready in {folder} ({time.perf_counter() - start:.1f}s)")
    return 0


def cmd_calibrate(args) -> int:
    from ..offline.auto_share import calibrate_share
    from ..offline.calibrate import calibrate, table

    if args.data is None:
        engine, extra = engine_from_args(args), {}
    else:
        engine, extra = _qa_calibration(args)
    if args.auto_share:
        profiles = calibrate_share(engine, tuple(args.lengths), args.samples, ratio=args.ratio)
        for profile in profiles:
            print(f"auto share {profile.auto_share:.4f} at {list(profile.lengths)} tokens ({profile.describe()}): "
                  f"recompute_ratio='auto' spends {args.ratio} on average; saved with the store {engine.store.location}")
        if args.json:
            Path(args.json).write_text(json.dumps({"profiles": [p.to_dict() for p in profiles]}, indent=2))
        return 0
    profile, scores = calibrate(engine, tuple(args.lengths), args.samples, ratio=args.ratio, max_run=args.max_run,
                                criterion=args.criterion, **extra)
    print(table(scores, engine.aux.lm.num_layers))
    measured = profile.measured
    base = measured["baseline_kl"]
    print(f"\nfor scale: KL of reuse (nothing recomputed) {base['reuse']:.4f}; random rows at the ratio: KL "
          f"{base['random']:.4f}, hard {base['random_left_at_hard']:.3f}")
    last, align = measured["last_layer"], measured["best_by_alignment"]
    print(f"\nprofile for {profile.primary_name} + {profile.aux_name}: {profile.describe()}, "
          f"by {measured['criterion']}: KL {measured['kl']:.4f}, hard {measured['left_at_hard']:.3f} "
          f"(Jaccard {measured['jaccard']:.3f}, recall {measured['recall']:.3f}).\n"
          f"The last layer ranks {last['rank']} (KL {last['kl']:.4f}); the best by Jaccard alone would be "
          f"{align['aux_layers']} (KL {align['kl']:.4f}). Saved with the store {engine.store.location}")
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": profile.to_dict(), "scores": [s.__dict__ for s in scores]}, indent=2))
    return 0


def _qa_calibration(args) -> tuple[CacheClipEngine, dict]:
    """`calibrate --data FILE`: the engine under the dataset's prompt, and the questions to
    calibrate on (by default the file's last --samples, away from where `bench qa` starts)."""
    from ..offline import qa_data
    from ..offline.calibrate import qa_inputs

    if args.auto_share:
        raise ValueError("--auto-share calibrates on generated inputs; it does not take --data")
    data = qa_data.load(args.data, args.format)
    n = len(data.examples)
    offset = n - args.samples if args.offset is None else args.offset
    if not 0 <= offset < n or args.samples < 1:
        raise ValueError(f"--offset {args.offset} / --samples {args.samples}: {args.data} holds questions 0-{n - 1}")
    chosen = data.examples[offset : offset + args.samples]
    source = f"{Path(args.data).name} questions {offset}-{offset + len(chosen) - 1} ({data.format})"
    print(f"calibrating on {source}: keep them out of what you evaluate")
    prompt = data.prompt if args.prompt == "dataset" else None
    return engine_from_args(args, prompt=prompt), {"inputs": qa_inputs(chosen), "source": source}


def cmd_train(args) -> int:
    """Train the primary's KV Packet adapters (`packet`: a .safetensors file) or its
    concatenation-aware LoRA (`lora`: a folder) by self-distillation; write them to --out."""
    from dataclasses import fields as dc_fields

    from ..models.loading import load
    from ..offline.train_lora import LoraTrainConfig
    from ..offline.training import TrainConfig

    if args.what == "lora" and args.init:
        raise ValueError("--init starts KV Packet training from adapters; the LoRA starts from zero")
    kind = LoraTrainConfig if args.what == "lora" else TrainConfig
    given = {f.name: getattr(args, f.name) for f in dc_fields(kind) if getattr(args, f.name, None) is not None}
    cfg = kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})
    lm = load(args.primary, ModelConfig(dtype=args.dtype))
    print(describe_cpu() + f"; training in {str(lm.dtype).removeprefix('torch.')}")
    start = time.perf_counter()
    teacher = progress_bar(cfg.samples + cfg.held_out, "teacher", "request")
    bar = progress_bar(cfg.samples * cfg.epochs, "train", "step")
    if args.what == "lora":
        from dataclasses import asdict

        from ..models import lora
        from ..offline.train_lora import train_lora

        peft_model, curve = train_lora(lm, cfg, progress=bar, teacher_progress=teacher)
        sha = lora.save(peft_model, args.out, lm, {"train_config": asdict(cfg), "curve": curve})
    else:
        from ..offline.train_packets import save_adapters, train

        init = packet_lib.resolve_adapters(args.init, lm) if args.init else None
        if args.init == "auto" and init is None:
            raise ValueError(f"--init auto: no KV Packet adapters ship for {lm.name!r}; give a file")
        with tempfile.TemporaryDirectory(prefix="cacheclip-train-") as scratch:
            # Recompute in the loop: the requests are made and selected as an engine serves them.
            engine = CacheClipEngine(lm, load(args.aux, ModelConfig(dtype=args.dtype), "aux"), scratch,
                                     EngineConfig(model=ModelConfig(dtype=args.dtype), packets=None)) \
                if cfg.recompute else None
            try:
                adapters, curve = train(lm, cfg, progress=bar, teacher_progress=teacher, engine=engine, init=init)
            finally:
                if engine is not None:
                    engine.close()
        sha = save_adapters(args.out, adapters, lm, cfg, curve)
    measures = [k for k in curve[0] if k.startswith("held_out")]
    print(f"{'epoch':>5} {'train loss':>10} " + " ".join(f"{m.replace('_', '-').replace('-kl', ' KL'):>17}" for m in measures))
    for row in curve:
        print(f"{row['epoch']:>5} {row['train_loss']:>10.4f} " + " ".join(f"{row[m]:>17.4f}" for m in measures)
              + ("   (kept)" if row.get("kept") else ""))
    if curve[0].get("kept"):
        print(f"WARNING: no epoch lowered the held-out {'loss' if args.what == 'lora' else 'KL'} below the untrained "
              "state's, so the files hold the untrained state (a LoRA that changes nothing); train longer, with "
              "more requests or another learning rate")
    print(f"{args.what} adapters for {lm.name} -> {args.out} (sha256 {sha}); {time.perf_counter() - start:.0f} s")
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("calibrate", help="choose how the aux model scores tokens for a model pair; saves a profile in the store")
    add_common(p)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048],
                   help="context lengths of the calibration inputs: those your requests have (a profile calibrated "
                        "at 1K scored twice the KL of one calibrated at 2K on 2K requests)")
    p.add_argument("--samples", type=int, default=6,
                   help="calibration inputs per length (seeds disjoint from evaluation), or questions of --data")
    p.add_argument("--ratio", type=float, default=0.2, help="recompute fraction the candidates are compared at")
    p.add_argument("--max-run", type=int, default=3, help="longest run of adjacent aux layers tried")
    p.add_argument("--criterion", choices=["kl", "hard"], default="kl",
                   help="kl: mean KL over the answer; hard: divergence left where reuse diverges most")
    p.add_argument("--data", default=None,
                   help="calibrate on questions of a QA file (as `bench qa --data` reads) instead of generated "
                        "needles: their passages as chunks, under the dataset's prompt; the profile's length is "
                        "their median prompt length (--lengths is unused)")
    p.add_argument("--format", choices=list(QA_FORMATS), default="auto",
                   help="--data's format")
    p.add_argument("--offset", type=int, default=None,
                   help="--data's first question (0-based; default: the file's last --samples questions)")
    p.add_argument("--prompt", choices=["dataset", "engine"], default="dataset",
                   help="with --data: the instruction of the dataset's own harness, or the engine's default prompt")
    p.add_argument("--auto-share", action="store_true",
                   help="only calibrate recompute_ratio='auto' for the profile in use at each length: the aux "
                        "attention share whose mean recomputed fraction is --ratio")
    p.add_argument("--json", default=None)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("train", help="train the primary's KV Packet adapters or concatenation-aware LoRA (self-distillation)")
    p.add_argument("what", choices=["packet", "lora"], help="packet: header/trailer vectors (a .safetensors file); "
                   "lora: LoRA on attention and MLP projections (a folder)")
    p.add_argument("--primary", default=DEFAULT_PRIMARY, help="the model the adapters are for")
    add_dtype(p)
    p.add_argument("--out", required=True, help="packet: .safetensors file to write; lora: folder to write")
    p.add_argument("--aux", default=DEFAULT_AUX, help="packet with --recompute: the aux model that selects the rows")
    p.add_argument("--init", default=None, metavar="FILE",
                   help="packet: start from these adapters (auto: the shipped ones for the primary) instead of "
                        "random vectors")
    from dataclasses import fields as dc_fields

    from ..offline.train_lora import LoraTrainConfig
    from ..offline.training import TrainConfig

    packet, lora_defaults = TrainConfig(), LoraTrainConfig()
    for f in dc_fields(LoraTrainConfig):  # unset: the config's own default (packet and lora differ)
        value = getattr(lora_defaults, f.name)
        shown = (f"default: {getattr(packet, f.name)} (packet), {value} (lora)" if hasattr(packet, f.name)
                 else f"lora only; default {value}")
        if isinstance(value, tuple):
            p.add_argument("--" + f.name.replace("_", "-"), nargs="+", default=None, help=shown)
        else:
            p.add_argument("--" + f.name.replace("_", "-"), type=type(value), default=None, help=shown)
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("models", help="verify and convert the embedded default models (once)")
    add_dtype(p)
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_models)
