"""A tiny fake TTS server for the load generator's tests: HTTP/1.1 (chunked PCM16) and WebSocket on 127.0.0.1.

It runs on its own event loop in a background thread, so sync tests can call the CLI (which runs
asyncio.run) and async tests can talk to it too. What it streams depends on words in the request text:

    fast    0.5 s of audio at once, then 3 x 1/6 s every 20 ms (1.0 s in all): always ahead of playback
    slow    4 x 0.05 s of audio, 0.1 s apart: playback runs dry before each later piece (3 underruns)
    busy    503 with Retry-After: 2 (HTTP) / an error event with status 503 (WebSocket)
    broken  500 with a text body
    hang    one piece of audio, then nothing for 10 s
    wav     (with fast) a 44-byte WAV header before the PCM
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.parser import BytesParser
from email.policy import default
from typing import Any

import pytest
from websockets.asyncio.server import serve

FAST_NUM_SAMPLES = 12000 + 3 * 4000  # 25 speech tokens of 960 samples
SLOW_PIECES = 4


def wav_header(num_bytes: int = 0x7FFFFFF0) -> bytes:
    fmt = (1).to_bytes(2, "little") + (1).to_bytes(2, "little") + (24000).to_bytes(4, "little")
    fmt += (48000).to_bytes(4, "little") + (2).to_bytes(2, "little") + (16).to_bytes(2, "little")
    return (b"RIFF" + (36 + num_bytes).to_bytes(4, "little") + b"WAVE" + b"fmt " + (16).to_bytes(4, "little")
            + fmt + b"data" + num_bytes.to_bytes(4, "little"))


def pieces_for(text: str) -> list[tuple[float, bytes]]:
    """(delay before the piece in s, PCM16 bytes) for a fast/slow/hang text."""
    if "slow" in text:
        return [(0.0 if i == 0 else 0.1, b"\x01\x00" * 1200) for i in range(SLOW_PIECES)]
    if "hang" in text:
        return [(0.0, b"\x01\x00" * 2400), (10.0, b"\x01\x00" * 2400)]
    return [(0.0, b"\x01\x00" * 12000)] + [(0.02, b"\x01\x00" * 4000)] * 3


def form_text_fields(content_type: str, body: bytes) -> dict[str, str]:
    """The text fields of a multipart/form-data body (file parts are left out)."""
    message = BytesParser(policy=default).parsebytes(f"Content-Type: {content_type}\r\n\r\n".encode() + body)
    return {part.get_param("name", header="content-disposition"): part.get_content()
            for part in message.iter_parts() if part.get_filename() is None}


@dataclass
class FakeServer:
    FAST_NUM_SAMPLES = FAST_NUM_SAMPLES
    SLOW_PIECES = SLOW_PIECES
    http_port: int = 0
    ws_port: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)  # every HTTP request and WS session seen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.ws_port}"

    # ---- HTTP ----

    async def handle_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: several requests per connection
                head = await reader.readuntil(b"\r\n\r\n")
                method, path, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
                headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:] if ": " in line)
                headers = {k.lower(): v for k, v in headers.items()}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                await self.respond(method, path, headers, body, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def respond(self, method: str, path: str, headers: dict[str, str], body: bytes,
                      writer: asyncio.StreamWriter) -> None:
        if path == "/v1/voices":
            self.requests.append({"path": path, "content_type": headers.get("content-type", ""), "body": body})
            return self.send_plain(writer, 201, b'{"name": "ok"}')
        content_type = headers.get("content-type", "")
        if content_type.startswith("multipart/form-data"):
            data = form_text_fields(content_type, body)
            self.requests.append({"path": path, "form": data, "body": body, "peer": writer.get_extra_info("peername")})
        else:
            data = json.loads(body)
            self.requests.append({"path": path, "json": data, "peer": writer.get_extra_info("peername")})
        text = data.get("text") or data.get("input") or ""
        if "busy" in text:
            return self.send_plain(writer, 503, b"overloaded", extra="Retry-After: 2\r\n")
        if "broken" in text:
            return self.send_plain(writer, 500, b"internal error")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: audio/pcm\r\nTransfer-Encoding: chunked\r\n\r\n")
        if "wav" in text:
            self.write_chunk(writer, wav_header())
        for delay_s, pcm in pieces_for(text):
            await asyncio.sleep(delay_s)
            self.write_chunk(writer, pcm)
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    @staticmethod
    def write_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    @staticmethod
    def send_plain(writer: asyncio.StreamWriter, status: int, body: bytes, extra: str = "") -> None:
        reason = {201: "Created", 500: "Internal Server Error", 503: "Service Unavailable"}[status]
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body)

    # ---- WebSocket ----

    async def handle_ws(self, ws: Any) -> None:
        start = json.loads(await ws.recv())
        prompt = await ws.recv() if start.get("prompt_wav") else None  # the recording: one binary frame
        messages = [start, *[json.loads(await ws.recv()) for _ in range(2)]]  # start, text, end
        self.requests.append({"path": "ws", "messages": messages, "prompt": prompt})
        text = messages[1].get("text", "")
        if "busy" in text:
            await ws.send(json.dumps({"type": "error", "status": 503, "message": "overloaded"}))
            return
        await ws.send(json.dumps({"type": "started"}))
        for index, (delay_s, pcm) in enumerate(pieces_for(text)):
            await asyncio.sleep(delay_s)
            await ws.send(pcm)
            await ws.send(json.dumps({"type": "chunk", "index": index}))
        await ws.send(json.dumps({"type": "done", "timings": {"first_audio_s": 0.01}}))


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer()
    ready = threading.Event()
    control: dict[str, Any] = {}

    async def main() -> None:
        control["loop"], control["stop"] = asyncio.get_running_loop(), asyncio.Event()
        http = await asyncio.start_server(server.handle_http, "127.0.0.1", 0)
        async with http, serve(server.handle_ws, "127.0.0.1", 0) as ws:
            server.http_port = http.sockets[0].getsockname()[1]
            server.ws_port = next(iter(ws.sockets)).getsockname()[1]
            ready.set()
            await control["stop"].wait()

    # asyncio.run cancels handlers still running (the "hang" one) before closing its loop
    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10), "fake server did not start"
    yield server
    control["loop"].call_soon_threadsafe(control["stop"].set)
    thread.join(10)
