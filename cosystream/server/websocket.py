"""WS /v1/tts/stream: text in as an upstream LLM produces it, audio out as soon as each chunk is ready.

Client → server: one `start` (voice, mode, settings), any number of `text` pieces, then `end`.
Server → client: `started`; per chunk a binary frame (audio in response_format, default 16-bit PCM)
followed by a `chunk` event; `done` with the stage breakdown; or `error`. Then the server closes:
1000 after done, 4000 + HTTP status after an error (4400 bad input, 4503 overloaded, ...).
Closing the socket cancels the request in the engine. One request per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from cosystream.params import Mode
from cosystream.server.errors import ApiError, bad_input, from_validation_errors, record, to_api_error
from cosystream.server.native import options_to_params
from cosystream.server.protocol import ChunkEvent, ErrorEvent, StartedEvent, WsEnd, WsStart, WsText
from cosystream.server.session import SynthesisSession, arrival_time, log_event, new_request_id
from cosystream.server.state import ServerState, get_state

router = APIRouter()

CLOSE_NORMAL = 1000
CLOSE_ERROR_BASE = 4000  # application close codes: 4000 + the HTTP status of the error

_MESSAGES: dict[str, type[WsStart | WsText | WsEnd]] = {"start": WsStart, "text": WsText, "end": WsEnd}


def parse_message(raw: str) -> WsStart | WsText | WsEnd:
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise bad_input(f"message: invalid JSON ({exc})") from None
    model = _MESSAGES.get(data.get("type")) if isinstance(data, dict) else None
    if model is None:
        raise bad_input(f"type: expected a JSON object with type {', '.join(_MESSAGES)}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


async def _with_timeout(awaitable, timeout_s: float):
    # asyncio.wait_for of Python 3.11 can swallow a cancellation that races with the message it is
    # waiting for; asyncio.timeout (3.11+) cannot, so a cancelled reader really stops.
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout_s):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout_s)


async def receive_message(ws: WebSocket, timeout_s: float) -> WsStart | WsText | WsEnd:
    """Next client message; WebSocketDisconnect when the client is gone, ApiError when it is unusable."""
    try:
        message = await _with_timeout(ws.receive(), timeout_s)
    except asyncio.TimeoutError:
        raise bad_input(f"message: nothing received for {timeout_s:.0f} s", status=408, code="timeout") from None
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    if message.get("text") is None:
        raise bad_input("message: expected a JSON text message, got binary")
    return parse_message(message["text"])


_CANCEL_GRACE_S = 2.0


class WsSession:
    """One streamed request: a reader task feeding text pieces, a synthesis task sending audio."""

    def __init__(self, ws: WebSocket, state: ServerState, start: WsStart) -> None:
        self.ws = ws
        self.state = state
        self.start = start
        self.pieces: asyncio.Queue[str | None] = asyncio.Queue()  # None: no more text
        self.num_chars = len(start.text)
        params = options_to_params(start, self._text_pieces(), {}, new_request_id())
        self.session = SynthesisSession(state, "ws", params, start.response_format, arrival_time(ws))

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
            done, _ = await asyncio.wait({synth, reader}, return_when=asyncio.FIRST_COMPLETED)
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
            message = await receive_message(self.ws, self.state.settings.ws_idle_timeout_s)
            if not is_open or isinstance(message, WsStart):
                raise bad_input(f"type: unexpected {message.type!r} message"
                                f"{' after end' if not is_open else ''}")
            if isinstance(message, WsEnd):
                if self.num_chars == 0:
                    raise bad_input("text: empty (no text before end)")
                self.pieces.put_nowait(None)
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
                event = ChunkEvent(index=session.num_chunks - 1, num_samples=int(chunk.pcm.shape[0]),
                                   num_bytes=len(data), elapsed_s=round(session.elapsed_s, 6))
                await self.ws.send_json(event.model_dump())
        await self.ws.send_json(session.done_event().model_dump(mode="json"))


async def receive_start(ws: WebSocket, state: ServerState) -> WsStart:
    message = await receive_message(ws, state.settings.ws_idle_timeout_s)
    if not isinstance(message, WsStart):
        raise bad_input(f"type: the first message must be 'start', got {message.type!r}")
    if message.mode == Mode.vc:
        raise bad_input("mode: vc needs an uploaded source_wav; use POST /v1/tts")
    return message


async def send_error(ws: WebSocket, error: ApiError) -> None:
    with contextlib.suppress(Exception):  # the client may be gone already
        await ws.send_json(ErrorEvent(**error.body()).model_dump())
        await ws.close(CLOSE_ERROR_BASE + error.status, reason=error.code)


@router.websocket("/v1/tts/stream")
async def tts_stream(ws: WebSocket) -> None:
    """Streaming text in, streaming audio out (protocol in this module's docstring and docs/server.md)."""
    await ws.accept()
    state = get_state(ws)
    try:
        state.check_ready()
        await WsSession(ws, state, await receive_start(ws, state)).run()
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
