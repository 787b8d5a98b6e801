"""The `cacheclip` command: ingest, ask, demo, bench, eval, models."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from importlib import resources
from pathlib import Path

from . import plan
from .config import ChunkConfig, EngineConfig, ModelConfig, StoreConfig
from .hardware import describe as describe_cpu
from .models import DEFAULT_AUX, DEFAULT_PRIMARY, cache_dir

log = logging.getLogger("cacheclip_rag")


def _engine(args, chunk: ChunkConfig | None = None):
    from .config import SelectConfig
    from .engine import CacheClipEngine

    layers = getattr(args, "score_layers", None)
    cfg = EngineConfig(
        model=ModelConfig(dtype=getattr(args, "dtype", "auto"), primary_adapter=getattr(args, "primary_adapter", None)),
        store=StoreConfig(kv_dtype=getattr(args, "kv_dtype", "auto")),
        chunk=chunk or ChunkConfig(),
        top_k=getattr(args, "k", None) or EngineConfig().top_k,
        select=SelectConfig(score_layers=tuple(layers) if layers else None),
        packets=_packets_arg(getattr(args, "adapters", "auto")),
    )
    log.info("loading %s (primary) and %s (aux)", args.primary, args.aux)
    return CacheClipEngine.from_pretrained(primary=args.primary, aux=args.aux, store_dir=args.store, config=cfg)


def _packets_arg(value: str) -> str | None:
    return None if value == "none" else value


def _read_documents(paths: list[str]) -> list:
    docs: list = []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"document file {name!r} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{name} is not valid UTF-8 text ({err.reason} at byte {err.start})") from None
        if path.suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        docs.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{name}:{n} is not a JSON object ({err.msg})") from None
        else:
            docs.append({"text": text, "source": path.name})
    return docs


def _demo_documents() -> tuple[list[dict], list[dict]]:
    data = resources.files("cacheclip_rag") / "data"
    docs = [json.loads(line) for line in (data / "demo_corpus.jsonl").read_text().splitlines() if line.strip()]
    questions = [json.loads(line) for line in (data / "demo_questions.jsonl").read_text().splitlines() if line.strip()]
    return docs, questions


def _fmt_timings(t: dict[str, float]) -> str:
    keys = ("selection", "load", "assemble", "recompute", "ttft", "total")
    return "  ".join(f"{k} {t.get(k, 0.0):.3f}s" for k in keys)


def cmd_ingest(args) -> int:
    engine = _engine(args, ChunkConfig(chunk_tokens=args.chunk_tokens, overlap_tokens=args.overlap_tokens))
    ids = engine.ingest(_read_documents(args.files), progress=not args.quiet, packets=args.packets)
    print(f"ingested {len(ids)} chunks ({len(set(ids))} distinct) into {args.store}")
    return 0


def cmd_ask(args) -> int:
    engine = _engine(args)
    kwargs = dict(k=args.k, mode=args.mode, recompute_ratio=args.ratio, max_new_tokens=args.max_new_tokens)
    ids = args.chunk_ids.split(",") if args.chunk_ids else None
    stream = engine.stream(args.question, chunk_ids=ids, **kwargs)
    for _ in stream:
        pass
    answer = stream.answer
    if args.show_selection:
        from .eval import html

        if answer.mode != "cacheclip":
            raise ValueError(f"--show-selection shows CacheClip's selection; use --mode cacheclip, not {answer.mode!r}")
        html.write(args.show_selection, args.question, answer, stream.trace)
    result = {
        "answer": answer.text,
        "chunk_ids": answer.chunk_ids,
        "mode": answer.mode,
        "recompute_ratio": answer.recompute_ratio,
        "effective_fraction": answer.effective_fraction,
        "timings": answer.timings,
    }
    if args.compare_full and answer.mode != "full":
        full = engine.answer(args.question, chunk_ids=answer.chunk_ids, mode="full", max_new_tokens=args.max_new_tokens)
        result["full"] = {"answer": full.text, "ttft": full.timings["ttft"]}
    if args.json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
        return 0
    print(answer.text)
    print(f"\nchunks: {', '.join(answer.chunk_ids)}")
    print(f"{answer.mode} (ratio {answer.recompute_ratio}, effective {100 * answer.effective_fraction:.1f}%): {_fmt_timings(answer.timings)}")
    if "full" in result:
        print(f"full-mode TTFT on the same request: {result['full']['ttft']:.3f}s")
    return 0


def cmd_demo(args) -> int:
    docs, questions = _demo_documents()
    args.store = args.store or str(cache_dir() / "demo-store")
    engine = _engine(args, ChunkConfig(chunk_tokens=args.chunk_tokens, overlap_tokens=16))
    start = time.perf_counter()
    ids = engine.ingest(docs, progress=True)
    print(f"{describe_cpu()}; models compute in {str(engine.primary.lm.dtype).removeprefix('torch.')}")
    print(f"corpus: {len(docs)} documents -> {len(set(ids))} chunks, ingested in {time.perf_counter() - start:.1f}s (store {args.store})\n")
    for q in questions:
        answer = engine.answer(q["question"], mode="cacheclip", recompute_ratio=args.ratio, max_new_tokens=48)
        full = engine.answer(q["question"], chunk_ids=answer.chunk_ids, mode="full", max_new_tokens=48)
        sources = [engine.store.get_chunk(cid).source for cid in answer.chunk_ids]
        found = _found(q["answers"], answer.text)
        print(f"Q ({q.get('hops', 1)}-chunk): {q['question']}")
        print(f"A: {answer.text}")
        print(f"   expected {q['answers']} -> {'found' if found else 'NOT found'}; full mode said: {full.text}")
        if not found and _found(q["answers"], full.text):
            print(f"   {_ratio_needed(engine, q, answer.chunk_ids, args.ratio)}")
        print(f"   chunks: {', '.join(f'{c} ({s})' for c, s in zip(answer.chunk_ids, sources))}")
        print(f"   cacheclip ratio {args.ratio} (effective {100 * answer.effective_fraction:.1f}%): {_fmt_timings(answer.timings)}")
        print(f"   full-mode TTFT {full.timings['ttft']:.3f}s -> cacheclip TTFT is {answer.timings['ttft'] / full.timings['ttft']:.2f}x of full\n")
    return 0


def _found(answers: list[str], text: str) -> bool:
    return all(a.lower() in text.lower() for a in answers)


def _ratio_needed(engine, q: dict, chunk_ids: list[str], ratio: float) -> str:
    """For a demo question full attention answers and CacheClip at `ratio` does not: the
    smallest of a few higher ratios at which it does, measured on the same request."""
    for higher in (0.3, 0.4, 0.5, 0.6, 0.8):
        if higher <= ratio:
            continue
        again = engine.answer(q["question"], chunk_ids=chunk_ids, mode="cacheclip", recompute_ratio=higher, max_new_tokens=48)
        if _found(q["answers"], again.text):
            return (f"measured: at ratio {ratio} the reused caches are not repaired enough for this question; "
                    f"at {higher} (effective {100 * again.effective_fraction:.1f}%) cacheclip answers it: {again.text}")
    return "measured: cacheclip does not answer it at ratios up to 0.8; full attention does"


def cmd_models(args) -> int:
    from .models import EMBEDDED, resolve, verify_embedded

    dtype = ModelConfig(dtype=args.dtype).torch_dtype()
    for name, spec in EMBEDDED.items():
        start = time.perf_counter()
        verify_embedded(spec)
        folder = resolve(name, dtype)
        print(f"{name}: verified and ready in {folder} ({time.perf_counter() - start:.1f}s)")
    return 0


def cmd_train(args) -> int:
    """Train the primary's KV Packet adapters (`packet`: a .safetensors file) or its
    concatenation-aware LoRA (`lora`: a folder) by self-distillation; write them to --out."""
    from dataclasses import fields as dc_fields

    from .models import load
    from .train import LoraTrainConfig, TrainConfig

    kind = LoraTrainConfig if args.what == "lora" else TrainConfig
    given = {f.name: getattr(args, f.name) for f in dc_fields(kind) if getattr(args, f.name, None) is not None}
    cfg = kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})
    lm = load(args.primary, ModelConfig(dtype=args.dtype))
    print(describe_cpu() + f"; training in {str(lm.dtype).removeprefix('torch.')}")
    start = time.perf_counter()
    teacher = _progress_bar(cfg.samples + cfg.held_out, "teacher", "request")
    bar = _progress_bar(cfg.samples * cfg.epochs, "train", "step")
    if args.what == "lora":
        from dataclasses import asdict

        from . import lora
        from .train import train_lora

        peft_model, curve = train_lora(lm, cfg, progress=bar, teacher_progress=teacher)
        sha = lora.save(peft_model, args.out, lm, {"train_config": asdict(cfg), "curve": curve})
    else:
        from .train import save_adapters, train

        adapters, curve = train(lm, cfg, progress=bar, teacher_progress=teacher)
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


def cmd_serve(args) -> int:
    """The OpenAI-compatible HTTP server and web page over one engine (`cacheclip_rag.server`)."""
    from .server import serve

    engine = _engine(args)
    print(f"serving {engine.primary.lm.name} on http://{args.host}:{args.port}/ (OpenAI API under /v1; store {args.store})")
    serve(engine, host=args.host, port=args.port, max_active=args.max_active, max_waiting=args.max_waiting,
          default_max_tokens=args.max_tokens)
    return 0


def cmd_calibrate(args) -> int:
    from .calibrate import table

    engine = _engine(args)
    profile, scores = engine.calibrate(tuple(args.lengths), args.samples, ratio=args.ratio, max_run=args.max_run,
                                       criterion=args.criterion)
    print(table(scores, engine.aux.lm.num_layers))
    base = profile["baseline_kl"]
    print(f"\nfor scale: KL of reuse (nothing recomputed) {base['reuse']:.4f}; random rows at the ratio: KL "
          f"{base['random']:.4f}, hard {base['random_left_at_hard']:.3f}")
    last, align = profile["last_layer"], profile["best_by_alignment"]
    print(f"\nprofile for {profile['primary_name']} + {profile['aux_name']}: {_profile_line(profile)}, "
          f"by {profile['criterion']}: KL {profile['kl']:.4f}, hard {profile['left_at_hard']:.3f} "
          f"(Jaccard {profile['jaccard']:.3f}, recall {profile['recall']:.3f}).\n"
          f"The last layer ranks {last['rank']} (KL {last['kl']:.4f}); the best by Jaccard alone would be "
          f"{align['aux_layers']} (KL {align['kl']:.4f}). Saved with the store {engine.store.location}")
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": profile, "scores": [s.__dict__ for s in scores]}, indent=2))
    return 0


def _profile_line(profile: dict) -> str:
    return (f"aux layers {profile['aux_layers']}, heads {profile.get('head_agg', 'mean')}, rows "
            f"{profile.get('row_agg', 'mean')}, normalize {profile.get('normalize', 'none')}, context "
            f"{profile.get('context', 'chunk')}")


def cmd_store(args) -> int:
    from .store import KVStore

    root = args.store
    if "://" not in root and not (Path(root) / "store.json").exists():
        raise ValueError(f"{args.store!r} is not a cacheclip store (no store.json)")
    store = KVStore(root)
    if not store.read_manifest():
        raise ValueError(f"{args.store!r} is not a cacheclip store (no manifest)")
    if args.action == "stats":
        usage = store.usage()
        print(f"store {root}: {usage['chunks']} chunks, texts {usage['text_bytes'] / 2**20:.1f} MB")
        for ns, info in usage["namespaces"].items():
            dtypes = f"{info.get('dtype', '?')}/{info.get('kv_dtype', info.get('dtype', '?'))}"
            print(f"  {info.get('role', '?'):<8} {info.get('model', '?'):<32} {dtypes:<18} {info['caches']:>6} caches "
                  f"{info['bytes'] / 2**20:>9.1f} MB  (namespace {ns[:12]}, fingerprint {info.get('fingerprint', '?')[:12]})")
            if info.get("packets"):
                pk = info["packets"]
                print(f"           KV Packet adapters {pk['adapters']} ({pk['n_header']} header + {pk['n_trailer']} "
                      "trailer vectors); packet caches are built on first use or by `ingest --packets`")
        print("  memory tier: in-process, per engine (StoreConfig.memory_bytes); hit rates in `bench ttft` output")
        profiles = store.read_profiles()
        for profile in profiles:
            print(f"  selection profile: {_profile_line(profile)} for {profile['primary_name']} + "
                  f"{profile['aux_name']}, calibrated at {profile.get('lengths', '?')} tokens ({profile['created']})")
        if not profiles:
            print("  selection profile: none stored (the default pair uses the profiles the package ships; other "
                  "pairs score with the aux model's last layer until `cacheclip calibrate`)")
        return 0
    if args.action == "verify":
        report = store.verify()
        missing = sum(len(v) for v in report["missing"].values())
        print(f"checked {report['checked']} cache files: {len(report['damaged'])} damaged, "
              f"{missing} missing, {len(report['orphans'])} orphaned, {len(report['bad_texts'])} unreadable texts")
        for ns, name, why in report["damaged"]:
            print(f"  damaged: {ns[:12]}/{name}: {why}")
        return 0 if not (report["damaged"] or missing or report["bad_texts"]) else 1
    engine = _engine(args)
    result = engine.repair(progress=not args.quiet)
    print(f"repaired store {root}: {result['damaged']} damaged files found, {result['rebuilt']} caches rebuilt "
          f"for {result['chunks']} chunks")
    return 0


def _mode_list(modes: list[str], ratios: list[float]) -> list[tuple[str, float]]:
    from .eval.needle import BENCH_MODES

    out = []
    for mode in modes:
        if mode not in (*plan.modes(), *BENCH_MODES):
            raise ValueError(f"mode must be one of {[*plan.modes(), *BENCH_MODES]}, got {mode!r}")
        fixed = plan.get(mode).fixed_ratio if mode not in BENCH_MODES else None
        if fixed is not None:
            out.append((mode, fixed))
        else:
            out.extend((mode, r) for r in ratios)
    return out


def cmd_bench(args) -> int:
    print(f"{describe_cpu()}; compute dtype {args.dtype}")
    if args.what != "niah" and args.from_json:
        raise ValueError(f"--from applies to `bench niah`, not `bench {args.what}`")
    if args.what not in ("niah", "fidelity", "deviation") and args.versus:
        raise ValueError(f"--versus applies to `bench niah`, `fidelity` and `deviation`, not `bench {args.what}`")
    if args.what == "alignment":
        from .eval import alignment
        from .models import load

        rows = alignment.run(load(args.primary), load(args.aux), args.lengths, samples=args.samples, seed=args.seed + 10_000)
        print(alignment.table(rows))
        if args.json:
            alignment.write_json(rows, args.json)
        return 0
    if args.what == "niah":
        return _bench_niah(args)
    if args.what == "fidelity":
        return _bench_fidelity(args)
    if args.what == "deviation":
        return _bench_deviation(args)
    if args.what == "http":
        from .eval import http

        engine = _engine(args, ChunkConfig(chunk_tokens=args.chunk_tokens, overlap_tokens=0))
        rows = http.run(engine, args.lengths, _mode_list(args.modes or ["cacheclip"], args.ratios), runs=args.runs,
                        max_new_tokens=min(args.max_new_tokens, 16))
        print(http.table(rows))
        if args.json:
            http.write_json(rows, args.json)
        return 0
    from .eval import ttft
    from .recompute import attention_path

    engine = _engine(args, ChunkConfig(chunk_tokens=args.chunk_tokens, overlap_tokens=0))
    rows = ttft.run(engine, args.lengths, _mode_list(args.modes or ["full", "reuse", "cacheclip"], args.ratios),
                    runs=args.runs, max_new_tokens=args.max_new_tokens, budget=args.budget)
    primary, aux = engine.primary.lm.device, engine.aux.lm.device
    overlap = engine.config.pipeline.overlaps(primary, aux)
    print(f"primary on {primary}, aux on {aux}: aux selection "
          f"{'overlapped with cache loading' if overlap else 'before cache loading'}; recompute attends with "
          f"{attention_path(engine.config.attention_backend, primary, engine.primary.lm.dtype)}")
    print(ttft.table(rows))
    if args.json:
        ttft.write_json(rows, args.json)
    if args.plot:
        ttft.plot(rows, args.plot)
    stats = engine.store.stats
    print(f"store memory tier: {stats.memory_hits} hits, {stats.disk_hits} disk reads, {stats.misses} misses")
    return 0


def _print_versus(args, results: list, rows: list[dict], metric: str, title: str, scale: float = 100,
                  digits: int = 1, default_mode: str = "cacheclip") -> list[dict]:
    """After a bench table: the oracle's footnote, then the paired comparison of the --versus rows
    (default: the rows of `default_mode`) with every other on `metric`. Returns the pairs."""
    from .eval import needle

    if any(r["mode"] == "oracle" for r in rows):
        print("* oracle: analysis only; it selects with the primary's own attention from a full prefill")
    labels = args.versus or list(dict.fromkeys(r["label"] for r in rows if r["mode"] == default_mode))
    pairs = [p for label in labels for p in needle.versus(results, rows, label, metric=metric)]
    if pairs:
        print(f"\n{title}")
        print(needle.versus_table(pairs, scale=scale, digits=digits))
    return pairs


def _progress_bar(total: int, desc: str, unit: str):
    """A progress bar on stderr for a long job; the returned step(message) is called after each
    of its `total` units (the bar closes itself after the last)."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)

    def step(message: str) -> None:
        bar.set_postfix_str(message)
        bar.update(1)
        if bar.n >= total:
            bar.close()

    return step


def _progress(args):
    """The progress bar over the needle-suite samples a bench runs (minutes each at 4K on a CPU)."""
    from .niah import VARIANTS

    return _progress_bar(len(args.lengths) * len(args.variants or VARIANTS) * args.samples, "samples", "sample")


def _bench_deviation(args) -> int:
    """Reused vs full K/V per layer, how concentrated the deviation is, and the fidelity of
    rows chosen by deviation against rows chosen by attention."""
    from .eval import deviation, fidelity

    engine = _engine(args, ChunkConfig(chunk_tokens=args.chunk_tokens, overlap_tokens=0))
    deviations, results = deviation.run(engine, args.ratios, variants=args.variants, lengths=args.lengths,
                                        samples=args.samples, seed=args.seed, answer_tokens=args.max_new_tokens,
                                        budget=args.budget, progress=_progress(args), packets=args.packets)
    if not deviations:
        raise ValueError("full attention answered none of the samples; nothing to compare")
    what = "the KV Packet cache from a full prefill of the wrapped sequence" if args.packets else \
        "the reused cache from full prefill"
    print(f"Relative deviation of {what}, |full - reused| / |full|, mean over rows:")
    print(deviation.layer_table(deviations))
    print(deviation.concentration(deviations))
    print("\nFidelity to full attention of the rows each criterion picks:")
    rows = fidelity.summarize(results)
    print(fidelity.table(rows))
    pairs = _print_versus(args, results, rows, "kl", "Paired KL differences on the same samples (negative: closer "
                          "to full; 95% bootstrap interval; W/L: higher/lower KL):", scale=1, digits=4,
                          default_mode="packet+cacheclip" if args.packets else "oracle")
    if args.json:
        deviation.write_json(deviations, results, rows, args.json, pairs)
    return 0


def _bench_fidelity(args) -> int:
    """Teacher-force full attention's answer through each mode's recomputed rows; print the tables."""
    from .eval import fidelity

    engine = _engine(args, ChunkConfig(chunk_tokens=args.chunk_tokens, overlap_tokens=0))
    modes = _mode_list(args.modes or ["reuse", "random", "epic", "cacheclip-paper", "cacheclip", "oracle"], args.ratios)
    modes = [(m, r) for m, r in modes if m != "full"]  # full is the reference itself
    results = fidelity.run(engine, modes, variants=args.variants, lengths=args.lengths, samples=args.samples,
                           seed=args.seed, answer_tokens=args.max_new_tokens, budget=args.budget,
                           progress=_progress(args))
    rows = fidelity.summarize(results)
    print(fidelity.table(rows))
    pairs = _print_versus(args, results, rows, "kl", "Paired KL differences on the same samples (negative: "
                          "closer to full; 95% bootstrap interval; W/L: higher/lower KL):", scale=1, digits=4)
    if args.json:
        fidelity.write_json(results, rows, args.json, pairs)
    return 0


def _bench_niah(args) -> int:
    """Run the needle suite, or pool saved runs (--from), and print the tables."""
    from .eval import needle

    if args.from_json:
        results = needle.load(args.from_json)
    else:
        engine = _engine(args, ChunkConfig(chunk_tokens=args.chunk_tokens, overlap_tokens=0))
        modes = _mode_list(args.modes or ["full", "reuse", "ape", "cacheblend", "epic", "random", "cacheclip"], args.ratios)
        results = needle.run(engine, modes, variants=args.variants, lengths=args.lengths, samples=args.samples,
                             seed=args.seed, max_new_tokens=args.max_new_tokens, progress=_progress(args),
                             budget=args.budget)
    rows = needle.summarize(results)
    print(needle.table(rows))
    pairs = _print_versus(args, results, rows, "score",
                          "Paired differences on the same samples (x100; 95% stratified bootstrap interval):")
    if args.json:
        needle.write_json(results, rows, args.json, pairs)
    if args.plot:
        from .eval import plots

        stem = Path(args.plot)
        plots.quality_vs_ratio(rows, stem.with_name(stem.stem + "-quality.png"))
        plots.ttft_breakdown(rows, stem.with_name(stem.stem + "-ttft.png"))
    return 0


def cmd_eval(args) -> int:
    from .eval import qa

    examples = qa.load_dataset(args.dataset)
    if args.limit:
        examples = examples[: args.limit]
    engine = _engine(args)
    modes = _mode_list(args.modes or ["full", "reuse", "ape", "cacheblend", "random", "cacheclip"], args.ratios)
    results = qa.run(engine, examples, modes, max_new_tokens=args.max_new_tokens)
    rows = qa.summarize(results)
    print(qa.table(rows))
    if args.json:
        qa.write_json(results, rows, args.json)
    return 0


def _common(p: argparse.ArgumentParser, store_default: str | None = "cacheclip-store") -> None:
    p.add_argument("--store", default=store_default, help="store directory (caches, texts, index)")
    p.add_argument("--primary", default=DEFAULT_PRIMARY, help="primary model: embedded name, folder or hub id")
    p.add_argument("--aux", default=DEFAULT_AUX, help="auxiliary (selector) model")
    _dtype_arg(p)
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="storage dtype of the chunk caches (auto: bf16 for float32 models, else the compute dtype); "
                   "each has its own namespace")
    p.add_argument("--primary-adapter", default=None, metavar="DIR",
                   help="a LoRA folder from `cacheclip train lora`, or 'shipped' (the package's), merged into the "
                   "primary (the tuned primary)")
    p.add_argument("--adapters", default="auto", metavar="FILE",
                   help="KV Packet adapters for the packet modes: auto (shipped for the primary), a .safetensors "
                   "file from `cacheclip train packet`, or none")
    p.add_argument("-v", "--verbose", action="store_true")


def _dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="compute dtype of both models; auto: bf16 where the hardware has it natively, else float32")


def parser() -> argparse.ArgumentParser:
    from .eval import oracle  # noqa: F401  (registers the analysis-only oracle mode)

    ap = argparse.ArgumentParser(prog="cacheclip", description="RAG with reused chunk KV caches (CacheClip).")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("ingest", help="chunk, cache and index documents (.txt files or .jsonl with 'text')")
    _common(p)
    p.add_argument("files", nargs="+")
    p.add_argument("--chunk-tokens", type=int, default=ChunkConfig().chunk_tokens)
    p.add_argument("--overlap-tokens", type=int, default=ChunkConfig().overlap_tokens)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--packets", action="store_true", help="also build the KV Packet caches now (else on first use)")
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("ask", help="answer a question from the store")
    _common(p)
    p.add_argument("question")
    p.add_argument("--mode", choices=plan.modes(), default="cacheclip")
    p.add_argument("--ratio", type=float, default=0.2, help="recompute ratio in [0, 1]")
    p.add_argument("-k", type=int, default=None, help="chunks to retrieve")
    p.add_argument("--chunk-ids", default=None, help="comma-separated chunk ids (bypasses retrieval)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--compare-full", action="store_true", help="also run full mode and report its TTFT")
    p.add_argument("--show-selection", default=None, metavar="HTML", help="write the context with recomputed tokens and aux scores")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("demo", help="ingest the shipped corpus and answer its questions")
    _common(p, store_default=None)
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("calibrate", help="choose how the aux model scores tokens for a model pair; saves a profile in the store")
    _common(p)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048],
                   help="context lengths of the calibration inputs: those your requests have (a profile calibrated "
                        "at 1K scored twice the KL of one calibrated at 2K on 2K requests)")
    p.add_argument("--samples", type=int, default=6, help="calibration inputs per length (seeds disjoint from evaluation)")
    p.add_argument("--ratio", type=float, default=0.2, help="recompute fraction the candidates are compared at")
    p.add_argument("--max-run", type=int, default=3, help="longest run of adjacent aux layers tried")
    p.add_argument("--criterion", choices=["kl", "hard"], default="kl",
                   help="kl: mean KL over the answer; hard: divergence left where reuse diverges most")
    p.add_argument("--json", default=None)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("train", help="train the primary's KV Packet adapters or concatenation-aware LoRA (self-distillation)")
    p.add_argument("what", choices=["packet", "lora"], help="packet: header/trailer vectors (a .safetensors file); "
                   "lora: LoRA on attention and MLP projections (a folder)")
    p.add_argument("--primary", default=DEFAULT_PRIMARY, help="the model the adapters are for")
    _dtype_arg(p)
    p.add_argument("--out", required=True, help="packet: .safetensors file to write; lora: folder to write")
    from dataclasses import fields as dc_fields

    from .train import LoraTrainConfig, TrainConfig

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

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, ...) and a web page at /")
    _common(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-active", type=int, default=2, help="requests generating at once")
    p.add_argument("--max-waiting", type=int, default=8, help="requests queued beyond those; more get 503")
    p.add_argument("--max-tokens", type=int, default=256, help="default max_tokens of a request")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("store", help="inspect or heal a store: stats, verify, repair")
    _common(p)
    p.add_argument("action", choices=["stats", "verify", "repair"])
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_store)

    p = sub.add_parser("models", help="verify and convert the embedded default models (once)")
    _dtype_arg(p)
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("bench", help="benchmarks: niah (needle suite), fidelity (KL to full attention), deviation "
                       "(reused vs full K/V, and selecting by it), ttft, alignment")
    _common(p, store_default=str(cache_dir() / "bench-store"))
    p.add_argument("what", choices=["niah", "fidelity", "deviation", "ttft", "alignment", "http"],
                   help="http: TTFT through `cacheclip serve` against the engine's own, same requests")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048], help="context lengths in primary tokens")
    p.add_argument("--modes", nargs="+", default=None, help=f"modes to compare (from {list(plan.modes())}, and cacheclip-paper: last aux layer, paper rule; cacheclip-joint: "
                   "the aux query reads all chunks at once); "
                   "full is always run")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.2], help="recompute ratios for ratio modes")
    p.add_argument("--variants", nargs="+", default=None, help="needle variants (default: all eight)")
    p.add_argument("--budget", choices=["paper", "keep"], default="keep",
                   help="selection budget rule of cacheclip and oracle (keep: compare at equal effective fractions)")
    p.add_argument("--score-layers", type=int, nargs="+", default=None, help="aux scoring layers (default: profile or last)")
    p.add_argument("--samples", type=int, default=5, help="samples per variant and length")
    p.add_argument("--runs", type=int, default=5, help="ttft: runs per mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated (fidelity: answer tokens compared)")
    p.add_argument("--packets", action="store_true",
                   help="deviation: measure the KV Packet caches (against a full prefill of the wrapped sequence)")
    p.add_argument("--json", default=None, help="write results as JSON here")
    p.add_argument("--plot", default=None, help="write PNGs next to this path (niah: -quality, -ttft; ttft: -breakdown, -ratio)")
    p.add_argument("--from", dest="from_json", nargs="+", default=None, metavar="JSON",
                   help="niah: pool these saved runs (disjoint seeds, or other modes on the same samples) instead of running; "
                        "TAG=JSON puts a run under a tag (tuned=run.json: rows tuned/full, ...)")
    p.add_argument("--versus", nargs="+", default=None, metavar="LABEL",
                   help="niah, fidelity, deviation: compare these rows (e.g. cacheclip@0.2) with every other, sample "
                        "by sample (default: the cacheclip rows; deviation: the oracle rows)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("eval", help="QA from a JSON Lines file: every mode on the same examples")
    _common(p, store_default=str(cache_dir() / "eval-store"))
    p.add_argument("--dataset", default=str(resources.files("cacheclip_rag") / "data" / "qa_invented.jsonl"))
    p.add_argument("--score-layers", type=int, nargs="+", default=None, help="aux scoring layers (default: profile or last)")
    p.add_argument("--modes", nargs="+", default=None)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.2])
    p.add_argument("--limit", type=int, default=None, help="first N examples only")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json", default=None)
    p.set_defaults(func=cmd_eval)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except ValueError as err:
        print(f"cacheclip: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
