"""`cacheclip serve`: the OpenAI-compatible HTTP server and web page over one engine."""

from __future__ import annotations

from ..request import DEFAULTS
from .common import add_common, engine_from_args


def cmd_serve(args) -> int:
    """The OpenAI-compatible HTTP server and web page over one engine (`cacheclip_rag.server`)."""
    from ..server import serve

    engine = engine_from_args(args)
    print(f"serving {engine.primary.lm.name} on http://{args.host}:{args.port}/ (OpenAI API under /v1; store {args.store})")
    serve(engine, host=args.host, port=args.port, max_active=args.max_active, max_waiting=args.max_waiting,
          default_max_tokens=args.max_tokens)
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, ...) and a web page at /")
    add_common(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-active", type=int, default=2, help="requests generating at once")
    p.add_argument("--max-waiting", type=int, default=8, help="requests queued beyond those; more get 503")
    p.add_argument("--max-tokens", type=int, default=DEFAULTS.max_new_tokens,
                   help="max_tokens of a request that gives none")
    p.set_defaults(func=cmd_serve)
