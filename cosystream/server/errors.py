"""Exception → HTTP status + one JSON error shape, the same on every endpoint (docs/server.md#errors).

    {"error": {"code": "bad_input", "message": "text: empty", "field": "text"}}

Engine errors carry "field: reason" messages (cosystream.errors.BadInput); the field is split off
so clients can point at the offending input.
"""

from __future__ import annotations

import logging
import math
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import HTTPConnection

from cosystream.errors import (
    BadInput,
    CosyStreamError,
    EngineDead,
    Overloaded,
    SynthesisFailed,
    UnknownVoice,
    VoiceExists,
)

log = logging.getLogger("cosystream.server")

_FIELD = re.compile(r"([A-Za-z_][A-Za-z0-9_.\[\]]*): ")
_HTTP_CODES = {400: "bad_input", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
               413: "payload_too_large", 415: "unsupported_media_type"}
# synthesis routes → the `endpoint` label of cosystream_requests_total
ENDPOINTS = {"/v1/audio/speech": "speech", "/v1/tts": "tts", "/v1/tts/stream": "ws"}


class ApiError(Exception):
    """An error response: HTTP status, a stable machine code, a message, and the input field if any."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s
        self.is_recorded = False  # a SynthesisSession already counted and logged it

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "field": self.field}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


def bad_input(message: str, status: int = 400, code: str = "bad_input") -> ApiError:
    """ApiError from a "field: reason" message."""
    match = _FIELD.match(message)
    return ApiError(status, code, message, field=match.group(1) if match else None)


CLI_VOICES_HINT = " (see `cosystream voices list`)"  # how the engine's UnknownVoice points a CLI user on
HTTP_VOICES_HINT = " (GET /v1/voices lists the registered voices)"


def http_voice_hint(message: str) -> str:
    """An unknown-voice message for an HTTP client: it lists voices with GET /v1/voices, not the CLI."""
    return message.replace(CLI_VOICES_HINT, "").rstrip() + HTTP_VOICES_HINT


def to_api_error(exc: BaseException, unknown_voice_status: int = 400) -> ApiError:
    """Map any exception to its ApiError. An unknown voice is 404 on /v1/voices/{name}, 400 in a request body."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, Overloaded):
        return ApiError(503, "overloaded", str(exc), retry_after_s=exc.retry_after_s)
    if isinstance(exc, EngineDead):
        return ApiError(503, "engine_dead", str(exc))
    if isinstance(exc, UnknownVoice):
        return bad_input(http_voice_hint(str(exc)), status=unknown_voice_status, code="unknown_voice")
    if isinstance(exc, VoiceExists):
        return bad_input(str(exc), status=409, code="voice_exists")
    if isinstance(exc, BadInput):
        return bad_input(str(exc))
    if isinstance(exc, ValidationError):
        return from_validation_errors(exc.errors())
    if isinstance(exc, SynthesisFailed):
        return _synthesis_failed(exc)
    if isinstance(exc, CosyStreamError):
        return ApiError(500, "engine_error", str(exc))
    log.error("event=internal_error error=%r", exc, exc_info=exc)
    return ApiError(500, "internal", "internal server error (logged with its request id)")


def _synthesis_failed(exc: SynthesisFailed) -> ApiError:
    """The engine's per-request failure codes: memory pressure is temporary (503 + Retry-After), a model
    producing NaN/inf or any other batch fault is a 500 that names its code."""
    if exc.code == "out_of_memory":
        return ApiError(503, "out_of_memory", str(exc), retry_after_s=1.0)
    if exc.code in ("non_finite_output", "aborted"):
        return ApiError(500, exc.code, str(exc))
    return ApiError(500, "engine_error", str(exc))


def from_validation_errors(errors: list | tuple) -> ApiError:
    """The first pydantic/FastAPI validation error as a bad_input ApiError."""
    if not errors:
        return ApiError(400, "bad_input", "invalid request")
    first = errors[0]
    # FastAPI prefixes the location with "body"/"query"/...; the field is what follows
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path", "form")]
    field = ".".join(loc) or "body"
    message = first.get("msg", "invalid value")
    return ApiError(400, "bad_input", f"{field}: {message}", field=field)


def record(conn: HTTPConnection, error: ApiError) -> None:
    """Count and log an error no SynthesisSession saw (rejected before synthesis started)."""
    if error.is_recorded:
        return
    error.is_recorded = True
    endpoint = ENDPOINTS.get(conn.url.path)
    if endpoint is not None:
        conn.app.state.server.metrics.requests.labels(endpoint, error.code).inc()
    log.info("event=request_error path=%s status=%d code=%s field=%s", conn.url.path, error.status, error.code,
             error.field or "")


def install_handlers(app: FastAPI) -> None:
    """Route every error through ApiError so no endpoint answers in another shape."""

    def respond(request: Request, error: ApiError) -> JSONResponse:
        record(request, error)
        return error.response()

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, to_api_error(exc))

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return respond(request, from_validation_errors(exc.errors()))

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        if exc.status_code == 400:  # FastAPI/Starlette raise it for a body (JSON, form) they cannot parse
            return respond(request, ApiError(400, code, f"body: {exc.detail}", field="body"))
        return respond(request, ApiError(exc.status_code, code, str(exc.detail)))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(CosyStreamError, api_error)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, api_error)
