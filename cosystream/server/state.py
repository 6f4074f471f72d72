"""Server-wide state built once per app (kept in `app.state.server`, never in module globals)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from starlette.requests import HTTPConnection

from cosystream.config import DEFAULT_MAX_TEXT_CHARS
from cosystream.server.admission import Admission
from cosystream.server.errors import ApiError
from cosystream.server.metrics import ServerMetrics


@dataclass(frozen=True)
class ServerSettings:
    """Static server limits and behaviour (the engine's own knobs live in EngineConfig).

    docs/reliability.md lists every limit, its flag and what exceeding it returns.
    """

    # request size
    max_upload_bytes: int = 20 * 1024 * 1024  # whole request body; enforced while reading → 413
    max_audio_s: float = 30.0  # uploaded prompt_wav / source_wav, read from the file header → 400
    # WebSocket
    ws_idle_timeout_s: float = 60.0  # longest wait for the client's next message → 4408
    ws_max_message_bytes: int = 128 * 1024  # one client message → 4413
    ws_max_messages_per_s: float = 100.0  # sustained client message rate → 4429
    ws_message_burst: int = 1000  # messages a client may send at once before the rate applies
    # admission and timeouts
    max_streams_per_client: int | None = None  # concurrent synthesis streams per client → 429
    request_timeout_s: float | None = 600.0  # arrival to last byte of one synthesis request → 504 / 4504
    # access
    api_keys: frozenset[str] = frozenset()  # bearer tokens; empty: no authentication
    auth_exempt_paths: tuple[str, ...] = ("/health", "/ready")  # probes answer without a key
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API; empty: no CORS headers
    playground: bool = True  # serve the web playground at / (docs/playground.md)
    # lifecycle
    warmup: bool = True  # run engine.warmup() in the background at startup; /ready answers 503 until done
    close_engine: bool = True  # the lifespan closes the engine at shutdown
    not_ready_retry_s: float = 5.0  # Retry-After while warming up
    # observability
    requests_kept: int = 4096  # finished requests whose stage times GET /v1/requests/{id} still answers
    # OpenAI clients
    default_voice: str | None = None  # /v1/audio/speech: speaks OpenAI's voice names (alloy, ...) not registered
    voice_aliases: tuple[tuple[str, str], ...] = ()  # /v1/audio/speech: (name a client sends, registered voice)
    model_id: str | None = None  # what GET /v1/models names (default: the model directory's name)

    def __post_init__(self) -> None:
        positive = {"max_upload_bytes": self.max_upload_bytes, "max_audio_s": self.max_audio_s,
                    "ws_idle_timeout_s": self.ws_idle_timeout_s, "ws_max_message_bytes": self.ws_max_message_bytes,
                    "ws_max_messages_per_s": self.ws_max_messages_per_s, "ws_message_burst": self.ws_message_burst,
                    "max_streams_per_client": self.max_streams_per_client,
                    "request_timeout_s": self.request_timeout_s, "requests_kept": self.requests_kept}
        for name, value in positive.items():
            if value is not None and not value > 0:  # `not >` also catches NaN
                raise ValueError(f"{name}: must be positive, got {value}")
        if any(not key.strip() for key in self.api_keys):
            raise ValueError("api_keys: an API key must not be empty")
        names = [name for pair in self.voice_aliases for name in pair]
        if self.default_voice is not None:
            names.append(self.default_voice)
        for name in names:
            if not name or name != name.strip():
                raise ValueError(f"voice names: {name!r} is empty or has surrounding white space")


class FinishedRequests:
    """The last `capacity` finished requests by id, oldest dropped first. Written and read on the event loop
    only (sessions close there), so no lock."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._records: OrderedDict[str, Any] = OrderedDict()

    def add(self, request_id: str, record: Any) -> None:
        self._records[request_id] = record
        self._records.move_to_end(request_id)
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)

    def get(self, request_id: str) -> Any | None:
        return self._records.get(request_id)

    def __len__(self) -> int:
        return len(self._records)


class ServerState:
    """What every route needs: the engine, the settings, the metrics, admission control, and readiness."""

    def __init__(self, engine: Any, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        config = getattr(engine, "config", None)
        self.admission = Admission(settings.max_streams_per_client)
        self.metrics = ServerMetrics(engine, self.admission)
        self.finished = FinishedRequests(settings.requests_kept)
        self.started_at = time.time()  # Unix seconds: when the model was put behind this server
        self.ready_event = threading.Event()  # set once warm-up finished (embedders and tests wait on it)
        self.warmup_error: BaseException | None = None
        # the engine's one limit (EngineConfig.max_text_chars), checked here too so the 400 comes early
        self.max_text_chars: int = getattr(config, "max_text_chars", DEFAULT_MAX_TEXT_CHARS)

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


def client_id(conn: HTTPConnection) -> str:
    """Who a request counts against for per-client limits: its API key (set by the auth middleware) when
    authentication is on, else the remote address (behind a proxy, run uvicorn with --proxy-headers)."""
    key_id = conn.scope.get("state", {}).get("client_id")
    if key_id:
        return key_id
    return f"ip:{conn.client.host}" if conn.client else "ip:unknown"
