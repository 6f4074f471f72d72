"""The FastAPI app: build_app(engine, settings) mounts every router; serve() loads, warms up and runs it.

    serve("pretrained_models/CosyVoice2-0.5B", host="0.0.0.0", port=8000, device="cuda")

The engine is built once, before uvicorn starts, and kept in `app.state.server`. Warm-up (CUDA graph
capture) runs in the background after start: /health answers at once, /ready and the synthesis
endpoints answer 503 until it is done. The lifespan closes the engine at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request, Response
from fastapi.openapi.utils import get_openapi
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cosystream.server import models, native, openai_speech, websocket
from cosystream.server.auth import install_access
from cosystream.server.errors import ApiError, install_handlers
from cosystream.server.metrics import CONTENT_TYPE
from cosystream.server.playground import asset_files, install_playground, public_paths
from cosystream.server.protocol import (
    EXTRA_SCHEMAS,
    ChunkEvent,
    DoneEvent,
    ErrorEvent,
    ErrorResponse,
    Health,
    StartedEvent,
    WsEnd,
    WsStart,
    WsText,
)
from cosystream.server.session import log_event
from cosystream.server.state import ServerSettings, ServerState, get_state

log = logging.getLogger("cosystream.server")

DESCRIPTION = """Streaming CosyVoice2 text-to-speech.

* `POST /v1/audio/speech`: OpenAI-compatible; works with the OpenAI SDK. `GET /v1/models` names the model.
* `POST /v1/tts`: every engine setting; JSON or multipart (prompt/source wav uploads); raw audio or
  `?events=sse|ndjson` (`audio` events, then `done` with per-stage timings).
* `WS /v1/tts/stream`: send `start`, `text` pieces, `end` (schemas `WsStart`, `WsText`, `WsEnd`); receive
  `started`, binary audio frames each followed by a `chunk` event, then `done` (`DoneEvent`) or `error`.
* Every error body is `ErrorResponse`: `{"error": {"code", "message", "field"}}`.
"""


class BodyLimitMiddleware:
    """413 for request bodies over `max_bytes`, checked on Content-Length and again while reading
    (chunked uploads have no length), so an oversized upload is never buffered whole.
    Also stamps the arrival time used for first-audio latency, and tells the client how long the server
    took from that arrival to the start of its response (`Server-Timing: app;dur=<ms>`): a client loaded with
    streams can tell its own event loop's lag from the server's. Refusals (503, 429) are also timed in
    `cosystream_refusal_seconds`."""

    def __init__(self, app: ASGIApp, max_bytes: int, metrics: Any = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):  # unless a proxy in front stamped it (scale/ray_app.py)
            scope.setdefault("state", {}).setdefault("t_arrival", time.perf_counter())
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        send = self._timed(scope["state"]["t_arrival"], send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large().response()(scope, receive, send)
        num_bytes = 0

        async def limited_receive() -> Message:
            nonlocal num_bytes
            message = await receive()
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_bytes:
                # HTTPException: FastAPI re-raises it from body parsing instead of turning it into a 400
                raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, limited_receive, send)

    def _timed(self, t_arrival: float, send: Send) -> Send:
        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                elapsed = time.perf_counter() - t_arrival
                headers = list(message.get("headers", []))
                headers.append((b"server-timing", f"app;dur={elapsed * 1000:.3f}".encode()))
                message = {**message, "headers": headers}
                status = message.get("status")
                if self.metrics is not None and status in (429, 503):
                    self.metrics.refusal.labels(str(status)).observe(elapsed)
            await send(message)

        return timed_send

    def _too_large(self) -> ApiError:
        return ApiError(413, "payload_too_large", f"body: larger than the limit of {self.max_bytes} bytes")


ops = APIRouter(tags=["ops"])


@ops.get("/health", response_model=Health, responses={503: {"model": ErrorResponse}},
         summary="Liveness: the process is up and its engine loop runs (503 engine_dead: restart it)")
async def health(request: Request) -> Health:
    state = get_state(request)
    state.check_alive()
    return Health(status="ok" if state.is_ready else "starting")


@ops.get("/ready", response_model=Health, responses={503: {"model": ErrorResponse}},
         summary="Readiness: models loaded and warmed up (503 until then)")
async def ready(request: Request) -> Health:
    get_state(request).check_ready()
    return Health(status="ok")


@ops.get("/metrics", response_class=Response, summary="Prometheus metrics")
async def metrics(request: Request) -> Response:
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def _warm_up(state: ServerState) -> None:
    t0 = time.perf_counter()
    try:
        warmup = getattr(state.engine, "warmup", None)
        if callable(warmup):
            await run_in_threadpool(warmup)  # blocking GPU work: keep the loop answering /health
    except Exception as exc:
        state.warmup_error = exc
        state.ready_event.set()  # waiters wake up; check_ready reports the failure
        log.exception("event=warmup_failed")
        return
    state.ready_event.set()
    log_event("ready", warmup_s=time.perf_counter() - t0)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.server
    task = asyncio.create_task(_warm_up(state)) if state.settings.warmup else None
    if task is None:
        state.ready_event.set()
    try:
        yield
    finally:
        if task is not None:
            await task  # a half-captured engine must not be closed under the capture
        if state.settings.close_engine and hasattr(state.engine, "close"):
            await run_in_threadpool(state.engine.close)
        log_event("shutdown")


def build_app(engine: Any, settings: ServerSettings | None = None) -> FastAPI:
    """The server around an already-built engine (an AsyncEngine, or any object with its methods)."""
    settings = settings or ServerSettings()
    app = FastAPI(title="cosystream", version="0.1.0", description=DESCRIPTION, lifespan=_lifespan)
    app.state.server = ServerState(engine, settings)
    install_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_upload_bytes, metrics=app.state.server.metrics)
    exempt_paths = settings.auth_exempt_paths
    if settings.playground:  # the page is public; the API calls it makes carry the user's key
        playground_files = asset_files()
        exempt_paths += public_paths(playground_files)
        install_playground(app, playground_files)
    install_access(app, settings.api_keys, exempt_paths, settings.cors_origins)
    for router in (openai_speech.router, models.router, native.router, websocket.router, ops):
        app.include_router(router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema plus the models no route signature reaches (/v1/tts bodies, WebSocket messages)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in EXTRA_SCHEMAS:
            model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(model_schema.pop("$defs", {}))
            components[model.__name__] = model_schema
        for operation in (op for path in schema["paths"].values() for op in path.values()):
            # validation errors answer 400 with ErrorResponse (errors.py), never FastAPI's 422 shape
            if operation.get("responses", {}).pop("422", None) is not None:
                operation["responses"].setdefault("400", {"description": "bad input", "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        schema["paths"]["/v1/tts/stream"] = _WEBSOCKET_DOC
        _document_auth(schema, app.state.server.settings)
        app.openapi_schema = schema
    return app.openapi_schema


def _document_auth(schema: dict, settings: ServerSettings) -> None:
    """With API keys on, mark every operation but the exempt ones as needing the bearer token."""
    if not settings.api_keys:
        return
    schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in schema["paths"].items():
        if path in settings.auth_exempt_paths:
            continue
        for operation in operations.values():
            operation["security"] = [{"bearer": []}]
            operation.setdefault("responses", {}).setdefault("401", {"description": "missing or unknown API key",
                                                                     "content": {"application/json": {
                                                                         "schema": _ref(ErrorResponse)}}})


def _ref(model: type) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


# OpenAPI has no WebSocket operations: document the upgrade as a GET with the message schemas.
_WEBSOCKET_DOC = {"get": {
    "tags": ["native"], "summary": "WebSocket: text pieces in, audio chunks out (upgrade)",
    "description": websocket.__doc__,
    "responses": {"101": {"description": "switching to the WebSocket protocol"}},
    "x-websocket-client-messages": [_ref(m) for m in (WsStart, WsText, WsEnd)],
    "x-websocket-server-messages": [_ref(m) for m in (StartedEvent, ChunkEvent, DoneEvent, ErrorEvent)],
}}


def configure_logging(level: str = "info") -> None:
    """key=value log lines on stderr (our lines start with event=...; uvicorn's keep their text)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"))
    root = logging.getLogger("cosystream")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def serve(model_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, device: str | None = None,
          dtype: str | None = None, voices_db: str | None = None, settings: ServerSettings | None = None,
          log_level: str = "info", **engine_kwargs: Any) -> None:
    """Load the engine (any EngineConfig field as a keyword), then serve until interrupted."""
    import uvicorn

    from cosystream.engine.async_engine import AsyncEngine, default_device

    configure_logging(log_level)
    device = device or default_device()
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    t0 = time.perf_counter()
    engine = AsyncEngine.from_pretrained(model_dir, device=device, dtype=dtype, voices_db=voices_db, **engine_kwargs)
    log_event("engine_loaded", model_dir=str(model_dir), device=device, dtype=dtype, load_s=time.perf_counter() - t0)
    settings = settings or ServerSettings()
    # the protocol layer drops frames far over the limit before buffering them (close 1009); frames up to
    # 4x the message limit, or an upload's limit (a prompt recording sent as one binary frame), still reach
    # the app, which answers them with an error event and close 4413
    ws_max_size = max(4 * settings.ws_max_message_bytes, settings.max_upload_bytes, 64 * 1024)
    uvicorn.run(build_app(engine, settings), host=host, port=port, log_level=log_level, ws_ping_interval=20.0,
                ws_max_size=ws_max_size)
