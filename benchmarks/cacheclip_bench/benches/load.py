"""`cacheclip bench load`: K concurrent users against a running server, bounded in time and
requests; the table, and JSON with every request's outcome."""

from __future__ import annotations

import asyncio

from cacheclip_rag.analysis import Keys, add_dtype, progress_bar

from .. import harness as h
from .. import load

NAME = "load"
HELP = "K concurrent users against a running server (--url), bounded in time and requests"


def arguments(p) -> None:
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
    h.out_flags(p)


def measure(args) -> h.Report:
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
    return h.Report([load.table(report)], json=lambda path: load.write_json(report, path))
