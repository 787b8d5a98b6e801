"""`cacheclip serve`: the OpenAI-compatible HTTP server and web page over one engine."""

from __future__ import annotations

import logging

from ..access import ADMIN_KEY_ENV, API_KEY_ENV, Keys, exposed_without_key
from ..request import DEFAULTS
from .common import add_common, engine_from_args

log = logging.getLogger("cacheclip_rag")


def cmd_serve(args) -> int:
    """The OpenAI-compatible HTTP server and web page over one engine (`cacheclip_rag.server`)."""
    from ..server import serve

    keys = Keys.from_env(args.api_key, args.admin_key)  # checked before the models load
    if exposed_without_key(args.host, keys):
        log.warning("serving on %s without an API key: anyone who can reach this address can ask%s; set --api-key "
                    "or $%s", args.host, "" if keys.admin else " and ingest documents", API_KEY_ENV)
    engine = engine_from_args(args)
    required = [name for name, key in (("API key", keys.api), ("admin key to ingest", keys.admin)) if key]
    guarded = f"; needs the {' and the '.join(required)}" if required else ""
    print(f"serving {engine.primary.lm.name} on http://{args.host}:{args.port}/ (OpenAI API under /v1; store "
          f"{args.store}{guarded})")
    serve(engine, host=args.host, port=args.port, max_active=args.max_active, max_waiting=args.max_waiting,
          default_max_tokens=args.max_tokens, keys=keys)
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
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every route but /health and the page (default "
                        f"${API_KEY_ENV}; none: no key needed, fine on 127.0.0.1 only)")
    p.add_argument("--admin-key", default=None, metavar="KEY",
                   help=f"a second key that alone may ingest documents (default ${ADMIN_KEY_ENV}); without it the "
                        "API key may ingest too")
    p.set_defaults(func=cmd_serve)
