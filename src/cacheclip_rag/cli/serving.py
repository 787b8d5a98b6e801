"""`cacheclip serve`: the OpenAI-compatible HTTP server and web page over one engine."""

from __future__ import annotations

import logging

from ..request.options import DEFAULTS
from ..serving.access import ADMIN_KEY_ENV, API_KEY_ENV, Keys, exposed_without_key
from .common import add_common, engine_config, engine_from_args

log = logging.getLogger("cacheclip_rag")


def cmd_serve(args) -> int:
    """The OpenAI-compatible HTTP server and web page over one engine (`cacheclip_rag.serving.server`)."""
    from ..serving.server import serve

    keys = Keys.from_env(args.api_key, args.admin_key)  # checked before the models load
    if exposed_without_key(args.host, keys):
        log.warning("serving on %s without an API key: anyone who can reach this address can ask%s; set --api-key "
                    "or $%s", args.host, "" if keys.admin else " and ingest documents", API_KEY_ENV)
    if args.replicas is not None:
        return _serve_replicas(args, keys)
    if args.ray_address or args.router != "chunk-affinity":
        raise ValueError("--ray-address and --router apply to `serve --replicas N`")
    engine = engine_from_args(args)
    engine.warm_up()  # the first client's request must not pay the one-time work
    required = [name for name, key in (("API key", keys.api), ("admin key to ingest", keys.admin)) if key]
    guarded = f"; needs the {' and the '.join(required)}" if required else ""
    print(f"serving {engine.primary.lm.name} on http://{args.host}:{args.port}/ (OpenAI API under /v1; store "
          f"{args.store}{guarded})")
    serve(engine, host=args.host, port=args.port, max_active=args.max_active, max_waiting=args.max_waiting,
          default_max_tokens=args.max_tokens, keys=keys)
    return 0


def _serve_replicas(args, keys) -> int:
    """`serve --replicas N`: the same API and page on Ray Serve, N engine replicas on one store."""
    import os
    import signal

    from ..serving import replicas

    def stop(signum, frame):  # SIGTERM from a process manager, or SIGINT where a shell ignored it
        raise KeyboardInterrupt

    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.route_imbalance is not None and args.route_imbalance < 0:
        raise ValueError(f"--route-imbalance must be at least 0, got {args.route_imbalance}")
    threads = args.replica_threads or max(1, (os.cpu_count() or 1) // args.replicas)
    spec = replicas.ReplicaSpec(args.primary, args.aux, args.store, engine_config(args), threads=threads)
    nodes = replicas.start(args.ray_address, args.host, args.port)
    for sig in (signal.SIGTERM, signal.SIGINT):  # after Ray's start, which installs its own
        signal.signal(sig, stop)
    try:
        replicas.check_store(args.store, nodes)
        print(f"serving {args.primary} on http://{args.host}:{args.port}/ with {args.replicas} engine replicas on Ray "
              f"Serve ({nodes} node{'s' if nodes > 1 else ''}, {args.router} routing, {threads} threads each; store "
              f"{args.store})")
        replicas.run(spec, args.replicas, blocking=True, router=args.router, keys=keys, max_active=args.max_active,
                     max_waiting=args.max_waiting, default_max_tokens=args.max_tokens, imbalance=args.route_imbalance)
    except KeyboardInterrupt:
        pass
    finally:
        replicas.shutdown()
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, ...) and a web page at /")
    add_common(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-active", type=int, default=2, help="requests generating at once (per replica)")
    p.add_argument("--max-waiting", type=int, default=8, help="requests queued beyond those; more get 503")
    p.add_argument("--max-tokens", type=int, default=DEFAULTS.max_new_tokens,
                   help="max_tokens of a request that gives none")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every route but /health and the page (default "
                        f"${API_KEY_ENV}; none: no key needed, fine on 127.0.0.1 only)")
    p.add_argument("--memory-mb", type=float, default=None, metavar="MB",
                   help="the memory tier of chunk caches per engine (default 512 MB)")
    p.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="run N engine replicas on Ray Serve behind one ingress (same API and page); the store "
                        "should be redis://... (a folder works on one machine only)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --replicas: join this Ray cluster (else a local Ray instance starts on 127.0.0.1)")
    p.add_argument("--router", default="chunk-affinity", choices=["chunk-affinity", "default"],
                   help="with --replicas: send a request to the replica holding its chunks in memory "
                        "(chunk-affinity), or Ray Serve's default power-of-two-choices router")
    p.add_argument("--route-imbalance", type=int, default=None, metavar="K",
                   help="with chunk-affinity routing: a request waits for the replica holding its chunks unless the "
                        "replicas' running requests differ by more than K (default 0: affinity among equally loaded "
                        "replicas only, no waiting; 2 kept twice the memory hits on 2 CPU replicas, at a longer tail)")
    p.add_argument("--replica-threads", type=int, default=None, metavar="T",
                   help="with --replicas: torch threads (and Ray CPUs) per replica; default cores / N")
    p.add_argument("--admin-key", default=None, metavar="KEY",
                   help=f"a second key that alone may ingest documents (default ${ADMIN_KEY_ENV}); without it the "
                        "API key may ingest too")
    p.set_defaults(func=cmd_serve)
