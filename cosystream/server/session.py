"""One synthesis request on the server: engine iterator → encoder, with its metrics and log line.

Shared by the three synthesis endpoints. `open()` waits for the first chunk so that input errors
(raised by the engine before any audio) still become a proper HTTP status; after that the response
is committed and a failure can only end the stream. Closing a session closes the engine iterator,
which aborts the request in the engine: every exit path (done, error, client gone) goes through it.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from contextvars import ContextVar
from typing import Any

import anyio
from starlette.requests import HTTPConnection
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cosystream.outputs import SAMPLE_RATE, AudioChunk
from cosystream.params import SynthesisParams
from cosystream.server.encode import MEDIA_TYPES, AudioFormat, build_encoder
from cosystream.server.errors import ApiError, to_api_error
from cosystream.server.protocol import AudioEvent, DoneEvent, ErrorEvent, FinishedRequest, StageTimes
from cosystream.server.state import ServerState

log = logging.getLogger("cosystream.server")

SSE_MEDIA_TYPE = "text/event-stream"
NDJSON_MEDIA_TYPE = "application/x-ndjson"
_SEND_GRACE_S = 1.0  # after the request timeout, before a response stuck on a non-reading client is cut


# An id chosen by whoever runs the app for the request being handled (the Ray Serve replica adopts the id its
# proxy already returns to the client in X-Request-Id, scale/ray_app.py); None: a fresh one per request.
request_id_override: ContextVar[str | None] = ContextVar("request_id_override", default=None)
# Seconds between the request's arrival at a proxy in front of the app and its arrival here (the Ray Serve replica
# sets it, and counts the request's arrival from the proxy's); None: the app is the server.
proxy_wait_s: ContextVar[float | None] = ContextVar("proxy_wait_s", default=None)


def new_request_id() -> str:
    return request_id_override.get() or "req_" + uuid.uuid4().hex[:16]


def log_event(event: str, **fields: Any) -> None:
    """One key=value log line; values with spaces are quoted so lines stay machine-splittable."""
    parts = [f"event={event}"]
    for key, value in fields.items():
        if isinstance(value, float):
            value = f"{value:.4f}"
        text = str(value)
        parts.append(f"{key}={json.dumps(text) if (' ' in text or not text) else text}")
    log.info(" ".join(parts))


def arrival_time(conn: HTTPConnection) -> float:
    """perf_counter() when the request arrived (stamped by the body-limit middleware), else now."""
    return conn.scope.get("state", {}).get("t_arrival", time.perf_counter())


class SynthesisSession:
    def __init__(self, state: ServerState, endpoint: str, params: SynthesisParams, fmt: AudioFormat,
                 t_arrival: float, client: str = "ip:unknown") -> None:
        self.state = state
        self.endpoint = endpoint
        self.params = params
        self.request_id = params.request_id or new_request_id()
        self.fmt = AudioFormat(fmt)
        self.t_arrival = t_arrival
        self.client = client
        timeout_s = state.settings.request_timeout_s
        self.deadline = t_arrival + timeout_s if timeout_s is not None else math.inf  # perf_counter() seconds
        self.encoder = build_encoder(self.fmt)
        self.outcome = "cancelled"  # until proven otherwise: any exit we did not see through is a cancel
        self.num_chunks = 0
        self.num_samples = 0
        self.times: Any = None
        self.server_first_audio_s: float | None = None
        self.to_engine_s: float | None = None  # arrival -> handed to the engine (parsing, checks, admission)
        self.proxy_s = proxy_wait_s.get()  # of that, the proxy's share (routing, transport), when behind one
        self._iter: AsyncIterator[AudioChunk] | None = None
        self._first: AudioChunk | None = None
        self._is_open = False
        self._is_admitted = False
        self._closed = False
        self.error: ApiError | None = None

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t_arrival

    @property
    def remaining_s(self) -> float:
        """Seconds left before the request timeout (inf without one)."""
        return max(0.0, self.deadline - time.perf_counter())

    @property
    def is_closed(self) -> bool:
        return self._closed

    def deadline_error(self) -> ApiError:
        return ApiError(504, "deadline_exceeded", f"the request took longer than the server's limit of "
                        f"{self.state.settings.request_timeout_s:g} s")

    async def _next_chunk(self) -> AudioChunk:
        """The engine's next chunk, or ApiError deadline_exceeded when the request timeout comes first."""
        assert self._iter is not None
        try:
            with anyio.fail_after(self.remaining_s):  # inf: no timeout
                return await self._iter.__anext__()
        except TimeoutError:
            raise self.deadline_error() from None

    async def open(self) -> None:
        """Admit, submit to the engine and wait for the first chunk; refusals and engine errors raise ApiError
        (nothing sent yet)."""
        try:
            self.state.admission.admit(self.client)
        except ApiError as error:
            self.fail(error)
            await self.close()
            raise
        self._is_admitted = True
        self.state.metrics.active_streams.labels(self.endpoint).inc()
        self._is_open = True
        self.to_engine_s = self.elapsed_s
        self._iter = self.state.engine.synthesize(self.params)
        try:
            self._first = await self._next_chunk()
        except StopAsyncIteration:
            error = ApiError(500, "engine_error", "the engine ended the request without audio")
            self.fail(error)
            await self.close()
            raise error from None
        except Exception as exc:
            error = to_api_error(exc)
            self.fail(error)
            await self.close()
            raise error from exc
        except BaseException:
            await self.close()
            raise

    def fail(self, error: ApiError) -> None:
        """Record the failure that ends this request (its outcome label; close() counts and logs it)."""
        error.is_recorded = True
        self.error = error
        self.outcome = error.code

    async def chunks(self) -> AsyncIterator[tuple[AudioChunk, bytes]]:
        """(chunk, encoded bytes) from the first to the final chunk. Use inside `aclosing`."""
        assert self._iter is not None and self._first is not None, "open() first"
        try:
            chunk = self._first
            while True:
                data = self.encoder.encode(chunk.pcm, chunk.is_final)
                self._account(chunk)
                yield chunk, data
                if chunk.is_final:
                    self.outcome = "ok"
                    return
                try:
                    chunk = await self._next_chunk()
                except StopAsyncIteration:  # no final flag: the stream still ended cleanly
                    self.outcome = "ok"
                    return
        except Exception as exc:
            self.fail(to_api_error(exc))
            raise
        finally:
            await self.close()

    def _account(self, chunk: AudioChunk) -> None:
        if self.server_first_audio_s is None:
            self.server_first_audio_s = self.elapsed_s
        self.num_chunks += 1
        self.num_samples += int(chunk.pcm.shape[0])
        if chunk.is_final:
            self.times = chunk.times

    async def close(self) -> None:
        """Idempotent: abort in the engine if unfinished, release the encoder, record the outcome."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):  # runs while the request is being cancelled
            if self._iter is not None and hasattr(self._iter, "aclose"):
                await self._iter.aclose()
        self.encoder.close()
        m = self.state.metrics
        if self._is_admitted:
            self.state.admission.release(self.client)
        if self._is_open:
            m.active_streams.labels(self.endpoint).dec()
        m.requests.labels(self.endpoint, self.outcome).inc()
        if self.outcome == "ok":
            m.observe_done(self.endpoint, self.times, self.server_first_audio_s)
        self.state.finished.add(self.request_id, self.finished())
        log_event("request_done", request_id=self.request_id, endpoint=self.endpoint, outcome=self.outcome,
                  format=self.fmt.value, chunks=self.num_chunks, audio_s=self.num_samples / SAMPLE_RATE,
                  first_audio_s=self.server_first_audio_s if self.server_first_audio_s is not None else "",
                  total_s=self.elapsed_s, to_engine_s=self.to_engine_s if self.to_engine_s is not None else "",
                  **({"proxy_s": self.proxy_s} if self.proxy_s is not None else {}),
                  **self._engine_stages())

    def _engine_stages(self) -> dict[str, float]:
        """The engine's per-stage seconds of a finished request, for the log line (`engine_` + StageTimes
        field): first audio as the server saw it (from arrival) against the engine's (from submission)
        shows the server's own share."""
        if self.times is None or not hasattr(self.times, "as_dict"):
            return {}
        keep = ("queue_s", "frontend_s", "llm_prefill_s", "first_token_s", "first_chunk_ready_s",
                "first_chunk_start_s", "first_chunk_flow_s",
                "first_chunk_vocoder_s", "first_audio_s", "total_s")
        stages = self.times.as_dict()
        return {f"engine_{k}": float(stages[k]) for k in keep if k in stages}

    def _stage_times(self) -> StageTimes | None:
        """The engine's stage times of a request that finished with audio (None otherwise)."""
        return StageTimes(**self.times.as_dict()) if hasattr(self.times, "as_dict") else None

    def finished(self) -> FinishedRequest:
        """What GET /v1/requests/{id} answers once the request closed."""
        return FinishedRequest(request_id=self.request_id, endpoint=self.endpoint, outcome=self.outcome,
                               num_chunks=self.num_chunks, audio_s=self.num_samples / SAMPLE_RATE,
                               to_engine_s=self.to_engine_s, proxy_s=self.proxy_s,
                               server_first_audio_s=self.server_first_audio_s,
                               server_total_s=self.elapsed_s, times=self._stage_times())

    def done_event(self) -> DoneEvent:
        return DoneEvent(request_id=self.request_id, num_chunks=self.num_chunks, num_samples=self.num_samples,
                         audio_s=self.num_samples / SAMPLE_RATE, times=self._stage_times() or StageTimes(),
                         server_first_audio_s=self.server_first_audio_s)


class AudioStreamResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, so a client that leaves between two
    chunks aborts the engine request now rather than when the generator is garbage-collected.

    It also enforces the request timeout while sending: a client that stops reading blocks the send, never
    the engine wait where SynthesisSession checks the deadline, so the response is cut here (the client sees
    an incomplete transfer) a grace period after the deadline, which leaves the session time to end an
    event stream with its `error` event first.
    """

    def __init__(self, content: AsyncIterator[bytes], session: SynthesisSession, media_type: str,
                 headers: dict[str, str]) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self.session = session

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            with anyio.move_on_after(self.session.remaining_s + _SEND_GRACE_S) as timer:
                await super().__call__(scope, receive, send)
            if timer.cancelled_caught and not self.session.is_closed:
                self.session.fail(self.session.deadline_error())
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def audio_body(session: SynthesisSession) -> AsyncIterator[bytes]:
    """Raw audio bytes. A failure mid-stream raises, so the server drops the connection before the
    final chunk terminator and the client sees a truncated transfer instead of a short "complete" file."""
    async with aclosing(session.chunks()) as chunks:
        async for _, data in chunks:
            if data:
                yield data


def _frame(event: dict, sse: bool) -> bytes:
    line = json.dumps(event, separators=(",", ":"))
    return f"data: {line}\n\n".encode() if sse else (line + "\n").encode()


async def event_body(session: SynthesisSession, sse: bool) -> AsyncIterator[bytes]:
    """`audio` events (base64 of the next encoded bytes), then `done` with the stage breakdown, or `error`."""
    try:
        async with aclosing(session.chunks()) as chunks:
            async for chunk, data in chunks:
                if data or chunk.is_final:
                    event = AudioEvent(index=session.num_chunks - 1, audio=base64.b64encode(data).decode(),
                                       num_samples=int(chunk.pcm.shape[0]), elapsed_s=round(session.elapsed_s, 6))
                    yield _frame(event.model_dump(), sse)
        yield _frame(session.done_event().model_dump(), sse)
    except Exception as exc:
        yield _frame(ErrorEvent(**to_api_error(exc).body()).model_dump(), sse)


async def openai_sse_body(session: SynthesisSession, input_chars: int) -> AsyncIterator[bytes]:
    """OpenAI `stream_format="sse"`: speech.audio.delta events, then speech.audio.done with usage."""
    try:
        async with aclosing(session.chunks()) as chunks:
            async for _, data in chunks:
                if data:
                    yield _frame({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}, True)
        num_tokens = int(getattr(session.times, "num_tokens", 0) or 0)
        usage = {"input_tokens": input_chars, "output_tokens": num_tokens, "total_tokens": input_chars + num_tokens}
        yield _frame({"type": "speech.audio.done", "usage": usage}, True)
    except Exception as exc:
        yield _frame(ErrorEvent(**to_api_error(exc).body()).model_dump(), True)


def audio_response(session: SynthesisSession) -> AudioStreamResponse:
    return AudioStreamResponse(audio_body(session), session, media_type=MEDIA_TYPES[session.fmt],
                               headers=_headers(session))


def events_response(session: SynthesisSession, sse: bool) -> AudioStreamResponse:
    return AudioStreamResponse(event_body(session, sse), session,
                               media_type=SSE_MEDIA_TYPE if sse else NDJSON_MEDIA_TYPE, headers=_headers(session))


def openai_sse_response(session: SynthesisSession, input_chars: int) -> AudioStreamResponse:
    return AudioStreamResponse(openai_sse_body(session, input_chars), session, media_type=SSE_MEDIA_TYPE,
                               headers={"X-Request-Id": session.request_id})


def _headers(session: SynthesisSession) -> dict[str, str]:
    # no-transform/X-Accel-Buffering: proxies must pass chunks through as they come
    return {"X-Request-Id": session.request_id, "X-Sample-Rate": str(SAMPLE_RATE),
            "Cache-Control": "no-store, no-transform", "X-Accel-Buffering": "no"}
