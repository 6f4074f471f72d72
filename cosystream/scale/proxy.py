"""Middlewares for Ray Serve's HTTP proxy: a stream whose replica died ends with an `error` event, and a
request's prompt (its voice, or its uploaded recording) reaches the router.

When a replica dies mid-stream, Ray's proxy just stops: the response is left unfinished. For raw audio
that is the right ending (the client sees an incomplete transfer, never a short "complete" file), but an
event stream and a WebSocket promise an `error` event as their last message when synthesis fails after the
start (docs/server.md). This middleware, running in the proxy, watches each response and, when the app
behind it ended without finishing an event stream or closing a WebSocket, sends that event itself
(`replica_lost`, 503: retrying reaches a live replica) and ends the response properly; a WebSocket is closed
with 4503.

The router picks a replica before the request body is read, so it cannot see which prompt a request names.
`VoiceHint` reads it in the proxy (the body is there anyway) for every entry point: the `voice` of a JSON
/v1/tts or /v1/audio/speech, the uploaded `prompt_wav` (by the engine's digest of it and its transcript) or
`voice` of a form /v1/tts, and the `start` message (and the recording it announces) of the WebSocket, which it
accepts itself to read them. It passes that prompt key on as Ray's multiplexed model id, which the router sees
in the request's metadata (`EngineAwareRouter` prefers replicas holding that prompt); the request then goes on
unchanged.

The proxy also spares the replica work on the request's critical path: `VoiceHint` stamps the request's arrival
at the proxy (`PROXY_ARRIVAL_KEY`, wall clock) and hands the body it read along inside the ASGI scope
(`PROXY_BODY_KEY`, which Ray pickles with the scope), so the replica answers without first calling back into the
proxy for the body; `from_proxy` is the replica's side of both (the arrival becomes the request's server arrival,
so the server's stage times count the proxy's routing and transport too).

When every replica is known to be full (their load reports, as the router in this process holds them:
scale/load.py's `every_replica_full`), `VoiceHint` answers a synthesis request's refusal itself (503 `overloaded`
with Retry-After, the body a replica's admission sends) instead of sending it to a replica that would refuse it.

Ray loads them from the proxy's environment: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=
cosystream.scale.proxy:proxy_middlewares (`cosystream serve --replicas` sets it; on a cluster, set it where
`ray start` runs on each node). Plain ASGI: no Ray import.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cosystream.errors import error_code

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
            await _end_websocket(send)


VOICE_HINT_HEADER = b"serve_multiplexed_model_id"  # Ray's proxy copies it into the request's metadata
VOICE_HINT_PATHS = ("/v1/tts", "/v1/audio/speech")
WS_HINT_PATH = "/v1/tts/stream"
VOICE_HINT_MAX_BYTES = 64 * 1024  # JSON bodies read for their voice
UPLOAD_HINT_MAX_BYTES = 16 * 1024 * 1024  # multipart bodies read for their recording; larger ones go through unread
WS_FIRST_MESSAGE_WAIT_S = 10.0  # a WebSocket whose `start` takes longer is routed by load alone
PROXY_ARRIVAL_KEY = "cosystream.proxy_arrival"  # scope key: time.time() when the proxy received the request
PROXY_BODY_KEY = "cosystream.body"  # scope key: the whole request body, read by the proxy, replayed by the replica
CARRIED_BODY_MAX_BYTES = 1024 * 1024  # larger bodies travel as Ray does it: fetched by the replica from the proxy
OVERLOADED_CODE = "overloaded"  # what a replica's admission answers (server/errors.py), with Retry-After
OVERLOADED_MESSAGE = "overloaded: every replica is at its first-audio budget; retry later"
OVERLOADED_RETRY_AFTER_S = 1
UPLOAD_KEY_PREFIX = "upload:"  # scale/load.py's upload_key
_VOICE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
REQUEST_ID_HEADER = b"x-request-id"  # Ray's proxy takes a request's id from it (and returns it to the client)
LEDGER_WINDOW_S = 10.0  # how far back the ledger can tell a replica's streams started and ended
_refusal_checks: dict[Any, Callable[[], bool]] = {}  # see register_refusal_check
_retry_checks: dict[Any, Callable[[str], bool]] = {}  # see register_retry_check


class StreamLedger:
    """The synthesis streams this proxy sent to each replica and saw end, with times, so a router can tell
    whether a replica's load can have fallen since its last load report: started (when routed) minus ended (when
    the proxy forwards the stream's last message, before the client can send its next request) since then.
    Requests are known by the id Ray's proxy routes them under; `VoiceHint` expects them, the router records
    where they went. Safe from any thread."""

    def __init__(self, window_s: float = LEDGER_WINDOW_S, now: Callable[[], float] = time.time) -> None:
        self.window_s = window_s
        self.now = now
        self._lock = threading.Lock()
        self._expected: Counter[str] = Counter()  # synthesis requests not routed yet
        self._replica_of: dict[str, Any] = {}  # routed and not ended: request id -> replica
        self._events: dict[Any, deque[tuple[float, int]]] = {}  # replica -> (time, +1 routed / -1 ended)
        self._refused_by: dict[str, frozenset] = {}  # request id -> the replicas that refused it (while it is open)
        self._started = self.now()

    def expect(self, request_id: str) -> None:
        with self._lock:
            self._expected[request_id] += 1

    def routed(self, request_id: str, replica: Any) -> None:
        """The router sent `request_id` to `replica` (ignored unless it is an expected synthesis request)."""
        with self._lock:
            now = self.now()
            if request_id in self._replica_of:  # sent again elsewhere: it left the first replica
                self._event(self._replica_of.pop(request_id), now, -1)
            elif self._expected[request_id] <= 0:
                return
            else:
                self._discard_expected(request_id)
            self._replica_of[request_id] = replica
            self._event(replica, now, +1)

    def ended(self, request_id: str) -> None:
        with self._lock:
            replica = self._replica_of.pop(request_id, None)
            if replica is not None:
                self._event(replica, self.now(), -1)
            else:
                self._discard_expected(request_id)

    def refused(self, request_id: str) -> bool:
        """The replica `request_id` was routed to refused it (503 overloaded): it ended there, and that replica is
        remembered (`refused_by`) until `forget`. False when the request's replica is not known (never routed
        here): nothing is remembered."""
        with self._lock:
            replica = self._replica_of.pop(request_id, None)
            if replica is None:
                return False
            self._event(replica, self.now(), -1)
            self._refused_by[request_id] = self._refused_by.get(request_id, frozenset()) | {replica}
            return True

    def refused_by(self, request_id: str) -> frozenset:
        """The replicas that refused `request_id` so far (the router ranks them last for its next attempt)."""
        return self._refused_by.get(request_id, frozenset())

    def forget(self, request_id: str) -> None:
        """`request_id` is answered: drop what `refused` remembered of it."""
        with self._lock:
            self._refused_by.pop(request_id, None)

    def net_since(self, replica: Any, since: float) -> int | None:
        """Streams started minus ended on `replica` after `since` (this proxy's), or None when the ledger does
        not reach back that far. Read from the newest event back (events are kept in the order they happened),
        so a router asking about a recent report on every request reads only the events since it."""
        with self._lock:
            if since < max(self._started, self.now() - self.window_s):
                return None
            net = 0
            for t, delta in reversed(self._events.get(replica, ())):
                if t <= since:
                    break
                net += delta
            return net

    def _discard_expected(self, request_id: str) -> None:
        self._expected[request_id] -= 1
        if self._expected[request_id] <= 0:
            del self._expected[request_id]

    def _event(self, replica: Any, t: float, delta: int) -> None:
        events = self._events.setdefault(replica, deque())
        events.append((t, delta))
        while events and events[0][0] < t - self.window_s:
            events.popleft()


LEDGER = StreamLedger()  # the proxy's (one per process: routers and middleware of one proxy share it)


def register_refusal_check(key: Any, check: Callable[[], bool]) -> None:
    """A router in this process (scale/ray_app.py's EngineAwareRouter, keyed by its deployment; the latest per key
    counts) tells `VoiceHint` whether to refuse a new synthesis request here: check() is True when every replica
    would refuse it, and counts that refusal. Any thread may call it."""
    _refusal_checks[key] = check


def refused_here() -> bool:
    """Whether the one registered router says every replica is full (never with no router or several apps)."""
    checks = list(_refusal_checks.values())
    if len(checks) != 1:
        return False
    try:
        return checks[0]()
    except Exception:  # a router that cannot tell: the request goes to a replica, which decides
        return False


def register_retry_check(key: Any, check: Callable[[str], bool]) -> None:
    """A router in this process (keyed as in register_refusal_check) tells `VoiceHint` whether a request that a
    replica refused is worth sending once more: check(request_id) is True when a replica that has not refused it
    may admit it (and counts that retry). Any thread may call it."""
    _retry_checks[key] = check


def retry_here(request_id: str) -> bool:
    """Whether the one registered router would send a refused request to another replica (never with no router or
    several apps, as refused_here)."""
    checks = list(_retry_checks.values())
    if len(checks) != 1:
        return False
    try:
        return checks[0](request_id)
    except Exception:  # a router that cannot tell: the refusal goes to the client
        return False


def upload_hint(audio: bytes, prompt_text: str) -> str:
    """The prompt key of an uploaded recording: the engine's digest of it (engine/async_engine.py keys the
    analysed upload by the SHA-256 of the recording's bytes, a NUL and the transcript's UTF-8)."""
    digest = hashlib.sha256(audio)
    digest.update(b"\0" + prompt_text.encode())
    return UPLOAD_KEY_PREFIX + digest.hexdigest()


def prompt_hint(options: Any, upload: bytes | None = None) -> str | None:
    """The prompt key of a request's options (a JSON object or form fields): its uploaded recording's key, else
    its voice name, else None (no prompt, or a voice name the router never sees)."""
    if not isinstance(options, Mapping):
        return None
    if upload is not None:
        text = options.get("prompt_text", "")
        return upload_hint(upload, text) if isinstance(text, str) else None
    voice = options.get("voice")
    return voice if isinstance(voice, str) and _VOICE_NAME.fullmatch(voice) else None


class VoiceHint:
    """Passes each synthesis request's prompt to the router (see the module docstring): the `voice` of a JSON body
    (POST /v1/tts, /v1/audio/speech), the uploaded `prompt_wav` (its digest) or `voice` of a form /v1/tts,
    and the `voice` or uploaded recording of a WebSocket's `start` message."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        scope = {**scope, PROXY_ARRIVAL_KEY: time.time()}
        if scope["type"] == "websocket" and scope.get("path") == WS_HINT_PATH:
            return await self._websocket(scope, receive, send)
        kind = self._body_kind(scope)
        if kind is None:
            return await self.app(scope, receive, send)
        messages: list[Message] = []
        while True:  # the body, which the replica would fetch from this proxy anyway
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        if messages[-1]["type"] == "http.request" and refused_here():
            return await _refuse_overloaded(send)
        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        hint = _json_hint(body) if kind == "json" else await _form_hint(scope, body)
        scope = _hinted(scope, hint)
        if messages[-1]["type"] == "http.request" and len(body) <= CARRIED_BODY_MAX_BYTES:
            scope[PROXY_BODY_KEY] = body  # whole: the replica replays it instead of fetching it
        scope, request_id = _with_request_id(scope)
        try:
            if messages[-1]["type"] != "http.request":  # the client left before its body was whole: no second try
                return await self._attempt(scope, messages, receive, request_id, send)
            first = _RefusalCatcher(send, request_id)
            try:
                await self._attempt(scope, messages, receive, request_id, first.send, first)
            except BaseException:
                if first.refused:  # held back and never answered: it ended all the same
                    LEDGER.ended(request_id)
                else:  # a 503 cut short: what came of it is the client's
                    with contextlib.suppress(Exception):
                        await first.release()
                raise
            if not first.refused:
                return
            if not LEDGER.refused(request_id):  # routed by no router here: it ends as it is
                LEDGER.ended(request_id)
            elif retry_here(request_id):  # another replica may admit it: one more try, answered as it comes
                return await self._attempt(scope, messages, receive, request_id, send)
            await first.release()
        finally:
            LEDGER.forget(request_id)

    async def _attempt(self, scope: Scope, messages: list[Message], receive: Receive, request_id: str,
                       send: Send, catcher: _RefusalCatcher | None = None) -> None:
        """Send the request to the app behind (Ray's proxy, which routes it), its stream counted in the ledger
        until its last message, which the ledger sees before the client does (a refusal that `catcher` holds back
        is the caller's to count)."""
        LEDGER.expect(request_id)
        ended = False

        async def ledger_send(message: Message) -> None:
            nonlocal ended
            if not ended and message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
                if catcher is None or not catcher.holding:
                    LEDGER.ended(request_id)
            await send(message)

        try:
            await self.app(scope, _replay(messages, receive), ledger_send)
        finally:
            if not ended:
                LEDGER.ended(request_id)

    @staticmethod
    def _body_kind(scope: Scope) -> str | None:
        """'json' or 'form' for a request worth reading for its prompt, else None."""
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in VOICE_HINT_PATHS:
            return None
        headers = dict(scope.get("headers", []))
        length = headers.get(b"content-length", b"")
        if VOICE_HINT_HEADER in headers or not length.isdigit():
            return None
        content_type = headers.get(b"content-type", b"")
        if content_type.startswith(b"application/json") and int(length) <= VOICE_HINT_MAX_BYTES:
            return "json"
        is_form = content_type.startswith((b"multipart/form-data", b"application/x-www-form-urlencoded"))
        if is_form and scope["path"] == "/v1/tts" and int(length) <= UPLOAD_HINT_MAX_BYTES:
            return "form"
        return None

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Accept the client here, read its `start` (and the recording it announces), then let Ray's proxy route
        the session with that prompt: the replica's own accept is not sent again (the handshake is done, so it
        cannot name the replica), and a session the app behind left unclosed ends with an `error` event."""
        connect = await receive()
        if connect["type"] != "websocket.connect":
            return await self.app(scope, _replay([connect], receive), send)
        await send({"type": "websocket.accept"})
        client = _ReadAhead(receive, [connect])
        deadline = asyncio.get_running_loop().time() + WS_FIRST_MESSAGE_WAIT_S
        hint = None
        start = _ws_start(await client.next(deadline))
        if start is not None and start.get("prompt_wav") is True:
            recording = await client.next(deadline)
            upload = recording.get("bytes") if recording and recording["type"] == "websocket.receive" else None
            hint = prompt_hint(start, upload) if upload else None
        elif start is not None:
            hint = prompt_hint(start)

        closed = False
        scope, request_id = _with_request_id(_hinted(scope, hint))
        LEDGER.expect(request_id)

        async def after_accept(message: Message) -> None:
            nonlocal closed
            if message["type"] == "websocket.accept":
                return  # the client has its handshake already
            if message["type"] == "websocket.http.response.start":  # a refusal meant for the handshake
                closed = True
                message = {"type": "websocket.close", "code": 4000 + int(message.get("status", 500)) % 1000}
            elif message["type"] == "websocket.http.response.body":
                return
            elif message["type"] == "websocket.close":
                closed = True
            if closed:
                LEDGER.ended(request_id)  # before the client hears of it (again later: a no-op)
            await send(message)

        try:
            await self.app(scope, client.replay, after_accept)
        except Exception:
            pass  # ended below as a lost replica
        finally:
            client.close()
            LEDGER.ended(request_id)
        if not closed:
            await _end_websocket(send)


class _RefusalCatcher:
    """The `send` of a request's first attempt: a replica's refusal (503 `overloaded`: its admission would not meet
    the first-audio budget) is held back, so the proxy can send the request to another replica instead; every
    other response goes to the client as it comes. A refusal is a small JSON answer and a stream's response starts
    with 200, so holding 503s costs a stream nothing; `release` sends a held refusal on when no retry is made."""

    def __init__(self, send: Send, request_id: str) -> None:
        self._send = send
        self._request_id = request_id
        self._held: list[Message] = []
        self.refused = False

    @property
    def holding(self) -> bool:
        """Whether a 503 is held back (its last message, when it comes, is counted in the ledger by the caller)."""
        return bool(self._held)

    async def send(self, message: Message) -> None:
        if not self._held and message["type"] == "http.response.start" and message.get("status") == 503:
            self._held.append(message)
            return
        if not self._held or self.refused:
            return await self._send(message)
        self._held.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            body = b"".join(m.get("body", b"") for m in self._held if m["type"] == "http.response.body")
            self.refused = error_code(body) == OVERLOADED_CODE
            if not self.refused:  # another 503 (engine_dead, ...): the client's as it is
                LEDGER.ended(self._request_id)
                await self.release()

    async def release(self) -> None:
        held, self._held = self._held, []
        for message in held:
            await self._send(message)


class _ReadAhead:
    """A WebSocket client's messages read before routing, then handed to the app behind in order: what was read,
    then a read still pending when routing could wait no longer (nothing is lost), then the socket itself."""

    def __init__(self, receive: Receive, read: list[Message]) -> None:
        self.receive = receive
        self.read = list(read)
        self.pending: asyncio.Future | None = None

    async def next(self, deadline: float) -> Message | None:
        """The client's next message, or None when it does not come before `deadline` (loop time)."""
        if self.pending is None:
            self.pending = asyncio.ensure_future(self.receive())
        timeout_s = max(0.0, deadline - asyncio.get_running_loop().time())
        done, _ = await asyncio.wait({self.pending}, timeout=timeout_s)
        if not done:
            return None
        message, self.pending = self.pending.result(), None
        self.read.append(message)
        return message

    async def replay(self) -> Message:
        if self.read:
            return self.read.pop(0)
        if self.pending is not None:
            pending, self.pending = self.pending, None
            return await pending
        return await self.receive()

    def close(self) -> None:
        if self.pending is not None and not self.pending.done():
            self.pending.cancel()


def _hinted(scope: Scope, hint: str | None) -> Scope:
    if hint is None:
        return dict(scope)
    return {**scope, "headers": [*scope["headers"], (VOICE_HINT_HEADER, hint.encode())]}


def _with_request_id(scope: Scope) -> tuple[Scope, str]:
    """The scope with an X-Request-Id (the client's, else a new one, which Ray then uses), and that id."""
    for key, value in scope["headers"]:
        if key.lower() == REQUEST_ID_HEADER:
            return scope, value.decode("latin-1")
    request_id = uuid.uuid4().hex
    return {**scope, "headers": [*scope["headers"], (REQUEST_ID_HEADER, request_id.encode())]}, request_id


def from_proxy(scope: Scope, receive: Receive,
               now: Callable[[], float] = time.time) -> tuple[Scope, Receive, float | None]:
    """The replica's side of what `VoiceHint` carries: (scope, receive, seconds since the proxy received the
    request, or None when the request came another way). A carried body is the first message `receive` gives,
    and Ray's replica is spared its call back into the proxy for the request's messages (`skip_fetch`); without
    that call, or when a copy of the body still comes through it, `receive` skips the copies and passes the
    disconnect."""
    arrival = scope.get(PROXY_ARRIVAL_KEY)
    proxy_s = max(0.0, now() - arrival) if isinstance(arrival, (int, float)) else None  # 0: clocks of two hosts
    body = scope.get(PROXY_BODY_KEY)
    if not isinstance(body, bytes):
        return scope, receive, proxy_s
    scope = {k: v for k, v in scope.items() if k != PROXY_BODY_KEY}
    skip_fetch(receive)
    replayed = False

    async def receive_carried() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message

    return scope, receive_carried, proxy_s


RAY_FETCH_ATTR = "_receive_asgi_messages"  # Ray's ASGIReceiveProxy: the call into the proxy its background task makes


async def _no_messages(_request_metadata: Any) -> bytes:
    await asyncio.Event().wait()  # never: Ray cancels the waiting task when the request ends
    raise AssertionError("unreachable")


def skip_fetch(receive: Receive) -> bool:
    """Spare Ray's replica its call back into the proxy for a request whose whole body came with it: the receive Ray
    hands the replica starts, for every HTTP request, a background task that asks the proxy (a Ray actor call, and a
    look-up of the proxy actor by name) for the request's body and then its disconnect. The body is here already,
    and a client that leaves is seen by the proxy itself, which cancels the request on the replica (its response
    generator watches the client). The task has not run yet when the app is called (it is scheduled just before,
    on the same loop, and reads the call when it starts), so the call it makes becomes a wait until Ray cancels it
    at the request's end. True when it was spared; a receive of another shape (another Ray version, a test) is left
    as it is."""
    if not (hasattr(receive, "fetch_until_disconnect") and callable(getattr(receive, RAY_FETCH_ATTR, None))):
        return False
    setattr(receive, RAY_FETCH_ATTR, _no_messages)
    return True


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """`receive` that first hands out `messages` again, in order."""
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


def _json_hint(body: bytes) -> str | None:
    try:
        return prompt_hint(json.loads(body))
    except ValueError:  # not JSON: the app answers it
        return None


async def _form_hint(scope: Scope, body: bytes) -> str | None:
    """The prompt of a form /v1/tts (multipart or urlencoded): its `prompt_wav` file (with `prompt_text`) or its
    `voice` field."""
    from starlette.datastructures import UploadFile
    from starlette.requests import Request

    sent = False

    async def receive_body() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        async with Request(scope, receive_body).form(max_files=2, max_fields=64) as form:
            fields = {k: v for k, v in form.multi_items() if isinstance(v, str)}
            upload = form.get("prompt_wav")
            audio = await upload.read() if isinstance(upload, UploadFile) else None
            return prompt_hint(fields, audio or None)
    except Exception:  # a malformed form: the app answers it
        return None


def _ws_start(message: Message | None) -> dict[str, Any] | None:
    """The JSON object of a WebSocket `start` message, or None."""
    if message is None or message["type"] != "websocket.receive" or not message.get("text"):
        return None
    try:
        data = json.loads(message["text"])
    except ValueError:
        return None
    return data if isinstance(data, dict) and data.get("type") == "start" else None


async def _refuse_overloaded(send: Send) -> None:
    body = json.dumps({"error": {"code": OVERLOADED_CODE, "message": OVERLOADED_MESSAGE, "field": None}}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(OVERLOADED_RETRY_AFTER_S).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _end_websocket(send: Send) -> None:
    with contextlib.suppress(Exception):  # the client may be gone
        await send({"type": "websocket.send", "text": json.dumps(error_event())})
        await send({"type": "websocket.close", "code": 4000 + LOST_STATUS, "reason": LOST_CODE})


def proxy_middlewares() -> list[Middleware]:
    """What RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH names: the proxy's extra middlewares."""
    return [Middleware(VoiceHint), Middleware(StreamEndGuard)]
