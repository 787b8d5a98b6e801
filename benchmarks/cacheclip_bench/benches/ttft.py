"""`cacheclip bench ttft`: every mode's TTFT on the same requests, alternated run by run (and
llama.cpp's full prefill as a peer)."""

from __future__ import annotations

import torch

from cacheclip_rag.analysis import attention_path, machine, progress_bar

from .. import cold, ttft
from .. import harness as h
from .. import peers as peer_lib

NAME = "ttft"
HELP = "time to first token of every mode on the same requests, alternated"


def arguments(p) -> None:
    h.timed_flags(p, "full reuse cacheclip")
    p.add_argument("--peer", action="append", choices=["llamacpp"], default=None,
                   help="a peer row, timed in the same alternation: llamacpp, llama.cpp's full prefill of the GGUF "
                        "the primary was converted from (optional `peers` extra)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--cold", action="store_true",
                   help="the first request after loading: per mode a fresh process, with and without warm_up, answers "
                        f"the request {cold.REPEATS} times; the first TTFT over the median of the rest")
    h.out_flags(p, "-breakdown, -ratio")


def measure(args) -> h.Report:
    if args.cold:
        return _cold(args)
    report = h.Report()
    engine = h.engine(args)
    peers = open_peers(args.peer or [], args.primary, max(args.lengths) + 512)
    try:
        modes = h.mode_list(args.modes or ["full", "reuse", "cacheclip"], args.ratios or [0.2])
        step = progress_bar(ttft.requests(args.lengths, modes, args.runs, peers), "ttft", "request")
        rows = ttft.run(engine, args.lengths, modes, runs=args.runs, max_new_tokens=args.max_new_tokens,
                        budget=args.budget, peers=peers, progress=step)
    finally:
        for peer in peers.values():
            if not isinstance(peer, str):
                peer.close()
    primary, aux = engine.primary.lm.device, engine.aux.lm.device
    overlap = engine.config.pipeline.overlaps(primary, aux)
    report.add(f"primary on {primary}, aux on {aux}: aux selection "
               f"{'overlapped with cache loading' if overlap else 'before cache loading'}; recompute attends with "
               f"{attention_path(engine.config.attention_backend, primary, engine.primary.lm.dtype)}")
    report.add(ttft.table(rows))
    stats = engine.store.stats
    report.add(f"store memory tier: {stats.memory_hits} hits, {stats.disk_hits} disk reads, {stats.misses} misses")
    report.json = lambda path: ttft.write_json(rows, path, machine())
    report.plot = lambda path: ttft.plot(rows, path)
    return report


def _cold(args) -> h.Report:
    modes = h.mode_list(args.modes or ["full", "reuse", "cacheclip"], args.ratios or [0.2])
    with h.engine(args) as engine:  # the requests go into the store once, before any fresh process
        for length in args.lengths:
            cold.prepare(engine, length)
    rows = cold.run(args, args.lengths, modes)
    return h.Report([cold.table(rows)], json=lambda path: cold.write_json(rows, path, machine()))


def open_peers(kinds: list[str], primary: str, n_ctx: int) -> dict:
    """name -> an open peer, or the reason it cannot run here (printed, and kept as its row's note)."""
    opened: dict = {}
    for kind in dict.fromkeys(kinds):
        try:
            peer = peer_lib.open_peer(kind, primary, torch.get_num_threads(), n_ctx)
            opened[peer.name] = peer
        except peer_lib.PeerUnavailable as why:
            print(f"peer {kind}: {why}")
            opened[kind] = str(why)
    return opened
