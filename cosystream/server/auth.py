"""Optional API-key authentication (bearer tokens) and CORS, both off by default (docs/reliability.md).

With keys configured every path except the exempt ones (by default the /health and /ready probes) needs
`Authorization: Bearer <key>`. Browsers cannot set headers on a WebSocket, so the WebSocket also accepts
the key as `?api_key=<key>`. A refused HTTP request gets 401 with the usual error body; a refused
WebSocket is accepted, sent an `error` event and closed with 4401, which browsers can read (a refused
handshake only shows as a failed connection).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from urllib.parse import parse_qsl

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from cosystream.server.errors import ApiError, record
from cosystream.server.protocol import ErrorEvent

log = logging.getLogger("cosystream.server")

WS_KEY_PARAM = "api_key"
CLOSE_UNAUTHORIZED = 4401
CORS_EXPOSED = ["X-Request-Id", "X-Sample-Rate", "Retry-After"]  # what browser code may read from a response


def key_id(key: str) -> str:
    """A stable, non-secret name for a key (per-client limits, logs): its SHA-256 prefix."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:12]


class AuthMiddleware:
    """Refuses HTTP requests and WebSockets without a configured API key; stamps the key's id on the rest."""

    def __init__(self, app: ASGIApp, api_keys: frozenset[str], exempt_paths: tuple[str, ...]) -> None:
        self.app = app
        self.keys = [key.encode() for key in api_keys]
        self.exempt_paths = frozenset(exempt_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in self.exempt_paths:
            return await self.app(scope, receive, send)
        key = self._presented_key(scope)
        if key is not None and self._is_valid(key):
            scope.setdefault("state", {})["client_id"] = key_id(key)
            return await self.app(scope, receive, send)
        message = "Authorization: missing bearer token" if key is None else "Authorization: unknown API key"
        error = ApiError(401, "unauthorized", message, field="Authorization")
        conn = HTTPConnection(scope)
        record(conn, error)
        conn.app.state.server.metrics.unauthorized.inc()
        if scope["type"] == "http":
            response = error.response()
            response.headers["WWW-Authenticate"] = "Bearer"
            return await response(scope, receive, send)
        await self._refuse_websocket(scope, receive, send, error)

    def _is_valid(self, key: str) -> bool:
        presented = key.encode()
        # compare against every key in constant time, so timing reveals neither which key nor how much matched
        return any([hmac.compare_digest(presented, known) for known in self.keys])

    @staticmethod
    def _presented_key(scope: Scope) -> str | None:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return token.strip() if scheme.lower() == "bearer" and token.strip() else None
        if scope["type"] == "websocket":
            query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
            return query.get(WS_KEY_PARAM) or None
        return None

    @staticmethod
    async def _refuse_websocket(scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
        ws = WebSocket(scope, receive, send)
        await ws.accept()
        await ws.send_json(ErrorEvent(**error.body()).model_dump())
        await ws.close(CLOSE_UNAUTHORIZED, reason=error.code)


def install_access(app: FastAPI, api_keys: frozenset[str], exempt_paths: tuple[str, ...],
                   cors_origins: tuple[str, ...]) -> None:
    """Add the auth and CORS middleware the settings ask for (CORS outermost, so preflights need no key)."""
    if api_keys:
        app.add_middleware(AuthMiddleware, api_keys=api_keys, exempt_paths=exempt_paths)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins),
                           allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "Accept"],
                           expose_headers=CORS_EXPOSED, max_age=600)
