"""Helpers of the server tests: a uvicorn server in a thread, test recordings, response decoding.

Requests use `force_tokens` so audio lengths are exact: N speech tokens → 960·N samples at 24 kHz.
"""

from __future__ import annotations

import io
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import soundfile as sf
import uvicorn
from fastapi import FastAPI
from websockets.exceptions import ConnectionClosed

from cosystream.server.state import ServerState
from cosystream.testing.audio import tone_wav as make_wav  # noqa: F401 (the server tests' name)

SAMPLES_PER_TOKEN = 960  # 24 kHz / 25 Hz
UPLOAD_LIMIT_BYTES = 1024 * 1024  # small, so the 413 tests send little
VOICE = "alice"
VOICE_TEXT = "Hello there, this is my voice."
START_TIMEOUT_S = 120


def decode(data: bytes, fmt: str) -> np.ndarray:
    """Response bytes → float samples (pcm is raw 16-bit little-endian mono 24 kHz)."""
    if fmt == "pcm":
        assert len(data) % 2 == 0
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767
    audio, sample_rate = sf.read(io.BytesIO(data), dtype="float32")
    assert sample_rate == 24000
    return audio


class _Server(uvicorn.Server):
    """uvicorn reporting 'accepting connections' through an event instead of a polled flag."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.started_event = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.started_event.set()


@contextmanager
def run_server(app: FastAPI) -> Iterator[str]:
    """Serve `app` on a free loopback port in a thread; yields the base URL; stops and joins on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = _Server(uvicorn.Config(app, log_level="warning", lifespan="on", ws_ping_interval=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    try:
        assert server.started_event.wait(START_TIMEOUT_S), "server did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@dataclass
class Live:
    base_url: str
    app: FastAPI
    engine: Any

    @property
    def ws_url(self) -> str:
        return "ws" + self.base_url[len("http"):]

    @property
    def state(self) -> ServerState:
        return self.app.state.server

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60, **kwargs)

    def engine_idle(self) -> bool:
        """True when the engine holds no request, after it handled every message sent so far: its inbox is
        FIFO, so a no-op call round trip orders this check after any earlier abort."""
        self.engine.core.call(lambda: None)
        return self.engine.core.num_active == 0

    def count(self, endpoint: str, outcome: str) -> float:
        value = self.state.metrics.registry.get_sample_value(
            "cosystream_requests_total", {"endpoint": endpoint, "outcome": outcome})
        return value or 0.0




class EngineProxy:
    """The real engine with `synthesize` replaced: injects failures the tiny model cannot produce on demand."""

    def __init__(self, engine: Any, synthesize: Any) -> None:
        self._engine = engine
        self.synthesize = synthesize

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@contextmanager
def engine_swapped(live: Live, synthesize: Any) -> Iterator[None]:
    """Serve through EngineProxy(live.engine, synthesize) for the duration of the block."""
    state = live.state
    real = state.engine
    state.engine = EngineProxy(real, synthesize)
    try:
        yield
    finally:
        state.engine = real


def read_ws_events(ws: Any) -> list[dict]:
    """Every JSON text event a (sync) WebSocket sends until it closes."""
    events = []
    try:
        while True:
            message = ws.recv(timeout=10)
            if isinstance(message, str):
                events.append(json.loads(message))
    except ConnectionClosed:
        pass
    return events
