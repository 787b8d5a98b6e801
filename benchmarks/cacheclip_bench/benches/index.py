"""`cacheclip bench index`: the chunk index at 10^4..10^6 vectors (synthetic clustered embeddings):
build time, search p50/p99, recall@k against flat, bytes an ingest writes."""

from __future__ import annotations

from cacheclip_rag import IndexConfig
from cacheclip_rag.analysis import add_dtype, describe_cpu

from .. import harness as h
from .. import index_bench

NAME = "index"
HELP = "the chunk index at 10^4..10^6 vectors: build time, search p50/p99, recall@k against flat, bytes an ingest writes"


def arguments(p) -> None:
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--kinds", nargs="+", choices=["flat", "ivf", "hnsw"], default=["flat", "ivf", "hnsw"])
    p.add_argument("--hnsw-max", type=int, default=100_000, help="largest size HNSW is built at")
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--ingest", type=int, default=1000, help="chunks ingested after the build (what they write)")
    p.add_argument("--nprobe", type=int, default=IndexConfig.nprobe)
    p.add_argument("--ef-search", type=int, default=IndexConfig.ef_search)
    p.add_argument("-v", "--verbose", action="store_true")
    add_dtype(p)
    h.out_flags(p)


def measure(args) -> h.Report:
    cfg = IndexConfig(nprobe=args.nprobe, ef_search=args.ef_search)
    rows = []
    for size in args.sizes:
        kinds = [k for k in args.kinds if k != "hnsw" or size <= args.hnsw_max]
        if len(kinds) < len(args.kinds):
            print(f"(hnsw left out at {size} vectors: building it takes too long on this machine; --hnsw-max)")
        rows += index_bench.measure(size, kinds, cfg, queries=args.queries, k=args.k, ingest=args.ingest)
        print(index_bench.table([r for r in rows if r.size == size]), flush=True)  # progress: each size as it ends
    note = (f"\nrecall@{args.k} against the flat index's exact top {args.k}; one query at a time; nprobe {args.nprobe}, "
            f"efSearch {args.ef_search}; 'written' is what an ingest of {args.ingest} chunks writes (a segment)")
    settings = {"cpu": describe_cpu(), "nprobe": args.nprobe, "ef_search": args.ef_search, "queries": args.queries}
    return h.Report([note, index_bench.table(rows)], json=lambda path: index_bench.write_json(rows, path, settings))
