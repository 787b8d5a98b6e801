"""Access control for the HTTP server: bearer keys, as vLLM's OpenAI-compatible server takes them.

Two keys, each optional:

- the API key lets a client ask (chat, completions, retrieval, the model list);
- the admin key also lets it write the corpus (ingest). Without an admin key, the API key
  writes too; with one, the API key is refused there (403), so a client that may ask cannot
  change what every other client's answers are drawn from.

With neither key nothing is checked (the default, for a server on 127.0.0.1). `/health` and the
page at `/` are always open: a load balancer probes the first, and the second is static HTML
that asks for the key itself and holds no data. Every other path needs
`Authorization: Bearer <key>` and gets a 401 in OpenAI's error format without it (a 403 for
a key that may not write). Keys are compared with `hmac.compare_digest` (constant time).
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

API_KEY_ENV = "CACHECLIP_API_KEY"
ADMIN_KEY_ENV = "CACHECLIP_ADMIN_KEY"
OPEN_PATHS = frozenset({"/health", "/"})
"""Paths answered without a key."""
WRITE_PREFIX = "/v1/documents"
"""Paths under it change the corpus (for every method but GET)."""
LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


@dataclass(frozen=True)
class Keys:
    """api: the key that may ask; admin: the key that may also write the corpus (None: no such key)."""

    api: str | None = None
    admin: str | None = None

    def __post_init__(self) -> None:
        for name in ("api", "admin"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str):
                raise ValueError(f"{name} key must be a string, got {type(value).__name__}")
            if not value or not value.isascii() or any(c.isspace() for c in value):
                raise ValueError(f"{name} key must be a non-empty ASCII string without spaces (it travels in an "
                                 f"HTTP header), got {len(value)} characters")
        if self.api is not None and self.api == self.admin:
            raise ValueError("the admin key must differ from the API key (else the API key could write the corpus)")

    @classmethod
    def from_env(cls, api: str | None = None, admin: str | None = None) -> Keys:
        """The given keys, else those in $CACHECLIP_API_KEY / $CACHECLIP_ADMIN_KEY (unset or empty: none)."""
        return cls(api or os.environ.get(API_KEY_ENV) or None, admin or os.environ.get(ADMIN_KEY_ENV) or None)

    @property
    def enabled(self) -> bool:
        return self.api is not None or self.admin is not None

    def verdict(self, method: str, path: str, authorization: str | None) -> tuple[int, str, str] | None:
        """None when the request may pass, else (status, error type, message)."""
        if not self.enabled or path in OPEN_PATHS:
            return None
        token = _bearer(authorization)
        is_admin, is_api = _same(token, self.admin), _same(token, self.api)
        if path.startswith(WRITE_PREFIX) and method != "GET":
            if is_admin or (self.admin is None and is_api):
                return None
            if is_api:
                return 403, "permission_error", ("this API key may ask but not write the corpus; ingesting documents "
                                                 "needs the admin key")
            return 401, "authentication_error", _missing(token, "writing the corpus needs the admin key" if self.admin
                                                         else "this server needs an API key")
        if self.api is None or is_api or is_admin:
            return None
        return 401, "authentication_error", _missing(token, "this server needs an API key")


def _bearer(authorization: str | None) -> bytes | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" and token.strip() else None


def _same(token: bytes | None, key: str | None) -> bool:
    return token is not None and key is not None and hmac.compare_digest(token, key.encode())


def _missing(token: bytes | None, what: str) -> str:
    if token is None:
        return f"{what}: send it as 'Authorization: Bearer <key>'"
    return f"{what}: the key given is not valid"


class RequireKeys:
    """ASGI middleware: every HTTP request passes `keys.verdict` first (streams are untouched)."""

    def __init__(self, app: ASGIApp, keys: Keys):
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.keys.enabled:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
            refused = self.keys.verdict(scope["method"], scope["path"], headers.get("authorization"))
            if refused is not None:
                status, kind, message = refused
                response = JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status,
                                        headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def exposed_without_key(host: str, keys: Keys) -> bool:
    """True when a server bound to `host` is reachable beyond this machine with no API key."""
    return host not in LOOPBACK and keys.api is None
