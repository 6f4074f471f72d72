"""Server-wide state built once per app (kept in `app.state.server`, never in module globals)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from starlette.requests import HTTPConnection

from cosystream.server.errors import ApiError
from cosystream.server.metrics import ServerMetrics

DEFAULT_MAX_TEXT_CHARS = 5000  # used when the engine's config does not say


@dataclass(frozen=True)
class ServerSettings:
    """Static server limits and behaviour (the engine's own knobs live in EngineConfig)."""

    max_upload_bytes: int = 20 * 1024 * 1024  # whole request body; enforced while reading → 413
    max_text_chars: int | None = None  # None: the engine's EngineConfig.max_text_chars
    warmup: bool = True  # run engine.warmup() in the background at startup; /ready answers 503 until done
    close_engine: bool = True  # the lifespan closes the engine at shutdown
    ws_idle_timeout_s: float = 60.0  # WebSocket: longest wait for the client's next message
    not_ready_retry_s: float = 5.0  # Retry-After while warming up


class ServerState:
    """What every route needs: the engine, the settings, the metrics, and whether warm-up finished."""

    def __init__(self, engine: Any, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = ServerMetrics(engine)
        self.ready_event = threading.Event()  # set once warm-up finished (embedders and tests wait on it)
        self.warmup_error: BaseException | None = None
        config_limit = getattr(getattr(engine, "config", None), "max_text_chars", None)
        self.max_text_chars: int = settings.max_text_chars or config_limit or DEFAULT_MAX_TEXT_CHARS

    @property
    def is_ready(self) -> bool:
        return self.ready_event.is_set() and self.warmup_error is None

    def engine_error(self) -> BaseException | None:
        """Why the engine loop stopped, or None while it runs (read from `engine.core.error`)."""
        return getattr(getattr(self.engine, "core", None), "error", None)

    def check_alive(self) -> None:
        """503 engine_dead once the engine loop has stopped: only a restart helps then."""
        error = self.engine_error()
        if error is not None:
            raise ApiError(503, "engine_dead", f"the engine stopped: {error!r}")

    def check_ready(self) -> None:
        """503 not_ready (with Retry-After) until warm-up finished; engine_dead if it failed or the engine stopped."""
        if self.warmup_error is not None:
            raise ApiError(503, "engine_dead", f"warm-up failed: {self.warmup_error!r}")
        self.check_alive()
        if not self.is_ready:
            raise ApiError(503, "not_ready", "the engine is warming up", retry_after_s=self.settings.not_ready_retry_s)


def get_state(conn: HTTPConnection) -> ServerState:
    """The app's ServerState from a Request or WebSocket."""
    return conn.app.state.server
