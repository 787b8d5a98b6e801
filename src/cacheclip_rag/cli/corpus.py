"""`cacheclip ingest`, `ask` and `demo`: put documents in a store and ask it."""

from __future__ import annotations

import json
import time

from ..config import ChunkConfig
from ..hardware import describe as describe_cpu
from ..paths import cache_dir
from ..request import selector as registry
from ..request.options import DEFAULTS
from .common import (
    add_common,
    add_request_options,
    engine_from_args,
    fmt_timings,
    read_documents,
    request_options,
)
from .demo import demo_documents, demo_long_documents, demo_questions


def cmd_ingest(args) -> int:
    engine = engine_from_args(args, ChunkConfig(chunk_tokens=args.chunk_tokens, overlap_tokens=args.overlap_tokens))
    ids = engine.ingest(read_documents(args.files), progress=not args.quiet, packets=args.packets, lazy=args.lazy)
    print(f"ingested {len(ids)} chunks ({len(set(ids))} distinct) into {args.store}")
    return 0


def cmd_ask(args) -> int:
    engine = engine_from_args(args)
    kwargs = dict(k=args.k, **request_options(args))
    ids = args.chunk_ids.split(",") if args.chunk_ids else None
    stream = engine.stream(args.question, chunk_ids=ids, **kwargs)
    for _ in stream:
        pass
    answer = stream.answer
    if args.show_selection:
        from . import selection_html as html

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
    print(f"{answer.mode} (ratio {answer.recompute_ratio}, effective {100 * answer.effective_fraction:.1f}%): {fmt_timings(answer.timings)}")
    if "full" in result:
        print(f"full-mode TTFT on the same request: {result['full']['ttft']:.3f}s")
    return 0


def cmd_demo(args) -> int:
    short, long, questions = demo_documents(), demo_long_documents(), demo_questions()
    args.store = args.store or str(cache_dir() / "demo-store")
    engine = engine_from_args(args, ChunkConfig(chunk_tokens=args.chunk_tokens, overlap_tokens=16))
    start = time.perf_counter()
    short_ids, long_ids = engine.ingest(short, progress=True), engine.ingest(long, progress=True)
    everything = list(dict.fromkeys(short_ids + long_ids))
    print(f"{describe_cpu()}; models compute in {str(engine.primary.lm.dtype).removeprefix('torch.')}")
    print(f"corpus: {len(short) + len(long)} documents -> {len(everything)} chunks, ingested in "
          f"{time.perf_counter() - start:.1f}s (store {args.store})")
    print(f"warm-up: {engine.warm_up():.1f}s, untimed (what a first request would pay once: threads, kernels, the "
          "weights' first touch)\n")
    for q in questions:
        whole = q.get("context") == "all"
        chunk_ids = everything if whole else _retrieved_among(engine, q["question"], set(short_ids))
        answer = engine.answer(q["question"], chunk_ids=chunk_ids, mode=args.mode, recompute_ratio=args.ratio,
                               max_new_tokens=48)
        full = engine.answer(q["question"], chunk_ids=answer.chunk_ids, mode="full", max_new_tokens=48)
        found = _found(q["answers"], answer.text)
        where = "every chunk of the demo" if whole else "retrieved chunks"
        print(f"Q ({q.get('hops', 1)}-chunk; {answer.context_tokens} context tokens, {where}): {q['question']}")
        print(f"A: {answer.text}")
        print(f"   expected {q['answers']} -> {'found' if found else 'NOT found'}; full mode said: {full.text}")
        if not found and _found(q["answers"], full.text):
            print(f"   {_ratio_needed(engine, q, answer.chunk_ids, args.mode, args.ratio)}")
        if not whole:
            sources = [engine.store.get_chunk(cid).source for cid in answer.chunk_ids]
            print(f"   chunks: {', '.join(f'{c} ({s})' for c, s in zip(answer.chunk_ids, sources))}")
        print(f"   {args.mode} ratio {args.ratio} (effective {100 * answer.effective_fraction:.1f}%): {fmt_timings(answer.timings)}")
        print(f"   full-mode TTFT {full.timings['ttft']:.3f}s -> {args.mode} TTFT is "
              f"{answer.timings['ttft'] / full.timings['ttft']:.2f}x of full\n")
    return 0


def _retrieved_among(engine, question: str, pool: set[str]) -> list[str]:
    """The engine's top-k chunks for `question` among `pool` (the short corpus: its questions are
    retrieved over it alone, as before the long documents joined the demo's store)."""
    ranked = engine.retrieve(question, k=len(engine.store.chunk_ids()))
    return [cid for cid, _ in ranked if cid in pool][:engine.config.top_k]


def _found(answers: list[str], text: str) -> bool:
    return all(a.lower() in text.lower() for a in answers)


def _ratio_needed(engine, q: dict, chunk_ids: list[str], mode: str, ratio: float) -> str:
    """For a demo question full attention answers and `mode` at `ratio` does not: the
    smallest of a few higher ratios at which it does, measured on the same request."""
    for higher in (0.3, 0.4, 0.5, 0.6, 0.8):
        if higher <= ratio:
            continue
        again = engine.answer(q["question"], chunk_ids=chunk_ids, mode=mode, recompute_ratio=higher, max_new_tokens=48)
        if _found(q["answers"], again.text):
            return (f"measured: at ratio {ratio} the reused caches are not repaired enough for this question; "
                    f"at {higher} (effective {100 * again.effective_fraction:.1f}%) {mode} answers it: {again.text}")
    return f"measured: {mode} does not answer it at ratios up to 0.8; full attention does"


def add_commands(sub) -> None:
    p = sub.add_parser("ingest", help="chunk, cache and index documents (.txt files or .jsonl with 'text')")
    add_common(p)
    p.add_argument("files", nargs="+")
    p.add_argument("--chunk-tokens", type=int, default=ChunkConfig().chunk_tokens)
    p.add_argument("--overlap-tokens", type=int, default=ChunkConfig().overlap_tokens)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--packets", action="store_true", help="also build the KV Packet caches now (else on first use)")
    p.add_argument("--lazy", action="store_true",
                   help="store and index the chunks without encoding their caches: each is encoded on first use")
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("ask", help="answer a question from the store")
    add_common(p)
    p.add_argument("question")
    add_request_options(p, registry.modes())
    p.add_argument("-k", type=int, default=None, help="chunks to retrieve")
    p.add_argument("--chunk-ids", default=None, help="comma-separated chunk ids (bypasses retrieval)")
    p.add_argument("--compare-full", action="store_true", help="also run full mode and report its TTFT")
    p.add_argument("--show-selection", default=None, metavar="HTML", help="write the context with recomputed tokens and aux scores")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("demo", help="ingest the shipped corpus and answer its questions")
    add_common(p, store_default=None)
    p.add_argument("--mode", choices=registry.modes(), default="cacheclip", help="the method the demo compares with full")
    p.add_argument("--ratio", type=float, default=DEFAULTS.recompute_ratio)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.set_defaults(func=cmd_demo)
