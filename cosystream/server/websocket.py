"""WS /v1/tts/stream: text in as an upstream LLM produces it, audio out as soon as each chunk is ready.

Client → server: one `start` (voice, mode, settings), with `prompt_wav: true` one binary frame holding the
prompt recording, any number of `text` pieces, then `end`.
Server → client: `started`; per chunk a binary frame (audio in response_format, default 16-bit PCM)
followed by a `chunk` event; `done` with the stage breakdown; or `error`. Then the server closes:
1000 after done, 4000 + HTTP status after an error (4400 bad input, 4413 message too large,
4429 too many messages or streams, 4503 overloaded, 4504 request timeout, ...).
Closing the socket cancels the request in the engine. One request per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from cosystream.params import Mode
from cosystream.server.errors import ApiError, bad_input, from_validation_errors, record, to_api_error
from cosystream.server.inputs import check_audio_duration, decode_json_object
from cosystream.server.native import check_options, options_to_params
from cosystream.server.protocol import ChunkEvent, ErrorEvent, StartedEvent, WsEnd, WsStart, WsText
from cosystream.server.session import SynthesisSession, arrival_time, log_event, new_request_id
from cosystream.server.state import ServerSettings, ServerState, client_id, get_state

router = APIRouter()

CLOSE_NORMAL = 1000
CLOSE_ERROR_BASE = 4000  # application close codes: 4000 + the HTTP status of the error

_MESSAGES: dict[str, type[WsStart | WsText | WsEnd]] = {"start": WsStart, "text": WsText, "end": WsEnd}


def parse_message(raw: str) -> WsStart | WsText | WsEnd:
    data = decode_json_object(raw, "message")
    kind = data.get("type")
    model = _MESSAGES.get(kind) if isinstance(kind, str) else None  # a list or object would not even hash
    if model is None:
        raise bad_input(f"type: expected a JSON object with type {', '.join(_MESSAGES)}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


class MessageRate:
    """Token bucket over client messages: `burst` at once, then `rate_per_s` on average."""

    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate_per_s = rate_per_s
        self.burst = float(burst)
        self.tokens = float(burst)
        self.t_last = time.monotonic()

    def allow(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.t_last) * self.rate_per_s)
        self.t_last = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class MessageReader:
    """The client's messages, one at a time, within the connection's size, rate and idle limits."""

    def __init__(self, ws: WebSocket, settings: ServerSettings) -> None:
        self.ws = ws
        self.idle_timeout_s = settings.ws_idle_timeout_s
        self.max_bytes = settings.ws_max_message_bytes
        self.rate = MessageRate(settings.ws_max_messages_per_s, settings.ws_message_burst)
        # Idle means no message from the client *and* nothing sent to it: audio going out counts as activity,
        # and once the client sent `end` only the request timeout bounds the wait (the synthesis ends it).
        self.t_active = time.monotonic()
        self.idle_applies = True

    def note_sent(self) -> None:
        """The server sent the client something (audio): the connection is not idle."""
        self.t_active = time.monotonic()

    def stop_idle_timeout(self) -> None:
        """After `end`: the client has nothing more to say, so its silence is no longer idleness."""
        self.idle_applies = False

    async def next(self) -> WsStart | WsText | WsEnd:
        """WebSocketDisconnect when the client is gone, ApiError when a message is unusable."""
        message = await self._receive("message", self.max_bytes)
        text = message.get("text")
        if text is None:
            raise bad_input("message: expected a JSON text message, got binary")
        return parse_message(text)

    async def next_bytes(self, field: str, max_bytes: int) -> bytes:
        """One binary message (an upload such as the prompt recording) of at most `max_bytes`."""
        message = await self._receive(field, max_bytes)
        data = message.get("bytes")
        if data is None:
            raise bad_input(f"{field}: expected a binary message with the recording, got text")
        return data

    async def _receive(self, field: str, max_bytes: int) -> dict:
        message = await self._receive_unless_idle(field)
        self.t_active = time.monotonic()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        num_bytes = _num_bytes(message, max_bytes)
        if num_bytes > max_bytes:
            raise bad_input(f"{field}: {num_bytes} bytes, more than the limit of {max_bytes}", status=413,
                            code="payload_too_large")
        if not self.rate.allow():
            raise bad_input(f"message: more than {self.rate.burst:.0f} messages at once or "
                            f"{self.rate.rate_per_s:g} per second", status=429, code="rate_limited")
        return message

    async def _receive_unless_idle(self, field: str) -> dict:
        """The next ASGI message; ApiError 408 once the connection was idle for the idle timeout.

        One receive task is awaited across wake-ups (asyncio.wait never cancels it), so a message arriving
        while the deadline is re-checked is never lost; a cancelled reader cancels it and really stops.
        """
        receive = asyncio.ensure_future(self.ws.receive())
        try:
            while True:
                wait_s = self.t_active + self.idle_timeout_s - time.monotonic() if self.idle_applies else None
                if wait_s is not None and wait_s <= 0:
                    raise bad_input(f"{field}: nothing received for {self.idle_timeout_s:g} s", status=408,
                                    code="timeout")
                done, _ = await asyncio.wait({receive}, timeout=wait_s)
                if done:
                    return receive.result()
        finally:
            if not receive.done():
                receive.cancel()


def _num_bytes(message: dict, max_bytes: int) -> int:
    text = message.get("text")
    if text is None:
        return len(message.get("bytes") or b"")
    # a str holds at most 4 UTF-8 bytes per character: encode only when that bound is over the limit
    return len(text) if 4 * len(text) <= max_bytes else len(text.encode())


_CANCEL_GRACE_S = 2.0


class WsSession:
    """One streamed request: a reader task feeding text pieces, a synthesis task sending audio."""

    def __init__(self, ws: WebSocket, state: ServerState, start: WsStart, reader: MessageReader,
                 files: dict[str, bytes]) -> None:
        self.ws = ws
        self.state = state
        self.start = start
        self.reader = reader
        self.pieces: asyncio.Queue[str | None] = asyncio.Queue()  # None: no more text
        self.num_chars = len(start.text)
        params = options_to_params(start, self._text_pieces(), files, new_request_id())
        self.session = SynthesisSession(state, "ws", params, start.response_format, arrival_time(ws), client_id(ws))

    async def _text_pieces(self) -> AsyncIterator[str]:
        if self.start.text:
            yield self.start.text
        while (piece := await self.pieces.get()) is not None:
            yield piece

    async def run(self) -> None:
        """Until done (returns), an error (ApiError) or the client leaving (WebSocketDisconnect)."""
        await self.ws.send_json(StartedEvent(request_id=self.session.request_id, sample_rate=24000,
                                             response_format=self.start.response_format).model_dump(mode="json"))
        synth = asyncio.create_task(self._synthesize())
        reader = asyncio.create_task(self._read())
        try:
            timeout_s = self.session.remaining_s
            done, _ = await asyncio.wait({synth, reader}, timeout=None if math.isinf(timeout_s) else timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:  # the whole session ran past the request timeout (e.g. text trickling in)
                raise self.session.deadline_error()
            (synth if synth in done else reader).result()  # raises the first failure
        except ApiError as error:
            if not self.session.error:
                self.session.fail(error)  # e.g. a protocol error from the reader: not a plain cancel
            raise
        finally:
            self.pieces.put_nowait(None)  # unblock the engine's read of the text
            for task in (reader, synth):
                task.cancel()
            # Bounded: a reader that still waits for the client ends when the socket is closed below.
            await asyncio.wait({reader, synth}, timeout=_CANCEL_GRACE_S)
            await self.session.close()  # no-op when the synthesis task already closed it

    async def _read(self) -> None:
        """Text pieces into the queue. After `end` keep reading: that is how a disconnect is noticed."""
        is_open = True
        while True:
            message = await self.reader.next()
            if not is_open or isinstance(message, WsStart):
                raise bad_input(f"type: unexpected {message.type!r} message"
                                f"{' after end' if not is_open else ''}")
            if isinstance(message, WsEnd):
                if self.num_chars == 0:
                    raise bad_input("text: empty (no text before end)")
                self.pieces.put_nowait(None)
                self.reader.stop_idle_timeout()
                is_open = False
                continue
            self.num_chars += len(message.text)
            if self.num_chars > self.state.max_text_chars:
                raise bad_input(f"text: more than the limit of {self.state.max_text_chars} characters")
            if message.text:
                self.pieces.put_nowait(message.text)

    async def _synthesize(self) -> None:
        session = self.session
        await session.open()
        async with aclosing(session.chunks()) as chunks:
            async for chunk, data in chunks:
                if data:  # flac has bytes only at the end: its earlier chunk events say num_bytes 0
                    await self.ws.send_bytes(data)
                self.reader.note_sent()
                event = ChunkEvent(index=session.num_chunks - 1, num_samples=int(chunk.pcm.shape[0]),
                                   num_bytes=len(data), elapsed_s=round(session.elapsed_s, 6))
                await self.ws.send_json(event.model_dump())
        await self.ws.send_json(session.done_event().model_dump(mode="json"))


async def receive_start(reader: MessageReader, state: ServerState) -> WsStart:
    message = await reader.next()
    if not isinstance(message, WsStart):
        raise bad_input(f"type: the first message must be 'start', got {message.type!r}")
    if message.mode == Mode.vc:
        raise bad_input("mode: vc needs an uploaded source_wav; use POST /v1/tts")
    check_options(message, state.max_text_chars)
    if len(message.text) > state.max_text_chars:
        raise bad_input(f"text: {len(message.text)} characters, more than the limit of {state.max_text_chars}")
    return message


async def receive_uploads(reader: MessageReader, start: WsStart, settings: ServerSettings) -> dict[str, bytes]:
    """The prompt recording `start` announced (prompt_wav: true): the next message, one binary frame."""
    if not start.prompt_wav:
        return {}
    data = await reader.next_bytes("prompt_wav", settings.max_upload_bytes)
    check_audio_duration(data, "prompt_wav", settings.max_audio_s)
    return {"prompt_wav": data}


async def send_error(ws: WebSocket, error: ApiError) -> None:
    with contextlib.suppress(Exception):  # the client may be gone already
        await ws.send_json(ErrorEvent(**error.body()).model_dump())
        await ws.close(CLOSE_ERROR_BASE + error.status, reason=error.code)


@router.websocket("/v1/tts/stream")
async def tts_stream(ws: WebSocket) -> None:
    """Streaming text in, streaming audio out (protocol in this module's docstring and docs/server.md)."""
    await ws.accept()
    state = get_state(ws)
    reader = MessageReader(ws, state.settings)
    try:
        state.check_ready()
        start = await receive_start(reader, state)
        files = await receive_uploads(reader, start, state.settings)
        await WsSession(ws, state, start, reader, files).run()
    except WebSocketDisconnect:
        log_event("ws_disconnect")
        return
    except Exception as exc:
        error = to_api_error(exc)
        record(ws, error)
        await send_error(ws, error)
        return
    with contextlib.suppress(Exception):
        await ws.close(CLOSE_NORMAL)
