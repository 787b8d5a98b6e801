"""`cacheclip bench store`: every KV codec side by side in one run: bytes a token, encode/decode
time, needle score and KL paired against bf16, TTFT from a folder and Redis, corpus size projected."""

from __future__ import annotations

from pathlib import Path

from cacheclip_rag import ChunkConfig
from cacheclip_rag.analysis import (
    codec_names,
    describe_cpu,
    engine_config,
    progress_bar,
)

from .. import fidelity, needle
from .. import harness as h
from .. import store_bench as sb
from ..suite import Suite

NAME = "store"
HELP = ("each KV codec side by side: bytes a token, encode/decode time, needle score and KL paired against bf16, "
        "TTFT from a folder and Redis, corpus size projected")


def arguments(p) -> None:
    h.engine_flags(p)
    p.add_argument("--codecs", nargs="+", choices=codec_names(), default=codec_names())
    p.add_argument("--redis", default=None, metavar="URL", help="also time loading from this Redis (redis://host:port/0)")
    h.mode_flags(p, "reuse cacheclip prophetkv")
    h.suite_flags(p)
    p.add_argument("--fidelity-samples", type=int, default=2, help="samples per variant and length for KL (0: none)")
    p.add_argument("--answer-tokens", type=int, default=16, help="answer tokens the KL is read over")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="answer tokens generated (the multi-value needles need about 40)")
    p.add_argument("--runs", type=int, default=3, help="TTFT runs per codec, store and mode (0: no TTFT)")
    p.add_argument("--ttft-lengths", type=int, nargs="+", default=None, help="TTFT lengths (default: --lengths)")
    h.out_flags(p)


def measure(args) -> h.Report:
    names = args.codecs
    if "bf16" not in names:
        raise ValueError(f"bench store pairs every codec with bf16: include it in --codecs (got {names})")
    probe = h.engine(args)
    primary, aux = probe.primary.lm, probe.aux.lm
    probe.close()
    cfg = engine_config(args, ChunkConfig(chunk_tokens=args.chunk_tokens, overlap_tokens=0))
    engines = sb.open_engines(primary, aux, Path(args.store) / "codecs", names, cfg, args.redis)
    bench = sb.StoreBench()
    modes = h.mode_list(args.modes or ["reuse", "cacheclip", "prophetkv"], args.ratios or [0.2])
    suite = Suite.from_args(args)
    try:
        for codec in names:
            engine = engines[(codec, "file")]
            step = progress_bar(len(suite), f"needle {codec}", "sample")
            bench.needle[codec] = needle.run(engine, modes, suite, max_new_tokens=args.max_new_tokens, progress=step,
                                             budget="keep")
            if args.fidelity_samples:
                forced = Suite.from_args(args, samples=args.fidelity_samples)
                step = progress_bar(len(forced), f"fidelity {codec}", "sample")
                bench.fidelity[codec] = fidelity.run(engine, [m for m in modes if m[0] != "full"], forced,
                                                     answer_tokens=args.answer_tokens, budget="keep", progress=step)
            bench.costs.append(sb.codec_cost(engine, codec, sb.first_chunk(engine)))
        if args.runs:
            timed = [m for m in modes if m[0] != "reuse"]
            step = progress_bar(len(args.lengths) * args.runs * len(engines) * (len(timed) + 1), "ttft", "request")
            bench.ttft = sb.ttft_rows(engines, args.ttft_lengths or args.lengths, needle.with_full(timed),
                                      args.runs, progress=step)
    finally:
        sb.clear(engines)
    settings = {"cpu": describe_cpu(), "args": {k: v for k, v in vars(args).items() if k != "func"}}
    return h.Report(_tables(bench, names, primary, aux), json=lambda path: sb.write_json(bench, settings, path))


def _tables(bench: sb.StoreBench, names: list[str], primary, aux) -> list[str]:
    out = ["\nBytes a token as stored (primary + aux at the aux depth kept), encode/decode of one layer's K and V "
           f"of a {sb.CHUNK_TOKENS}-token chunk:", sb.cost_table(bench.costs)]
    for codec in names:
        out += [f"\nNeedle suite, codec {codec} (budget keep):", needle.table(needle.summarize(bench.needle[codec]))]
    out += ["\nNeedle score, codec - bf16 on the same samples (points; 95% bootstrap interval):",
            sb.paired_table(sb.paired_vs_bf16(bench.needle, "score"), 100, 1)]
    if bench.fidelity:
        for codec in names:
            out += [f"\nFidelity, codec {codec}:", fidelity.table(fidelity.summarize(bench.fidelity[codec]))]
        out += ["\nKL(full || mode), codec - bf16 on the same samples:",
                sb.paired_table(sb.paired_vs_bf16(bench.fidelity, "kl"), 1, 4)]
    if bench.ttft:
        out += ["\nTTFT, codecs and stores alternated run by run, cold (medians):", sb.ttft_table(bench.ttft)]
    out += [f"\nA corpus of N chunks of {sb.CHUNK_TOKENS} tokens (peer primaries: their published shapes at this "
            "codec's measured primary ratio, with this aux):", sb.projection_table(sb.projection(bench.costs, primary, aux))]
    return out
