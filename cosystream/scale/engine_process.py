"""A replica's engine in a process of its own: the replica keeps Ray's request path, the child runs the server.

Ray Serve's request path (its gRPC stream, request bookkeeping, pickling every chunk) runs in the replica's process.
With the engine in that process too, every millisecond of it is GIL time the engine's threads wait for while they
drive the GPU (docs/scaling.md, "Where the capacity goes"). So the replica starts a child process that builds the
engine and the unchanged FastAPI app of one server (server/app.py), listening on a Unix socket, and forwards every
HTTP request and WebSocket to it; the child's GIL belongs to the engine and its own server alone, as in
`cosystream serve`.

Between the two, over the socket:

* what the replica knows of a request travels as headers the child takes off again (INTERNAL_HEADERS): the
  arrival the proxy stamped (its age, since the two processes' clocks are compared by difference only), the
  proxy's share of it, the request id Ray's proxy gave it, the client's address;
* the child's answers that are the replica's business come back as headers on the response start: a voice it
  registered or deleted (VOICE_CHANGED_HEADER: the replica tells every replica before the client hears of it),
  and a route that answers for the whole application (CLUSTER_HEADER: /metrics, /ready, /v1/requests/{id},
  /v1/replicas), which the child checked (API key, readiness) and the replica answers from every replica;
* the replica's own questions (its load report, health, metrics, a finished request, a voice to reload) go to
  routes under INTERNAL_PREFIX, which the replica never forwards from outside.

The child exits when the replica does: it reads its stdin, a pipe from the replica, until end of file.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import aiohttp
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("cosystream.server")

INTERNAL_PREFIX = "/_cosystream_replica"
ARRIVAL_AGE_HEADER = b"x-cosystream-arrival-age"  # seconds from the request's arrival to its forwarding
PROXY_WAIT_HEADER = b"x-cosystream-proxy-s"  # of that, the proxy's share
REQUEST_ID_HEADER = b"x-cosystream-request-id"  # the id the request keeps (Ray proxy's x-request-id)
CLIENT_HEADER = b"x-cosystream-client"  # host:port of the client, as the replica saw it
VOICE_CHANGED_HEADER = b"x-cosystream-voice-changed"  # a voice name (percent-encoded) the request changed
CLUSTER_HEADER = b"x-cosystream-cluster"  # the application-wide route the replica answers
INTERNAL_HEADERS = frozenset({ARRIVAL_AGE_HEADER, PROXY_WAIT_HEADER, REQUEST_ID_HEADER, CLIENT_HEADER,
                              VOICE_CHANGED_HEADER, CLUSTER_HEADER})
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"host",
                        b"proxy-connection", b"content-length"})  # of a request (the client sets its own)
RESPONSE_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding"})
PRELOADED_VOICES = 256  # a starting engine loads the prompts of the most recently changed voices
READY_TIMEOUT_S = 1800.0
MAX_START_ERROR_BYTES = 4096  # loading and warming up a model (CUDA graph capture) on a cold machine
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ChildArgs:
    """What the child needs, sent pickled on its stdin."""

    spec: Any  # ray_app.ReplicaSpec
    replica_id: str
    device: str
    socket_path: str
    ready_fd: int
    ray_address: str | None = None  # the cluster's, for the voice store actor (spec.voice_store == "actor")


# ---------------------------------------------------------------- the child

_voice_changes: ContextVar[list[str] | None] = ContextVar("voice_changes", default=None)


class _VoiceNotingEngine:
    """The engine as the child's app sees it, except that a voice registered or deleted (or a deletion tried) is
    noted for the request's response, which tells the replica (VOICE_CHANGED_HEADER)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def add_voice(self, name: str, audio: Any, prompt_text: str) -> Any:
        info = await self._engine.add_voice(name, audio, prompt_text)
        _note_voice_change(name)
        return info

    async def delete_voice(self, name: str) -> None:
        try:
            await self._engine.delete_voice(name)
        finally:
            _note_voice_change(name)  # also after a failed delete: another replica may have removed it


def _note_voice_change(name: str) -> None:
    changes = _voice_changes.get()
    if changes is not None:
        changes.append(name)


class FromReplica:
    """The child's outermost ASGI layer: takes what the replica sent along off the request (INTERNAL_HEADERS)
    and puts it where the app reads it, and puts the voices a request changed on its response start."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        from cosystream.server.session import proxy_wait_s, request_id_override

        sent = {k: v.decode("latin-1") for k, v in scope["headers"] if k in INTERNAL_HEADERS}  # bytes keys
        scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k not in INTERNAL_HEADERS]}
        age = _float(sent.get(ARRIVAL_AGE_HEADER))
        if age is not None:
            scope["state"] = {**scope.get("state", {}), "t_arrival": time.perf_counter() - age}
        host, _, port = sent.get(CLIENT_HEADER, "").rpartition(":")
        if host and port.isdigit():
            scope["client"] = (host, int(port))
        changes: list[str] = []

        async def noting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and changes:
                headers = [*message.get("headers", []), *((VOICE_CHANGED_HEADER, quote(n).encode()) for n in changes)]
                message = {**message, "headers": headers}
            await send(message)

        tokens = (request_id_override.set(sent.get(REQUEST_ID_HEADER) or None),
                  proxy_wait_s.set(_float(sent.get(PROXY_WAIT_HEADER))), _voice_changes.set(changes))
        try:
            await self.app(scope, receive, noting_send)
        finally:
            _voice_changes.reset(tokens[2])
            proxy_wait_s.reset(tokens[1])
            request_id_override.reset(tokens[0])


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


INTERNAL_ROUTES = ("report", "health", "metrics", "finished", "voice_changed")


def build_child_app(engine: Any, args: ChildArgs) -> ASGIApp:
    """The server app of one replica's engine, with the routes the replica asks through (INTERNAL_PREFIX) and
    the application-wide routes it answers itself (CLUSTER_HEADER)."""
    from cosystream.server.app import build_app

    internal = tuple(f"{INTERNAL_PREFIX}/{name}" for name in INTERNAL_ROUTES)
    settings = dataclasses.replace(args.spec.settings, warmup=False,  # warmed up before the socket answers
                                   auth_exempt_paths=args.spec.settings.auth_exempt_paths + internal)
    app = build_app(_VoiceNotingEngine(engine), settings)
    _add_internal_routes(app, engine, args.spec.health_timeout_s)
    _add_cluster_routes(app)
    return FromReplica(app)


def _add_internal_routes(app: Any, engine: Any, health_timeout_s: float) -> None:
    """The replica's questions: its load report, health, this engine's metrics, a finished request's record, a
    voice to drop and reload."""
    from fastapi.responses import JSONResponse, Response

    from cosystream.scale.load import held_voice_names, report_from_server, upload_key
    from cosystream.server.metrics import CONTENT_TYPE
    from cosystream.server.openai_speech import OPENAI_VOICES

    state = app.state.server

    async def report() -> JSONResponse:
        settings = state.settings
        voices = held_voice_names(engine.cached_voices(), settings.voice_aliases, settings.default_voice,
                                  sorted(OPENAI_VOICES))
        cached_uploads = getattr(engine, "cached_uploads", list)
        return JSONResponse(report_from_server(state, voices, [upload_key(d) for d in cached_uploads()]).as_dict())

    async def health() -> JSONResponse:
        state.check_alive()
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(loop.run_in_executor(
            None, lambda: engine.core.call(_noop, timeout_s=health_timeout_s)), health_timeout_s)
        return JSONResponse({"pid": os.getpid()})

    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    async def finished(request_id: str) -> JSONResponse:
        record = state.finished.get(request_id)
        return JSONResponse(None if record is None else record.model_dump(mode="json"))

    async def voice_changed(name: str) -> JSONResponse:
        await engine.drop_cached_voice(name)
        await asyncio.get_running_loop().run_in_executor(engine.pool, _load_voice, engine, name)
        return JSONResponse({"pid": os.getpid()})

    handlers = {"report": report, "health": health, "metrics": metrics, "finished": finished,
                "voice_changed": voice_changed}
    for name in INTERNAL_ROUTES:
        app.add_api_route(f"{INTERNAL_PREFIX}/{name}", handlers[name],
                          methods=["POST" if name == "voice_changed" else "GET"], include_in_schema=False)


def _add_cluster_routes(app: Any) -> None:
    """The application-wide routes, answered by the replica (CLUSTER_HEADER) once this app let them through:
    past its API key check, and for /ready once this replica serves. They come before the app's own routes of the
    same paths."""
    from fastapi.responses import Response

    state = app.state.server

    def delegate(route: str) -> Response:
        return Response(status_code=200, headers={CLUSTER_HEADER.decode(): route})

    async def cluster_metrics() -> Response:
        return delegate("metrics")

    async def cluster_ready() -> Response:
        state.check_ready()
        return delegate("ready")

    async def cluster_finished(request_id: str) -> Response:
        return delegate("finished")

    async def cluster_replicas() -> Response:
        return delegate("replicas")

    num_routes = len(app.router.routes)
    app.add_api_route("/metrics", cluster_metrics, methods=["GET"], tags=["ops"],
                      summary="Prometheus metrics of every replica, each sample labelled `replica`")
    app.add_api_route("/ready", cluster_ready, methods=["GET"], tags=["ops"],
                      summary="Readiness of the application: 200 while a replica serves (status degraded "
                              "while fewer than all are running), 503 otherwise")
    app.add_api_route("/v1/requests/{request_id}", cluster_finished, methods=["GET"], tags=["native"],
                      summary="A finished request's stage times, from whichever replica served it")
    app.add_api_route("/v1/replicas", cluster_replicas, methods=["GET"], tags=["ops"],
                      summary="Every live replica: id, process, node, device and its load report")
    routes = app.router.routes
    routes[:] = routes[num_routes:] + routes[:num_routes]  # matched first, so they shadow the app's own
    app.openapi_schema = None


def _noop() -> None:
    return None


def _load_voice(engine: Any, name: str) -> None:
    from cosystream import errors as cosy_errors

    with contextlib.suppress(cosy_errors.CosyStreamError):  # deleted: nothing to hold
        engine.voice_prompt(name)


def build_engine(args: ChildArgs) -> Any:
    """The replica's engine: loaded, its voice store attached, hooked (spec.engine_hook), warmed up, and the
    most recently changed voices' prompts loaded."""
    import pkgutil

    from cosystream.engine.async_engine import AsyncEngine

    spec = args.spec
    dtype = spec.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    voices_db = spec.voices_db
    remote_store = None
    if spec.voice_store == "actor":
        import ray

        from cosystream.scale.ray_app import VOICE_STORE_NAMESPACE, RemoteVoiceStore, voice_store_actor

        ray.init(address=args.ray_address, namespace=VOICE_STORE_NAMESPACE, log_to_driver=False,
                 configure_logging=False)
        remote_store = RemoteVoiceStore(voice_store_actor(spec.voices_db))
        voices_db = str(Path(tempfile.mkdtemp(prefix="cosystream_replica_")) / "unused_voices.db")
    engine = AsyncEngine.from_pretrained(spec.model_dir, device=args.device, dtype=dtype, voices_db=voices_db,
                                         **spec.engine_kwargs)
    if remote_store is not None:
        engine.voices.close()
        engine.voices = remote_store
    if spec.engine_hook:
        engine = pkgutil.resolve_name(spec.engine_hook)(engine)
    if spec.settings.warmup:
        engine.warmup()
    recent = sorted(engine.list_voices(), key=lambda info: info.updated_at, reverse=True)
    for info in recent[:PRELOADED_VOICES]:
        _load_voice(engine, info.name)
    return engine


def _exit_with_parent() -> None:
    """End this process when the replica's end of stdin closes (the replica ended, however it ended)."""
    def watch() -> None:
        with contextlib.suppress(Exception):
            sys.stdin.buffer.read()
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def child_main() -> None:
    import uvicorn

    from cosystream.server.app import configure_logging

    args: ChildArgs = pickle.load(sys.stdin.buffer)
    _exit_with_parent()
    configure_logging(args.spec.log_level)
    try:
        engine = build_engine(args)
    except BaseException as exc:  # the replica's error says why, not only that the process ended
        os.write(args.ready_fd, f"error {type(exc).__name__}: {exc}".encode()[:MAX_START_ERROR_BYTES])
        raise
    app = build_child_app(engine, args)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(args.socket_path)
    sock.listen(4096)  # connections wait here from now until the server accepts them
    os.write(args.ready_fd, b"ready")
    os.close(args.ready_fd)
    settings = args.spec.settings
    ws_max_size = max(4 * settings.ws_max_message_bytes, settings.max_upload_bytes, 64 * 1024)
    config = uvicorn.Config(app, log_level=args.spec.log_level, access_log=False, ws_ping_interval=None,
                            ws_max_size=ws_max_size, lifespan="on")
    log.info("event=engine_process_ready replica=%s pid=%d device=%s", args.replica_id, os.getpid(), args.device)
    uvicorn.Server(config).run(sockets=[sock])


# ---------------------------------------------------------------- the replica's side

class EngineProcessDied(RuntimeError):
    pass


class EngineProcess:
    """The child process of one replica and the HTTP client that talks to it."""

    def __init__(self, process: subprocess.Popen, socket_path: str) -> None:
        self.process = process
        self.socket_path = socket_path
        # aiohttp (with ray[serve] already): its C parser leaves the replica less CPU per request than httpx's
        # Python one (benchmarks/engine_hop.py)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=socket_path, limit=0), auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"))

    @classmethod
    async def start(cls, spec: Any, replica_id: str, device: str, ray_address: str | None) -> EngineProcess:
        """Start the child and wait until its engine is loaded, warmed up and its socket listens."""
        folder = tempfile.mkdtemp(prefix="cosystream_engine_")
        socket_path = os.path.join(folder, "engine.sock")
        ready_r, ready_w = os.pipe()
        args = ChildArgs(spec=spec, replica_id=replica_id, device=device, socket_path=socket_path,
                         ready_fd=ready_w, ray_address=ray_address)
        process = subprocess.Popen([sys.executable, "-m", "cosystream.scale.engine_process"],
                                   stdin=subprocess.PIPE, pass_fds=(ready_w,))
        os.close(ready_w)
        assert process.stdin is not None
        process.stdin.write(pickle.dumps(args))
        process.stdin.flush()  # kept open: the child ends when it closes
        loop = asyncio.get_running_loop()
        try:
            said = await asyncio.wait_for(loop.run_in_executor(None, os.read, ready_r, MAX_START_ERROR_BYTES),
                                          READY_TIMEOUT_S)
        finally:
            os.close(ready_r)
        if said != b"ready":
            process.kill()
            why = said.decode(errors="replace").removeprefix("error ") or "no reason given (see the replica's log)"
            raise EngineProcessDied(f"the engine process (pid {process.pid}) could not start, exit code "
                                    f"{process.wait()}: {why}")
        return cls(process, socket_path)

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_code(self) -> int | None:
        return self.process.poll()

    def check_alive(self) -> None:
        code = self.exit_code()
        if code is not None:
            raise EngineProcessDied(f"the engine process (pid {self.process.pid}) ended with exit code {code}")

    async def _internal(self, method: str, path: str, timeout_s: float | None, params: dict[str, Any]) -> Any:
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5.0)
        async with self.session.request(method, f"http://engine{INTERNAL_PREFIX}/{path}", params=params or None,
                                        timeout=timeout, raise_for_status=True) as response:
            return await (response.text() if path == "metrics" else response.json())

    async def get_json(self, path: str, timeout_s: float | None = None, **params: Any) -> Any:
        return await self._internal("GET", path, timeout_s, params)

    async def post_json(self, path: str, timeout_s: float | None = None, **params: Any) -> Any:
        return await self._internal("POST", path, timeout_s, params)

    async def get_text(self, path: str) -> str:
        return await self._internal("GET", path, None, {})

    async def close(self) -> None:
        await self.session.close()

    def stop(self) -> None:
        """End the child (closing its stdin ends it; a child that does not is killed)."""
        with contextlib.suppress(Exception):
            assert self.process.stdin is not None
            self.process.stdin.close()
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)
            os.rmdir(os.path.dirname(self.socket_path))


ClusterAnswer = Callable[[str, Scope], Awaitable[ASGIApp]]
VoiceAnnounce = Callable[[str], Awaitable[None]]


class Forwarder:
    """The replica's ASGI app: every HTTP request and WebSocket goes to the engine process, with what the
    replica knows of it (INTERNAL_HEADERS); `cluster(route, scope)` answers the application-wide routes the child
    hands back, `announce(name)` tells every replica of a voice a request changed before its response starts.
    A request body goes to the engine process whole, so the replica holds it to `max_body_bytes` (the server's
    upload limit) itself and answers 413 past it, as the server would, before it has read more."""

    def __init__(self, engine: EngineProcess, cluster: ClusterAnswer, announce: VoiceAnnounce,
                 max_body_bytes: int) -> None:
        self.engine = engine
        self.cluster = cluster
        self.announce = announce
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if scope["path"].startswith(INTERNAL_PREFIX):
            from cosystream.server.errors import ApiError

            error = ApiError(404, "not_found", f"path: {scope['path']} is not a route", field="path")
            return await error.response()(scope, receive, send)
        if scope["type"] == "http":
            return await self._http(scope, receive, send)
        if scope["type"] == "websocket":
            return await self._websocket(scope, receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await _read_body(scope, receive, self.max_body_bytes)
        except BodyTooLarge:
            from cosystream.server.errors import ApiError

            error = ApiError(413, "payload_too_large", f"body: larger than the limit of {self.max_body_bytes} bytes")
            return await error.response()(scope, receive, send)
        if body is None:
            return  # the client left before it sent the body
        query = scope.get("query_string", b"")
        url = "http://engine" + scope["path"] + (f"?{query.decode('latin-1')}" if query else "")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in _forwarded_headers(scope)]
        try:
            response = await self.engine.session.request(scope["method"], url, headers=headers, data=body)
        except aiohttp.ClientError as exc:
            return await _engine_gone(self.engine, exc).response()(scope, receive, send)
        try:
            route = response.headers.get(CLUSTER_HEADER.decode())
            if route:
                await response.read()
                answer = await self.cluster(route, scope)
                return await answer(scope, receive, send)
            for name in response.headers.getall(VOICE_CHANGED_HEADER.decode(), ()):
                await self.announce(unquote(name))
            headers_out = [(k.lower(), v) for k, v in response.raw_headers
                           if k.lower() not in RESPONSE_HOP_BY_HOP and k.lower() not in INTERNAL_HEADERS]
            await send({"type": "http.response.start", "status": response.status, "headers": headers_out})
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            response.release()

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        from websockets.asyncio.client import unix_connect
        from websockets.exceptions import ConnectionClosed, InvalidStatus

        first = await receive()
        if first["type"] != "websocket.connect":
            return
        query = scope.get("query_string", b"")
        uri = "ws://engine" + scope["path"] + (f"?{query.decode('latin-1')}" if query else "")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in _forwarded_headers(scope)
                   if not k.startswith(b"sec-websocket-")]
        try:
            child = await unix_connect(self.engine.socket_path, uri, additional_headers=headers,
                                       subprotocols=scope.get("subprotocols") or None, max_size=None,
                                       ping_interval=None, compression=None, user_agent_header=None)
        except (OSError, InvalidStatus) as exc:
            log.warning("event=engine_websocket_refused error=%r", exc)
            return await send({"type": "websocket.close", "code": 1011})
        accept_headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                          for k, v in child.response.headers.raw_items()
                          if k.lower().startswith("x-")] if child.response is not None else []
        await send({"type": "websocket.accept", "subprotocol": child.subprotocol, "headers": accept_headers})

        async def to_child() -> None:
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    await child.close(message.get("code", 1000))
                    return
                data = message.get("bytes")
                await child.send(data if data is not None else message.get("text", ""))

        async def to_client() -> None:
            try:
                async for data in child:
                    if isinstance(data, bytes):
                        await send({"type": "websocket.send", "bytes": data})
                    else:
                        await send({"type": "websocket.send", "text": data})
            except ConnectionClosed:
                pass
            code = child.close_code if child.close_code is not None else 1011
            await send({"type": "websocket.close", "code": code, "reason": child.close_reason or ""})

        tasks = [asyncio.ensure_future(to_child()), asyncio.ensure_future(to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await child.close()


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class BodyTooLarge(Exception):
    pass


async def _read_body(scope: Scope, receive: Receive, max_bytes: int) -> bytes | None:
    """The whole request body, None when the client left first; BodyTooLarge past `max_bytes`, by its
    Content-Length before reading or while reading (a chunked upload has none)."""
    length = dict(scope["headers"]).get(b"content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise BodyTooLarge
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        part = message.get("body", b"")
        size += len(part)
        if size > max_bytes:
            raise BodyTooLarge
        parts.append(part)
        if not message.get("more_body", False):
            return b"".join(parts)


def _forwarded_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The request's headers for the child: the client's (less hop-by-hop ones and any posing as the replica's
    own), then what the replica knows of the request (FromReplica takes them off again)."""
    from cosystream.server.session import proxy_wait_s, request_id_override

    headers = [(k, v) for k, v in scope["headers"] if k not in HOP_BY_HOP and k not in INTERNAL_HEADERS]
    t_arrival = scope.get("state", {}).get("t_arrival")
    if t_arrival is not None:
        headers.append((ARRIVAL_AGE_HEADER, f"{max(0.0, time.perf_counter() - t_arrival):.6f}".encode()))
    proxy_s = proxy_wait_s.get()
    if proxy_s is not None:
        headers.append((PROXY_WAIT_HEADER, f"{proxy_s:.6f}".encode()))
    request_id = request_id_override.get()
    if request_id:
        headers.append((REQUEST_ID_HEADER, request_id.encode("latin-1")))
    client = scope.get("client")
    if client:
        headers.append((CLIENT_HEADER, f"{client[0]}:{client[1]}".encode("latin-1")))
    return headers


def _engine_gone(engine: EngineProcess, exc: Exception) -> Any:
    from cosystream.server.errors import ApiError

    code = engine.exit_code()
    reason = f"exited with code {code}" if code is not None else f"did not answer ({type(exc).__name__})"
    return ApiError(503, "engine_dead", f"engine: the replica's engine process {reason}; the replica is being "
                    "replaced, retry")


if __name__ == "__main__":
    child_main()
