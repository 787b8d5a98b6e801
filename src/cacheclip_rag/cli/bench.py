"""`cacheclip bench` and `eval`: benchmarks and QA evaluation, tables printed, JSON and plots written."""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path

from ..config import AUTO, ChunkConfig, EngineConfig
from ..config import IndexConfig as IndexConfigDefaults
from ..eval import oracle  # noqa: F401  (registers the analysis-only oracle mode for bench and ask)
from ..eval.qa_data import FORMATS as QA_FORMATS
from ..hardware import describe as describe_cpu, machine
from ..paths import cache_dir
from ..request import selector as registry
from ..request.options import ratio_arg
from ..storage.codecs import names as codec_choices
from .common import add_common, add_dtype, engine_from_args, progress_bar


def _mode_list(modes: list[str], ratios: list) -> list[tuple[str, float | str]]:
    """(mode, ratio) pairs: a fixed-ratio mode once, every other mode at every ratio ("auto" only
    for the modes that size their own budget; a list of only "auto" for others is an error)."""
    from ..eval.needle import BENCH_MODES

    out = []
    for mode in modes:
        if mode not in (*registry.modes(), *BENCH_MODES):
            raise ValueError(f"mode must be one of {[*registry.modes(), *BENCH_MODES]}, got {mode!r}")
        fixed = registry.get(mode).fixed_ratio if mode not in BENCH_MODES else None
        adaptive = mode in BENCH_MODES or registry.get(mode).adaptive
        if fixed is not None:
            out.append((mode, fixed))
        elif not adaptive and all(r == AUTO for r in ratios):
            raise ValueError(f"mode {mode!r} takes numeric ratios, not only 'auto'")
        else:
            out.extend((mode, r) for r in ratios if adaptive or r != AUTO)
    return out


def _header(args) -> None:
    print(f"{describe_cpu()}; compute dtype {args.dtype}")


def _bench_alignment(args) -> int:
    """Aux against primary attention over the same chunks, in character space."""
    from ..eval import alignment
    from ..models.loading import load

    _header(args)
    rows = alignment.run(load(args.primary), load(args.aux), args.lengths, samples=args.samples, seed=args.seed + 10_000)
    print(alignment.table(rows))
    if args.json:
        alignment.write_json(rows, args.json)
    return 0


def _bench_http(args) -> int:
    """TTFT through `cacheclip serve` against the engine's own, same requests."""
    from ..eval import http

    _header(args)
    engine = _engine(args)
    rows = http.run(engine, args.lengths, _mode_list(args.modes or ["cacheclip"], args.ratios or [0.2]),
                    runs=args.runs, max_new_tokens=min(args.max_new_tokens, 16))
    print(http.table(rows))
    if args.json:
        http.write_json(rows, args.json)
    return 0


def _bench_ttft(args) -> int:
    """Every mode's TTFT on the same requests, alternated run by run (and llama.cpp as a peer)."""
    from ..eval import ttft
    from ..request.recompute import attention_path

    _header(args)
    engine = _engine(args)
    peers = _open_peers(args.peer or [], args.primary, max(args.lengths) + 512)
    try:
        modes = _mode_list(args.modes or ["full", "reuse", "cacheclip"], args.ratios or [0.2])
        step = progress_bar(ttft.requests(args.lengths, modes, args.runs, peers), "ttft", "request")
        rows = ttft.run(engine, args.lengths, modes, runs=args.runs, max_new_tokens=args.max_new_tokens,
                        budget=args.budget, peers=peers, progress=step)
    finally:
        for peer in peers.values():
            if not isinstance(peer, str):
                peer.close()
    primary, aux = engine.primary.lm.device, engine.aux.lm.device
    overlap = engine.config.pipeline.overlaps(primary, aux)
    print(f"primary on {primary}, aux on {aux}: aux selection "
          f"{'overlapped with cache loading' if overlap else 'before cache loading'}; recompute attends with "
          f"{attention_path(engine.config.attention_backend, primary, engine.primary.lm.dtype)}")
    print(ttft.table(rows))
    if args.json:
        ttft.write_json(rows, args.json, machine())
    if args.plot:
        ttft.plot(rows, args.plot)
    stats = engine.store.stats
    print(f"store memory tier: {stats.memory_hits} hits, {stats.disk_hits} disk reads, {stats.misses} misses")
    return 0


def _bench_schedules(args) -> int:
    """One cacheclip request under three schedules of its stages, cold, alternated."""
    from ..eval import schedules

    _header(args)
    engine = _engine(args)
    step = progress_bar(args.runs * len(schedules.SCHEDULES), "schedules", "request")
    rows = schedules.run(engine, args.length, runs=args.runs, ratio=args.ratio, progress=step)
    print(f"{args.length} tokens, cacheclip@{args.ratio}, {args.runs} cold runs per schedule, medians (s)")
    print(schedules.table(rows))
    if args.json:
        schedules.write_json(rows, args.json, describe_cpu())
    return 0


def _bench_recompute_profile(args) -> int:
    """torch.profiler's operators of one request's selective recompute, beside a full prefill."""
    from ..eval import recompute_profile

    _header(args)
    engine = _engine(args)
    result = recompute_profile.run(engine, args.length, ratio=args.ratio, full=not args.no_full)
    print(recompute_profile.report(result))
    if args.json:
        recompute_profile.write_json(result, args.json, describe_cpu())
    return 0


def _bench_gpu(args) -> int:
    """The GPU check (`eval/gpu.py`; on a bare machine run `scripts/gpu_check.sh` instead)."""
    from ..eval import gpu

    return gpu.main(["--out", args.out, "--budget", str(args.budget), *(["--dry-run"] if args.dry_run else [])])


def _engine(args):
    return engine_from_args(args, ChunkConfig(chunk_tokens=args.chunk_tokens, overlap_tokens=0))


def _open_peers(kinds: list[str], primary: str, n_ctx: int) -> dict:
    """name -> an open peer, or the reason it cannot run here (printed, and kept as its row's note)."""
    import torch

    from ..eval import peers as peer_lib

    opened: dict = {}
    for kind in dict.fromkeys(kinds):
        try:
            peer = peer_lib.open_peer(kind, primary, torch.get_num_threads(), n_ctx)
            opened[peer.name] = peer
        except peer_lib.PeerUnavailable as why:
            print(f"peer {kind}: {why}")
            opened[kind] = str(why)
    return opened


def _bench_load(args) -> int:
    """K users against a running server; the table, and JSON with every request's outcome."""
    import asyncio

    from ..eval import load
    from ..serving.access import Keys

    _header(args)
    cfg = load.LoadConfig(users=args.users, seconds=args.duration, requests=args.requests,
                          mix=load.parse_mix(args.mix), pool=args.pool, documents=args.documents,
                          context=args.context, max_tokens=min(args.max_new_tokens, 64), seed=args.seed)
    keys = Keys.from_env(args.api_key, args.admin_key)
    load.check_url(args.url)
    step = progress_bar(cfg.requests, "load", "request")
    try:
        report = asyncio.run(load.run(args.url, cfg, api_key=keys.api, admin_key=keys.admin,
                                      seed_corpus=not args.no_seed, progress=step))
    finally:
        step.close()  # the time bound may end the load before the request bound
    print(load.table(report))
    if args.json:
        load.write_json(report, args.json)
    return 0


def _print_versus(args, results: list, rows: list[dict], metric: str, title: str, scale: float = 100,
                  digits: int = 1, default_mode: str = "cacheclip") -> list[dict]:
    """After a bench table: the oracle's footnote, then the paired comparison of the --versus rows
    (default: the rows of `default_mode`) with every other on `metric`. Returns the pairs."""
    from ..eval import needle

    if any(r["mode"] == "oracle" for r in rows):
        print("* oracle: analysis only; it selects with the primary's own attention from a full prefill")
    labels = args.versus or list(dict.fromkeys(r["label"] for r in rows if r["mode"] == default_mode))
    pairs = [p for label in labels for p in needle.versus(results, rows, label, metric=metric)]
    if pairs:
        print(f"\n{title}")
        print(needle.versus_table(pairs, scale=scale, digits=digits))
    return pairs


def progress(args):
    """The progress bar over the needle-suite samples a bench runs (minutes each at 4K on a CPU)."""
    from ..offline.niah import VARIANTS

    return progress_bar(len(args.lengths) * len(args.variants or VARIANTS) * args.samples, "samples", "sample")


def _bench_deviation(args) -> int:
    """Reused vs full K/V per layer, how concentrated the deviation is, and the fidelity of
    rows chosen by deviation against rows chosen by attention."""
    from ..eval import deviation, fidelity

    _header(args)
    args.ratios = args.ratios or [0.2]
    modes = [m for m in dict.fromkeys(args.modes or []) if m not in ("full", "oracle")]  # oracle: always replayed
    if unknown := [m for m in modes if m not in registry.modes()]:
        raise ValueError(f"bench deviation replays serving modes {list(registry.modes())}; got {unknown!r}")
    engine = _engine(args)
    deviations, results = deviation.run(engine, args.ratios, variants=args.variants, lengths=args.lengths,
                                        samples=args.samples, seed=args.seed, answer_tokens=args.max_new_tokens,
                                        budget=args.budget, progress=progress(args), packets=args.packets,
                                        modes=modes)
    if not deviations:
        raise ValueError("full attention answered none of the samples; nothing to compare")
    what = "the KV Packet cache from a full prefill of the wrapped sequence" if args.packets else \
        "the reused cache from full prefill"
    print(f"Relative deviation of {what}, |full - reused| / |full|, mean over rows:")
    print(deviation.layer_table(deviations))
    print(deviation.concentration(deviations))
    print("\nShare of the deviation held by the rows each criterion picks:")
    print(deviation.held_table(deviations))
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
    from ..eval import fidelity

    _header(args)
    args.ratios = args.ratios or (FRONTIER_RATIOS if args.frontier else [0.2])
    engine = _engine(args)
    default = FIDELITY_FRONTIER_MODES if args.frontier else ["reuse", "random", "epic", "cacheclip-paper", "cacheclip",
                                                             "oracle"]
    modes = _mode_list(args.modes or default, args.ratios)
    modes = [(m, r) for m, r in modes if m != "full"]  # full is the reference itself
    results = fidelity.run(engine, modes, variants=args.variants, lengths=args.lengths, samples=args.samples,
                           seed=args.seed, answer_tokens=args.max_new_tokens, budget=args.budget,
                           progress=progress(args))
    rows = fidelity.summarize(results)
    print(fidelity.table(rows))
    pairs = _print_versus(args, results, rows, "kl", "Paired KL differences on the same samples (negative: "
                          "closer to full; 95% bootstrap interval; W/L: higher/lower KL):", scale=1, digits=4)
    if args.json:
        fidelity.write_json(results, rows, args.json, pairs)
    if args.frontier:
        _print_frontier(args, rows, "fidelity")
    return 0


def _bench_niah(args) -> int:
    """Run the needle suite, or pool saved runs (--from), and print the tables."""
    from ..eval import needle
    from ..eval.journal import provenance

    _header(args)
    args.ratios = args.ratios or (FRONTIER_RATIOS if args.frontier else [0.2])
    if args.from_json:
        results = needle.load(args.from_json)
        print(provenance(args.from_json))
    else:
        engine = _engine(args)
        default = FRONTIER_MODES if args.frontier else ["full", "reuse", "ape", "cacheblend", "epic", "random", "cacheclip"]
        modes = _mode_list(args.modes or default, args.ratios)
        journal = _journal(args, engine, budget=args.budget, chunk_tokens=args.chunk_tokens)
        results = needle.run(engine, modes, variants=args.variants, lengths=args.lengths, samples=args.samples,
                             seed=args.seed, max_new_tokens=args.max_new_tokens, progress=progress(args),
                             budget=args.budget, journal=journal)
    rows = needle.summarize(results)
    print(needle.table(rows))
    pairs = _print_versus(args, results, rows, "score",
                          "Paired differences on the same samples (x100; 95% stratified bootstrap interval):")
    if args.json:
        needle.write_json(results, rows, args.json, pairs)
    if args.frontier:
        _print_frontier(args, rows, "niah")
    if args.plot:
        from ..eval import plots

        stem = Path(args.plot)
        plots.quality_vs_ratio(rows, stem.with_name(stem.stem + "-quality.png"))
        plots.ttft_breakdown(rows, stem.with_name(stem.stem + "-ttft.png"))
    return 0


def _journal(args, engine, **settings):
    """The --results journal of a bench, its header the settings its rows depend on, the codecs
    the engine's caches are kept in among them (None without --results)."""
    from ..config import ModelConfig
    from ..eval.journal import Journal

    if not args.results:
        return None
    header = {"primary": args.primary, "aux": args.aux, "dtype": str(ModelConfig(dtype=args.dtype).torch_dtype()),
              "kv_dtype": args.kv_dtype, "kv_codec": engine.primary.codec, "aux_kv_codec": engine.aux.codec,
              "max_new_tokens": args.max_new_tokens, "score_layers": args.score_layers, **settings}
    journal = Journal(args.results, header, machine=machine())
    print(f"resuming {args.results} ({len(journal.rows)} rows)" if journal.rows else f"rows go to {args.results}")
    return journal


FRONTIER_MODES = ["full", "reuse", "cacheblend", "epic", "random", "cacheclip", "prophetkv"]
"""`bench niah --frontier`'s modes when none are given (the packet modes join with --modes)."""
FIDELITY_FRONTIER_MODES = ["reuse", "epic", "random", "cacheclip", "prophetkv"]
"""`bench fidelity --frontier`'s: the modes with a row set to replay (CacheBlend has none)."""
FRONTIER_RATIOS = [0.1, 0.2, 0.3, 0.4]


def _warn_mixed_machines(args) -> None:
    """A frontier pooled from rows of several machines places them at TTFT ratios of mixed CPUs:
    say so, and what gives one machine's."""
    from ..eval.journal import pooled_machines

    if getattr(args, "from_json", None) and len(pooled_machines(args.from_json)) > 1:
        print("\nnote: the pooled rows were measured on more than one machine (above), so the frontier's "
              "TTFT / full averages CPUs; --ttft-from a `bench ttft --json` run places them at one machine's")


def _print_frontier(args, rows: list[dict], bench: str) -> None:
    """Per length: each mode's score at the TTFT budget and the Pareto frontier (and a plot).
    bench: "niah" (% of full attention's score) or "fidelity" (KL to full attention)."""
    from ..eval import fidelity, frontier

    to_points, metric, title = {"niah": (frontier.points, frontier.NEEDLE, "Needle suite"),
                                "fidelity": (fidelity.points, frontier.KL, "Fidelity")}[bench]
    if getattr(args, "ttft_from", None):
        rows = frontier.retime(rows, frontier.load_ttft(args.ttft_from), args.ttft_from)
        print(f"\nthe frontier at the TTFT / full of {args.ttft_from} ({frontier.ttft_machine(args.ttft_from)})")
    else:
        _warn_mixed_machines(args)
    for length in sorted({r["length"] for r in rows}):
        pts = to_points([r for r in rows if r["length"] == length])
        print("\n" + frontier.table(pts, args.budget_ttft, length, metric))
        if metric.higher_is_better:
            print("\n" + frontier.reach_table(pts))
        if args.plot:
            stem = Path(args.plot)
            frontier.plot(pts, str(stem.with_name(f"{stem.stem}-frontier-{length}.png")), args.budget_ttft,
                          f"{title}, {length} tokens", metric)


QA_MODES = ["full", "reuse", "cacheblend", "cacheclip", "prophetkv"]
"""`bench qa`'s modes when none are given (with --frontier, at every ratio of FRONTIER_RATIOS)."""
QA_BUDGETS = [0.25, 0.3]


def _bench_qa(args) -> int:
    """Every mode on the same questions of a QA file, written as measured (--results resumes);
    the table, paired differences of F1 and of agreement with full attention, and the frontier."""
    from dataclasses import asdict

    from ..eval import qa, qa_data

    _header(args)
    if args.from_json:
        return _qa_tables(args, _qa_pooled(args))
    if args.data is None:
        raise ValueError("bench qa needs --data FILE (the questions to run) or --from JOURNAL ... (runs to pool)")
    data = qa_data.load(args.data, args.format)
    if args.offset < 0 or args.offset >= len(data.examples):
        raise ValueError(f"--offset must be in [0, {len(data.examples)}) for the {len(data.examples)} questions of "
                         f"{args.data}, got {args.offset}")
    end = args.offset + args.limit if args.limit else None
    examples = data.examples[args.offset:end]
    args.ratios = args.ratios or (FRONTIER_RATIOS if args.frontier else [0.2])
    prompt = data.prompt if args.prompt == "dataset" else None
    if args.question_first:
        prompt = dataclasses.replace(prompt or EngineConfig().prompt, question_first=args.question_first)
    if args.indices and not args.diagnose:
        raise ValueError("--indices chooses the questions of --diagnose; a QA run takes --offset / --limit")
    if args.diagnose and (args.results or args.frontier):
        raise ValueError("--diagnose writes its rows with --json; it takes no --results journal and no --frontier")
    if args.diagnose:
        chosen = args.indices or list(range(args.offset, args.offset + len(examples)))
        bad = [i for i in chosen if not 0 <= i < len(data.examples)]
        if bad:
            raise ValueError(f"--indices must be in [0, {len(data.examples)}) for {args.data}, got {bad}")
        return _qa_diagnose(args, [(i, data.examples[i]) for i in chosen], engine_from_args(args, prompt=prompt))
    modes = _mode_list(args.modes or QA_MODES, args.ratios)
    engine = engine_from_args(args, prompt=prompt)
    print(f"{len(examples)} questions of {args.data} ({data.format}; index {args.offset}..{args.offset + len(examples) - 1}), "
          f"prompt: {args.prompt}'s")
    journal = _journal(args, engine, data=Path(args.data).name, format=data.format, questions=len(data.examples),
                       prompt=asdict(engine.config.prompt))
    results = qa.run(engine, examples, modes, max_new_tokens=args.max_new_tokens, offset=args.offset,
                     journal=journal, progress=progress_bar(len(examples), "questions", "question"))
    return _qa_tables(args, results)


def _qa_pooled(args) -> list:
    """`bench qa --from`: the saved rows of the questions --offset / --limit choose."""
    from ..eval import qa
    from ..eval.journal import provenance

    if args.diagnose:
        raise ValueError("--diagnose measures; it does not pool saved runs (--from)")
    end = args.offset + args.limit if args.limit else float("inf")
    results = [r for r in qa.load(args.from_json) if args.offset <= r.index < end]
    if not results:
        raise ValueError(f"no saved rows of questions {args.offset}..{end - 1} in {args.from_json}")
    print(provenance(args.from_json))
    return results


def _qa_tables(args, results) -> int:
    """`bench qa`'s tables of measured or pooled rows: the modes, paired differences, the frontier."""
    from ..eval import frontier, needle, qa

    rows = qa.summarize(results)
    print(qa.table(rows))
    labels = args.versus or [r["label"] for r in rows if r["mode"] == "cacheclip"]
    pairs = [p for label in labels for metric in ("f1", "agreement") for p in qa.versus(results, rows, label, metric)]
    for metric, what in (("f1", "gold F1"), ("agreement", "agreement with full attention's answer")):
        chosen = [p for p in pairs if p["metric"] == metric]
        if chosen:
            print(f"\nPaired differences of {what} on the same questions (x100; 95% bootstrap interval; W/L):")
            print(needle.versus_table(chosen))
    if args.frontier:
        _warn_mixed_machines(args)
        pts = frontier.points(rows)
        metric = frontier.Metric("% of full attention's F1")
        for budget in args.budget_ttft:
            print("\n" + frontier.table(pts, budget, None, metric))
        print("\n" + frontier.reach_table(pts))
        if args.plot:
            title = f"QA: {Path(args.data).name}" if args.data and not args.from_json else "QA: pooled runs"
            frontier.plot(pts, args.plot, args.budget_ttft[0], title, metric)
    if args.json:
        qa.write_json(results, rows, args.json, pairs)
    return 0


def _qa_diagnose(args, items, engine) -> int:
    """`bench qa --diagnose`: KL from full attention, the oracle's attention held, the gold
    passages' recompute, per mode and per question."""
    from ..eval import qa_diagnose

    names = [m for m in args.modes or ("reuse", "cacheclip", "prophetkv", qa_diagnose.ORACLE) if m != "full"]
    served = [m for m in names if m != qa_diagnose.ORACLE]
    modes = _mode_list(served, args.ratios) if served else []
    modes += [(qa_diagnose.ORACLE, r) for r in args.ratios if qa_diagnose.ORACLE in names]
    print(f"diagnosis of {len(items)} questions (index {[i for i, _ in items]}), modes {modes}")
    results = qa_diagnose.run(engine, items, modes, answer_tokens=args.max_new_tokens,
                              progress=progress_bar(len(items), "questions", "question"))
    rows = qa_diagnose.summarize(results)
    print(qa_diagnose.table(rows))
    print("\n" + qa_diagnose.question_table(results))
    if args.json:
        qa_diagnose.write_json(results, rows, args.json)
    return 0


def _bench_index(args) -> int:
    """`bench index`: the chunk index at corpus sizes (synthetic clustered embeddings)."""
    from ..config import IndexConfig
    from ..eval import index_bench

    _header(args)
    cfg = IndexConfig(nprobe=args.nprobe, ef_search=args.ef_search)
    rows = []
    for size in args.sizes:
        kinds = [k for k in args.kinds if k != "hnsw" or size <= args.hnsw_max]
        if len(kinds) < len(args.kinds):
            print(f"(hnsw left out at {size} vectors: building it takes too long on this machine; --hnsw-max)")
        rows += index_bench.measure(size, kinds, cfg, queries=args.queries, k=args.k, ingest=args.ingest)
        print(index_bench.table([r for r in rows if r.size == size]), flush=True)
    print(f"\nrecall@{args.k} against the flat index's exact top {args.k}; one query at a time; nprobe {args.nprobe}, "
          f"efSearch {args.ef_search}; 'written' is what an ingest of {args.ingest} chunks writes (a segment)")
    print(index_bench.table(rows))
    if args.json:
        index_bench.write_json(rows, args.json, {"cpu": describe_cpu(), "nprobe": args.nprobe,
                                                 "ef_search": args.ef_search, "queries": args.queries})
    return 0


def _bench_store(args) -> int:
    """`bench store`: every codec's bytes, encode/decode time, needle score, KL and TTFT, one run."""
    from ..eval import fidelity, needle
    from ..eval import store_bench as sb
    from .common import engine_config

    _header(args)
    names = args.codecs
    if "bf16" not in names:
        raise ValueError(f"bench store pairs every codec with bf16: include it in --codecs (got {names})")
    probe = _engine(args)
    primary, aux = probe.primary.lm, probe.aux.lm
    probe.close()
    cfg = engine_config(args, ChunkConfig(chunk_tokens=args.chunk_tokens, overlap_tokens=0))
    root = Path(args.store) / "codecs"
    engines = sb.open_engines(primary, aux, root, names, cfg, args.redis)
    bench = sb.StoreBench()
    modes = _mode_list(args.modes or ["reuse", "cacheclip", "prophetkv"], args.ratios or [0.2])
    try:
        for codec in names:
            engine = engines[(codec, "file")]
            step = progress_bar(len(args.lengths) * len(args.variants or needle.VARIANTS) * args.samples,
                                f"needle {codec}", "sample")
            bench.needle[codec] = needle.run(engine, modes, args.variants, args.lengths, args.samples, args.seed,
                                             max_new_tokens=args.max_new_tokens, progress=step, budget="keep")
            if args.fidelity_samples:
                step = progress_bar(len(args.lengths) * len(args.variants or needle.VARIANTS) * args.fidelity_samples,
                                    f"fidelity {codec}", "sample")
                bench.fidelity[codec] = fidelity.run(engine, [m for m in modes if m[0] != "full"], args.variants,
                                                     args.lengths, args.fidelity_samples, args.seed,
                                                     answer_tokens=args.answer_tokens, budget="keep", progress=step)
            bench.costs.append(sb.codec_cost(engine, codec, sb.first_chunk(engine)))
        if args.runs:
            timed = [m for m in modes if m[0] != "reuse"]
            step = progress_bar(len(args.lengths) * args.runs * len(engines) * (len(timed) + 1), "ttft", "request")
            bench.ttft = sb.ttft_rows(engines, args.ttft_lengths or args.lengths, needle.with_full(timed),
                                      args.runs, progress=step)
    finally:
        sb.clear(engines)
    print("\nBytes a token as stored (primary + aux at the aux depth kept), encode/decode of one layer's K and V "
          f"of a {sb.CHUNK_TOKENS}-token chunk:")
    print(sb.cost_table(bench.costs))
    for codec in names:
        print(f"\nNeedle suite, codec {codec} (budget keep):")
        print(needle.table(needle.summarize(bench.needle[codec])))
    print("\nNeedle score, codec - bf16 on the same samples (points; 95% bootstrap interval):")
    print(sb.paired_table(sb.paired_vs_bf16(bench.needle, "score"), 100, 1))
    if bench.fidelity:
        for codec in names:
            print(f"\nFidelity, codec {codec}:")
            print(fidelity.table(fidelity.summarize(bench.fidelity[codec])))
        print("\nKL(full || mode), codec - bf16 on the same samples:")
        print(sb.paired_table(sb.paired_vs_bf16(bench.fidelity, "kl"), 1, 4))
    if bench.ttft:
        print("\nTTFT, codecs and stores alternated run by run, cold (medians):")
        print(sb.ttft_table(bench.ttft))
    print(f"\nA corpus of N chunks of {sb.CHUNK_TOKENS} tokens (peer primaries: their published shapes at this "
          "codec's measured primary ratio, with this aux):")
    print(sb.projection_table(sb.projection(bench.costs, primary, aux)))
    if args.json:
        sb.write_json(bench, {"cpu": describe_cpu(), "args": {k: v for k, v in vars(args).items() if k != "func"}},
                      args.json)
    return 0


def _engine_flags(p) -> None:
    add_common(p, store_default=str(cache_dir() / "bench-store"))
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--score-layers", type=int, nargs="+", default=None, help="aux scoring layers (default: profile or last)")


def _mode_flags(p, default: str, ratios: str = "default 0.2") -> None:
    p.add_argument("--modes", nargs="+", default=None,
                   help=f"modes to compare (registered: {list(registry.modes())}; and cacheclip-paper: last aux "
                        f"layer, paper rule; cacheclip-joint / cacheclip-chunk: the aux query reads all chunks at "
                        f"once / each alone); default {default}")
    p.add_argument("--ratios", type=ratio_arg, nargs="+", default=None,
                   help=f"recompute ratios of the ratio modes (auto: the selector decides per request); {ratios}")
    p.add_argument("--budget", choices=["paper", "keep"], default="keep",
                   help="selection budget rule of cacheclip and oracle (keep: compare at equal effective fractions)")


def _suite_flags(p, lengths: list[int] = (2048,)) -> None:
    p.add_argument("--lengths", type=int, nargs="+", default=list(lengths), help="context lengths in primary tokens")
    p.add_argument("--variants", nargs="+", default=None, help="needle variants (default: all eight)")
    p.add_argument("--samples", type=int, default=5, help="samples per variant and length")
    p.add_argument("--seed", type=int, default=0)


def _versus_flag(p, default: str) -> None:
    p.add_argument("--versus", nargs="+", default=None, metavar="LABEL",
                   help=f"compare these rows (e.g. cacheclip@0.2) with every other, sample by sample (default: {default})")


def _frontier_flags(p) -> None:
    p.add_argument("--frontier", action="store_true",
                   help="every mode over the ratios, placed at its measured TTFT / full; prints each mode's score at "
                        "--budget-ttft and the Pareto frontier (plot with --plot)")
    p.add_argument("--budget-ttft", type=float, default=0.25, help="the TTFT / full budget the frontier is read at")


def _from_flag(p, disjoint: str) -> None:
    p.add_argument("--from", dest="from_json", nargs="+", default=None, metavar="JSON",
                   help=f"pool these saved runs or journals ({disjoint}, or other modes on the same samples) instead "
                        "of running; TAG=JSON puts a run under a tag (tuned=run.json: rows tuned/full, ...)")


def _results_flag(p) -> None:
    p.add_argument("--results", default=None, metavar="JSONL",
                   help="write each row here as it is measured; the same command with the same file resumes there "
                        "(a file of other settings is refused)")


def _out_flags(p, plot: str | None = None) -> None:
    p.add_argument("--json", default=None, help="write results as JSON here")
    if plot:
        p.add_argument("--plot", default=None, help=f"write PNGs next to this path ({plot})")


def add_commands(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks; each prints its table and writes JSON (`cacheclip bench BENCH -h`)")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")

    p = benches.add_parser("niah", help="the needle suite: every mode's score on the same samples, paired")
    _engine_flags(p)
    _suite_flags(p)
    _mode_flags(p, "full reuse ape cacheblend epic random cacheclip", "default 0.2, with --frontier 0.1 0.2 0.3 0.4")
    _frontier_flags(p)
    _versus_flag(p, "the cacheclip rows")
    p.add_argument("--max-new-tokens", type=int, default=64)
    _from_flag(p, "disjoint seeds")
    p.add_argument("--ttft-from", default=None, metavar="JSON",
                   help="place the frontier's points at the TTFT / full of this `bench ttft --json` run (one on an "
                        "idle CPU) instead of the samples' own")
    _results_flag(p)
    _out_flags(p, "-quality, -ttft, -frontier-LENGTH")
    p.set_defaults(func=_bench_niah)

    p = benches.add_parser("fidelity", help="KL to full attention of each mode's recompute, teacher-forced, no labels")
    _engine_flags(p)
    _suite_flags(p)
    _mode_flags(p, "reuse random epic cacheclip-paper cacheclip oracle", "default 0.2, with --frontier 0.1 0.2 0.3 0.4")
    _frontier_flags(p)
    _versus_flag(p, "the cacheclip rows")
    p.add_argument("--max-new-tokens", type=int, default=64, help="answer tokens compared")
    _out_flags(p, "-frontier-LENGTH")
    p.set_defaults(func=_bench_fidelity)

    p = benches.add_parser("deviation", help="reused vs full K/V per layer, and rows selected by that deviation")
    _engine_flags(p)
    _suite_flags(p)
    _mode_flags(p, "none besides the oracle")
    _versus_flag(p, "the oracle rows")
    p.add_argument("--max-new-tokens", type=int, default=64, help="answer tokens compared")
    p.add_argument("--packets", action="store_true",
                   help="measure the KV Packet caches (against a full prefill of the wrapped sequence)")
    _out_flags(p)
    p.set_defaults(func=_bench_deviation)

    p = benches.add_parser("ttft", help="time to first token of every mode on the same requests, alternated")
    _engine_flags(p)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048], help="context lengths in primary tokens")
    _mode_flags(p, "full reuse cacheclip")
    p.add_argument("--runs", type=int, default=5, help="runs per mode")
    p.add_argument("--peer", action="append", choices=["llamacpp"], default=None,
                   help="a peer row, timed in the same alternation: llamacpp, llama.cpp's full prefill of the GGUF "
                        "the primary was converted from (optional `peers` extra)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    _out_flags(p, "-breakdown, -ratio")
    p.set_defaults(func=_bench_ttft)

    p = benches.add_parser("schedules", help="one cacheclip request with the aux selection overlapped, first, or "
                           "everything serial")
    _engine_flags(p)
    p.add_argument("--length", type=int, default=4096, help="request length in primary tokens")
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--runs", type=int, default=3, help="cold runs per schedule")
    _out_flags(p)
    p.set_defaults(func=_bench_schedules)

    p = benches.add_parser("recompute-profile", help="torch.profiler's operators of one selective recompute beside "
                           "a full prefill")
    _engine_flags(p)
    p.add_argument("--length", type=int, default=4096, help="request length in primary tokens")
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--no-full", action="store_true", help="skip the full prefill")
    _out_flags(p)
    p.set_defaults(func=_bench_recompute_profile)

    p = benches.add_parser("gpu", help="the GPU check: kernel, oracles on the device, TTFT with the primary on the GPU "
                           "(docs/gpu.md); --dry-run: the same on the CPU")
    p.add_argument("--out", default="out/gpu", help="folder for every table and its JSON")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, Triton's interpreter")
    p.add_argument("--budget", type=float, default=450.0, help="seconds after which the remaining parts are skipped")
    p.set_defaults(func=_bench_gpu)

    p = benches.add_parser("alignment", help="aux against primary attention over the same chunks")
    _engine_flags(p)
    _suite_flags(p)
    _out_flags(p)
    p.set_defaults(func=_bench_alignment)

    p = benches.add_parser("http", help="TTFT through `cacheclip serve` against the engine's own, same requests")
    _engine_flags(p)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048], help="context lengths in primary tokens")
    _mode_flags(p, "cacheclip")
    p.add_argument("--runs", type=int, default=5, help="runs per mode")
    p.add_argument("--max-new-tokens", type=int, default=16)
    _out_flags(p)
    p.set_defaults(func=_bench_http)

    p = benches.add_parser("load", help="K concurrent users against a running server (--url), bounded in time and "
                           "requests")
    add_dtype(p)
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (this machine only)")
    p.add_argument("--users", type=int, default=4, help="concurrent users, one request at a time each")
    p.add_argument("--duration", type=float, default=60.0, help="seconds at most")
    p.add_argument("--requests", type=int, default=200, help="requests at most, over all users")
    p.add_argument("--mix", default="chat=0.5,retrieve=0.4,ingest=0.1",
                   help="weights of the request kinds: chat (stored chunk text in the message), retrieve, ingest")
    p.add_argument("--pool", type=int, default=8, help="distinct questions (their chunks repeat across requests)")
    p.add_argument("--context", type=int, default=2,
                   help="chunks per question (stuffed into chat requests, retrieved for bare questions)")
    p.add_argument("--documents", type=int, default=24, help="generated notes ingested first, one chunk each")
    p.add_argument("--api-key", default=None, help="the server's API key (default $CACHECLIP_API_KEY)")
    p.add_argument("--admin-key", default=None, help="the server's admin key, for ingests (default $CACHECLIP_ADMIN_KEY)")
    p.add_argument("--no-seed", action="store_true", help="do not ingest the generated notes first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    _out_flags(p)
    p.set_defaults(func=_bench_load)

    p = benches.add_parser("qa", help="QA over given passages (CacheBlend's musique_s.json, LongBench's jsonl, or "
                                      "this project's jsonl): every mode on the same questions, paired, resumable")
    _qa_flags(p, data=None)
    p.set_defaults(func=_bench_qa)

    p = benches.add_parser("index", help="the chunk index at 10^4..10^6 vectors: build time, search p50/p99, "
                           "recall@k against flat, bytes an ingest writes")
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--kinds", nargs="+", choices=["flat", "ivf", "hnsw"], default=["flat", "ivf", "hnsw"])
    p.add_argument("--hnsw-max", type=int, default=100_000, help="largest size HNSW is built at")
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--ingest", type=int, default=1000, help="chunks ingested after the build (what they write)")
    p.add_argument("--nprobe", type=int, default=IndexConfigDefaults.nprobe)
    p.add_argument("--ef-search", type=int, default=IndexConfigDefaults.ef_search)
    p.add_argument("-v", "--verbose", action="store_true")
    add_dtype(p)
    _out_flags(p)
    p.set_defaults(func=_bench_index)

    p = benches.add_parser("store", help="each KV codec side by side: bytes a token, encode/decode time, needle "
                           "score and KL paired against bf16, TTFT from a folder and Redis, corpus size projected")
    _engine_flags(p)
    p.add_argument("--codecs", nargs="+", choices=codec_choices(), default=codec_choices())
    p.add_argument("--redis", default=None, metavar="URL", help="also time loading from this Redis (redis://host:port/0)")
    _mode_flags(p, "reuse cacheclip prophetkv")
    _suite_flags(p)
    p.add_argument("--fidelity-samples", type=int, default=2, help="samples per variant and length for KL (0: none)")
    p.add_argument("--answer-tokens", type=int, default=16, help="answer tokens the KL is read over")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="answer tokens generated (the multi-value needles need about 40)")
    p.add_argument("--runs", type=int, default=3, help="TTFT runs per codec, store and mode (0: no TTFT)")
    p.add_argument("--ttft-lengths", type=int, nargs="+", default=None, help="TTFT lengths (default: --lengths)")
    _out_flags(p)
    p.set_defaults(func=_bench_store)

    p = sub.add_parser("eval", help="QA from a file: `cacheclip bench qa`, on the shipped invented questions by default")
    _qa_flags(p, data=str(resources.files("cacheclip_rag") / "data" / "qa_invented.jsonl"))
    p.set_defaults(func=_bench_qa)


def _qa_flags(p, data: str | None) -> None:
    add_common(p, store_default=str(cache_dir() / "qa-store"))
    p.add_argument("--data", "--dataset", dest="data", default=data,
                   help="the QA file: CacheBlend's inputs/musique_s.json (github.com/YaoJiayi/CacheBlend), a LongBench "
                        "2wikimqa / hotpotqa / musique .jsonl, or {question, contexts, answers} lines")
    p.add_argument("--format", choices=list(QA_FORMATS), default="auto")
    p.add_argument("--prompt", choices=["dataset", "engine"], default="dataset",
                   help="dataset: the instruction of the dataset's own harness; engine: the engine's default prompt")
    p.add_argument("--score-layers", type=int, nargs="+", default=None, help="aux scoring layers (default: profile or last)")
    _mode_flags(p, " ".join(QA_MODES), "default 0.2, with --frontier 0.1 0.2 0.3 0.4")
    p.add_argument("--frontier", action="store_true", help="every mode over the ratios; each mode's F1 at the TTFT "
                   "budgets and the Pareto frontier")
    p.add_argument("--budget-ttft", type=float, nargs="+", default=QA_BUDGETS, help="TTFT / full budgets of the frontier")
    _versus_flag(p, "the cacheclip rows")
    p.add_argument("--offset", type=int, default=0, help="first question (0-based index in the file)")
    p.add_argument("--limit", type=int, default=None, help="at most N questions from --offset")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--question-first", nargs="?", const="Question: {question}\n\n", default="", metavar="TEMPLATE",
                   help="the question before the passages as well (PromptConfig.question_first; default template "
                        "'Question: {question}' and a blank line)")
    p.add_argument("--diagnose", action="store_true", help="where the answer is lost: each mode's KL from full "
                   "attention on full's own answer, the primary's attention its rows hold, the gold passages' recompute")
    p.add_argument("--indices", type=int, nargs="+", default=None, help="with --diagnose: these questions (0-based)")
    _results_flag(p)
    _from_flag(p, "other questions")
    _out_flags(p, "the frontier at the first budget")
