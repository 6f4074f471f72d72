"""Middlewares for Ray Serve's HTTP proxy: a stream whose replica died ends with an `error` event, and a
request's voice reaches the router.

When a replica dies mid-stream, Ray's proxy just stops: the response is left unfinished. For raw audio
that is the right ending (the client sees an incomplete transfer, never a short "complete" file), but an
event stream and a WebSocket promise an `error` event as their last message when synthesis fails after the
start (docs/server.md). This middleware, running in the proxy, watches each response and, when the app
behind it ended without finishing an event stream or closing a WebSocket, sends that event itself
(`replica_lost`, 503: retrying reaches a live replica) and ends the response properly; a WebSocket is closed
with 4503.

The router picks a replica before the request body is read, so it cannot see which voice a request names.
`VoiceHint` reads small JSON bodies of the synthesis endpoints in the proxy (they are read there anyway),
and passes their `voice` on as Ray's multiplexed model id, which the router sees in the request's metadata
(`EngineAwareRouter` prefers replicas holding that voice); the body then goes on unchanged.

Ray loads them from the proxy's environment: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=
cosystream.scale.proxy:proxy_middlewares (`cosystream serve --replicas` sets it; on a cluster, set it where
`ray start` runs on each node). Plain ASGI: no Ray import.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK_PATH = "cosystream.scale.proxy:proxy_middlewares"
LOST_STATUS = 503
LOST_CODE = "replica_lost"
LOST_MESSAGE = "the server replica streaming this response stopped; retry the request"
_EVENT_FORMATS = {"text/event-stream": "sse", "application/x-ndjson": "ndjson"}


def error_event() -> dict[str, Any]:
    """The `error` event of docs/server.md (protocol.ErrorEvent's shape)."""
    return {"type": "error", "error": {"code": LOST_CODE, "message": LOST_MESSAGE, "field": None}}


def _event_format(message: Message) -> str | None:
    for key, value in message.get("headers", []):
        if key.lower() == b"content-type":
            return _EVENT_FORMATS.get(value.decode("latin-1").split(";")[0].strip().lower())
    return None


class StreamEndGuard:
    """Ends an event stream or WebSocket that the app behind left unfinished with an `error` event."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            return await self._http(scope, receive, send)
        if scope["type"] == "websocket":
            return await self._websocket(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        seen: dict[str, Any] = {"format": None, "started": False, "finished": False}

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["started"], seen["format"] = True, _event_format(message)
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                seen["finished"] = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            if not (seen["started"] and not seen["finished"] and seen["format"]):
                raise  # raw audio stays cut off; before the start the proxy's own error handling applies
        if seen["started"] and not seen["finished"] and seen["format"]:
            line = json.dumps(error_event(), separators=(",", ":"))
            frame = f"data: {line}\n\n" if seen["format"] == "sse" else line + "\n"
            with contextlib.suppress(Exception):  # the client may be gone
                await send({"type": "http.response.body", "body": frame.encode(), "more_body": False})

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        seen = {"accepted": False, "closed": False}

        async def watched(message: Message) -> None:
            if message["type"] == "websocket.accept":
                seen["accepted"] = True
            elif message["type"] == "websocket.close":
                seen["closed"] = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            if not (seen["accepted"] and not seen["closed"]):
                raise
        if seen["accepted"] and not seen["closed"]:
            with contextlib.suppress(Exception):
                await send({"type": "websocket.send", "text": json.dumps(error_event())})
                await send({"type": "websocket.close", "code": 4000 + LOST_STATUS, "reason": LOST_CODE})


VOICE_HINT_HEADER = b"serve_multiplexed_model_id"  # Ray's proxy copies it into the request's metadata
VOICE_HINT_PATHS = ("/v1/tts", "/v1/audio/speech")
VOICE_HINT_MAX_BYTES = 64 * 1024  # larger bodies (uploads) go through unread
_VOICE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class VoiceHint:
    """Passes the `voice` of a small JSON synthesis request to the router (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._worth_reading(scope):
            return await self.app(scope, receive, send)
        messages: list[Message] = []
        while True:  # the body, which the replica would fetch from this proxy anyway
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        voice = _voice_of(b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request"))
        if voice is not None:
            scope = {**scope, "headers": [*scope["headers"], (VOICE_HINT_HEADER, voice.encode())]}

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    @staticmethod
    def _worth_reading(scope: Scope) -> bool:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in VOICE_HINT_PATHS:
            return False
        headers = dict(scope.get("headers", []))
        if VOICE_HINT_HEADER in headers or not headers.get(b"content-type", b"").startswith(b"application/json"):
            return False
        length = headers.get(b"content-length", b"")
        return length.isdigit() and int(length) <= VOICE_HINT_MAX_BYTES


def _voice_of(body: bytes) -> str | None:
    try:
        voice = json.loads(body).get("voice")
    except (ValueError, AttributeError):  # not JSON, or not an object: the app answers it
        return None
    return voice if isinstance(voice, str) and _VOICE_NAME.fullmatch(voice) else None


def proxy_middlewares() -> list[Middleware]:
    """What RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH names: the proxy's extra middlewares."""
    return [Middleware(VoiceHint), Middleware(StreamEndGuard)]
