"""The load generator's clients: one request each over HTTP (`/v1/tts`, `/v1/audio/speech`) or WebSocket.

`build_body` and `ws_messages` are the one place that knows each endpoint's request fields (they follow
cosystream/server/protocol.py; unknown servers get only the fields they need). Audio must come back as
PCM16 LE mono; a WAV header, if a server sends one anyway, is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import os
import ssl
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import websockets

from cosystream.bench.loadgen import run_timed
from cosystream.bench.report import RequestRecord, Timeline
from cosystream.errors import error_code
from cosystream.outputs import SAMPLE_RATE

TARGETS = ("tts", "ws", "openai")
PATHS = {"tts": "/v1/tts", "ws": "/v1/tts/stream", "openai": "/v1/audio/speech"}
REFUSAL_STATUSES = (503, 429)  # admission control: overloaded / rate limited
SAMPLES_PER_TOKEN = 960  # 24 kHz samples per speech token (25 Hz)
BYTES_PER_SAMPLE = 2  # PCM16
MAX_ERROR_BODY = 200  # characters of an error response kept in the record


@dataclass(frozen=True)
class RequestSpec:
    """What every request of a run asks for; texts are used round-robin by request index."""

    texts: tuple[str, ...]
    voice: str | None = None
    mode: str = "zero_shot"
    force_tokens: int | None = None  # exactly this many speech tokens (our server only)
    first_hop: int | None = None
    seed: int | None = None
    greedy: bool = False
    model: str = "cosyvoice2"  # the OpenAI `model` field
    sample_rate: int = SAMPLE_RATE
    # zero-shot without a registered voice: every request uploads this recording with its transcript
    # (multipart /v1/tts; the path, so the spec stays plain data for the run's JSON and client processes)
    prompt_wav: str | None = None
    prompt_text: str = ""
    distinct_prompts: bool = False  # ... another recording in every request (a content-keyed cache never hits)

    def text(self, index: int) -> str:
        return self.texts[index % len(self.texts)]

    @property
    def expected_audio_s(self) -> float | None:
        return None if self.force_tokens is None else self.force_tokens * SAMPLES_PER_TOKEN / self.sample_rate


def endpoint_url(url: str, target: str) -> str:
    """`url` is a server root (the target's path is appended) or already a full endpoint URL."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    path = parts.path if parts.path not in ("", "/") else PATHS[target]
    scheme = parts.scheme
    if target == "ws":
        scheme = {"http": "ws", "https": "wss"}.get(scheme, scheme)
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


def server_root(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, "", "", ""))


def build_body(target: str, spec: RequestSpec, index: int) -> dict[str, Any]:
    """The JSON body of request `index` (for "ws": the `start` message, without the text).

    Fields follow server/protocol.py: TTSRequest / WsStart are flat and forbid unknown fields;
    SpeechRequest takes `seed` and `force_tokens` as extensions (sent only when set).
    """
    if target == "openai":
        body: dict[str, Any] = {"model": spec.model, "input": spec.text(index), "voice": spec.voice,
                                "response_format": "pcm", "stream": True, "seed": spec.seed,
                                "force_tokens": spec.force_tokens}
        return {k: v for k, v in body.items() if v is not None}
    prompt_text = spec.prompt_text if spec.prompt_wav else None
    body = {"voice": spec.voice, "prompt_text": prompt_text, "mode": spec.mode, "stream": True,
            "response_format": "pcm", "force_tokens": spec.force_tokens, "first_hop": spec.first_hop, "seed": spec.seed,
            "greedy": spec.greedy or None}
    body = {k: v for k, v in body.items() if v is not None}  # unset: the server's default
    if target == "ws":
        return {"type": "start", **body, **({"prompt_wav": True} if spec.prompt_wav else {})}
    return {"text": spec.text(index), **body}


def form_fields(body: dict[str, Any]) -> dict[str, str]:
    """A JSON body as multipart form fields (the server parses them with the same schema)."""
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in body.items()}


def ws_messages(spec: RequestSpec, index: int, prompt: bytes | None = None) -> list[dict[str, Any] | bytes]:
    """start, the prompt recording (a binary frame) when there is one, the text, end."""
    return [build_body("ws", spec, index), *([prompt] if prompt is not None else []),
            {"type": "text", "text": spec.text(index)}, {"type": "end"}]


class PcmCounter:
    """Turns received bytes into whole PCM16 samples; skips a leading RIFF/WAV header."""

    def __init__(self) -> None:
        self.head = b""  # bytes held back until we know whether a WAV header starts the stream
        self.is_raw: bool | None = None
        self.num_bytes = 0
        self.num_samples = 0

    def add(self, data: bytes) -> int:
        """Feed bytes; return how many new complete samples they finish."""
        if self.is_raw is None:
            self.head += data
            data = self._strip_header()
            if self.is_raw is None:
                return 0
        self.num_bytes += len(data)
        total = self.num_bytes // BYTES_PER_SAMPLE  # a sample split across two pieces counts once whole
        new, self.num_samples = total - self.num_samples, total
        return new

    def _strip_header(self) -> bytes:
        head = self.head
        if len(head) < 4 and b"RIFF".startswith(head):
            return b""
        if not head.startswith(b"RIFF"):
            self.is_raw = True
            return head
        pos = 12  # RIFF size WAVE, then chunks: id(4) size(4) payload
        while pos + 8 <= len(head):
            size = int.from_bytes(head[pos + 4:pos + 8], "little")
            if head[pos:pos + 4] == b"data":
                self.is_raw = False
                return head[pos + 8:]
            pos += 8 + size + (size & 1)
        return b""


def _server_time_s(value: str | None) -> float | None:
    """The server's own time from the request's arrival to its response (`Server-Timing: app;dur=<ms>`)."""
    for metric in (value or "").split(","):
        name, *params = (part.strip() for part in metric.split(";"))
        for param in params if name == "app" else ():
            key, _, number = param.partition("=")
            if key == "dur":
                try:
                    return float(number) / 1000
                except ValueError:
                    return None
    return None


def _refuse(timeline: Timeline, status: int, headers: Any) -> None:
    """A refusal, with the server's own answer time beside the client's (a loaded client adds its lag)."""
    timeline.refuse(status, _retry_after(headers.get("retry-after")))
    server_s = _server_time_s(headers.get("server-timing"))
    if server_s is not None:
        timeline.record.server = {"refusal_s": server_s}


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: rare from a TTS server, not worth parsing


class PromptBytes:
    """The recording each request uploads: the spec's file, or with `distinct_prompts` another one every time
    (its last two 16-bit samples hold this process's id and a counter: the same length and voice, other
    bytes, so the server analyses each as a new recording, as with a caller's voice cloned per call)."""

    def __init__(self, spec: RequestSpec) -> None:
        self.audio = Path(spec.prompt_wav).read_bytes() if spec.prompt_wav else None
        self.distinct = spec.distinct_prompts
        self._count = itertools.count()
        self._process = (os.getpid() & 0xFFFF) << 16

    def next(self) -> bytes | None:
        if self.audio is None or not self.distinct:
            return self.audio
        tag = (self._process | next(self._count) & 0xFFFF).to_bytes(4, "little")
        return self.audio[:-4] + tag


def multipart_body(fields: dict[str, str], file_field: str, filename: str, data: bytes, content_type: str
                   ) -> tuple[bytes, str]:
    """(multipart/form-data body, its Content-Type header) of text fields and one file."""
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{file_field}"; filename="{filename}"'
                 f'\r\nContent-Type: {content_type}\r\n\r\n'.encode() + data + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


class _Http1:
    """One keep-alive HTTP/1.1 connection on asyncio streams: a request, its status and headers, its body."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def request(self, head: bytes, body: bytes) -> tuple[int, dict[str, str]]:
        self.writer.write(head + body)
        lines = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        version, status, *_ = lines[0].split(" ", 2) + [""]
        if not version.startswith("HTTP/1.") or not status.isdigit():
            raise ConnectionError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                key, value = line.split(":", 1)
                headers[key.strip().lower()] = value.strip()
        return int(status), headers

    async def body(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunked, Content-Length, or up to the connection's end)."""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
                if size == 0:
                    while await self.reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                        pass
                    return
                data = await self.reader.readexactly(size + 2)
                yield data[:-2]
        elif "content-length" in headers:
            left = int(headers["content-length"])
            while left > 0:
                data = await self.reader.read(min(left, 1 << 16))
                if not data:
                    raise ConnectionError("connection closed inside the response body")
                left -= len(data)
                yield data
        else:
            while data := await self.reader.read(1 << 16):
                yield data

    def close(self) -> None:
        self.writer.close()


class HttpClient:
    """POSTs to `/v1/tts` or `/v1/audio/speech` and reads the chunked PCM body, over HTTP/1.1 written here on
    asyncio streams. Each request in flight has a connection of its own, kept alive for a later request, as
    independent users would.

    PERF: the load generator's own CPU is part of what it measures at high concurrency (a closed-loop wave of 16
    requests leaves one Python process one after another), and most of all with a recording uploaded in every
    request: a general HTTP client's multipart upload left the server the whole body tens of ms after its
    headers (docs/benchmarks.md, "Registered voice and zero-shot").
    """

    def __init__(self, url: str, target: str, spec: RequestSpec, timeout_s: float, origin_s: float) -> None:
        self.url, self.target, self.spec = endpoint_url(url, target), target, spec
        self.timeout_s, self.origin_s = timeout_s, origin_s
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url: expected http(s)://host[:port][/path], got {url!r}")
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.authority = parts.netloc.rsplit("@", 1)[-1]
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._idle: list[_Http1] = []
        self._prompt = PromptBytes(spec)

    def _payload(self, index: int) -> tuple[bytes, str]:
        body = build_body(self.target, self.spec, index)
        prompt = self._prompt.next()
        if prompt is None:
            return json.dumps(body).encode(), "application/json"
        return multipart_body(form_fields(body), "prompt_wav", "prompt.wav", prompt, "audio/wav")

    async def _connection(self) -> tuple[_Http1, bool]:
        """An idle kept-alive connection (True: reused), else a new one; idle ones the server has closed meanwhile
        are dropped."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.reader.at_eof():
                return conn, True
            conn.close()
        return await self._new_connection(), False

    async def _new_connection(self) -> _Http1:
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.tls)
        return _Http1(reader, writer)

    async def _request(self, head: bytes, body: bytes) -> tuple[_Http1, int, dict[str, str]]:
        """Send on a connection; a kept-alive one that the server closed before answering (its idle timeout
        racing this request: no byte of a response came back, so the server did not take the request) is
        replaced by a new connection once, as HTTP clients do."""
        conn, reused = await self._connection()
        try:
            return conn, *await conn.request(head, body)
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as exc:
            conn.close()
            if not reused or (isinstance(exc, asyncio.IncompleteReadError) and exc.partial):
                raise
        except BaseException:
            conn.close()
            raise
        conn = await self._new_connection()
        try:
            return conn, *await conn.request(head, body)
        except BaseException:
            conn.close()
            raise

    async def send(self, level: str, index: int) -> RequestRecord:
        timeline = Timeline(level, index, self.origin_s, self.spec.sample_rate, self.spec.expected_audio_s)
        body, content_type = self._payload(index)
        head = (f"POST {self.path} HTTP/1.1\r\nHost: {self.authority}\r\nAccept: */*\r\n"
                f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n").encode()

        async def stream() -> None:
            conn, status, headers = await self._request(head, body)
            reusable = False
            try:
                timeline.record.status = status
                if status != 200:
                    text = b"".join([data async for data in conn.body(headers)]).decode(errors="replace")
                    if status in REFUSAL_STATUSES and error_code(text) != "engine_dead":
                        _refuse(timeline, status, headers)
                    else:
                        timeline.fail(f"HTTP {status}: {text[:MAX_ERROR_BODY]}", status)
                else:
                    _keep_request_id(timeline, headers.get("x-request-id"))
                    pcm = PcmCounter()
                    async for data in conn.body(headers):
                        timeline.audio(pcm.add(data))
                reusable = headers.get("connection", "").lower() != "close" and (
                    "content-length" in headers or "chunked" in headers.get("transfer-encoding", "").lower())
            finally:
                if reusable:
                    self._idle.append(conn)
                else:  # a request cut short (time limit, error) leaves its connection mid-response
                    conn.close()

        return await run_timed(stream, timeline, self.timeout_s)

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


def _keep_request_id(timeline: Timeline, request_id: str | None) -> None:
    """The server's id of a request (X-Request-Id), for reading its stage times after the level."""
    if request_id:
        timeline.record.server = {"request_id": request_id}


def server_view(report: dict[str, Any]) -> dict[str, Any]:
    """A server's account of one request (our `done` event or GET /v1/requests/{id}) as a record's `server`:
    the engine's stage times flat (what the first-audio breakdown reads) beside the server's own fields."""
    flat = {k: v for k, v in report.items() if k not in ("type", "times")}
    return {**flat, **(report.get("times") or {})}


async def fetch_server_times(url: str, records: list[RequestRecord], timeout_s: float = 10.0,
                             parallel: int = 8) -> int:
    """Fill each record that holds only the server's request id with GET /v1/requests/{id}, after its level
    (nothing here is timed). Returns how many were filled; a server without the endpoint (not ours, or
    older) is left alone after the first answer that is not ours."""
    pending = [r for r in records if set(r.server) == {"request_id"}]
    if not pending:
        return 0
    root, gate, filled = server_root(url), asyncio.Semaphore(parallel), 0
    unsupported = asyncio.Event()

    async def fill(client: httpx.AsyncClient, record: RequestRecord) -> None:
        nonlocal filled
        async with gate:
            if unsupported.is_set():
                return
            try:
                response = await client.get(f"{root}/v1/requests/{record.server['request_id']}")
                if response.status_code == 200:
                    record.server = server_view(response.json())
                    filled += 1
                elif error_code(response.text) != "request_not_found":  # no such endpoint: stop asking
                    unsupported.set()
            except (httpx.HTTPError, ValueError, AttributeError):  # gone, or not our JSON: the times stay unknown
                unsupported.set()

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), trust_env=False) as client:
        await asyncio.gather(*(fill(client, r) for r in pending))
    return filled


def make_client(url: str, target: str, spec: RequestSpec, timeout_s: float, origin_s: float
                ) -> HttpClient | WsClient:
    """The client of a target: WebSocket sessions for "ws", else HTTP (`HttpClient`)."""
    if target == "ws":
        return WsClient(url, spec, timeout_s, origin_s)
    return HttpClient(url, target, spec, timeout_s, origin_s)


def _handshake_status(exc: Exception) -> int | None:
    """The HTTP status of a refused WebSocket handshake (websockets >= 14 and the legacy API)."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None) or getattr(exc, "status_code", None)
    return int(status) if status is not None else None


def _connect_kwargs() -> dict[str, Any]:
    kwargs: dict[str, Any] = {"max_size": None}  # audio frames of any size
    if "proxy" in inspect.signature(websockets.connect).parameters:
        kwargs["proxy"] = None  # websockets >= 15 reads proxy settings from the environment otherwise
    return kwargs


class WsClient:
    """One WebSocket session per request: start (and the prompt recording), text, end; then audio frames
    until `done`."""

    def __init__(self, url: str, spec: RequestSpec, timeout_s: float, origin_s: float) -> None:
        self.url, self.spec, self.timeout_s, self.origin_s = endpoint_url(url, "ws"), spec, timeout_s, origin_s
        self.connect_kwargs = _connect_kwargs()
        self._prompt = PromptBytes(spec)

    async def send(self, level: str, index: int) -> RequestRecord:
        timeline = Timeline(level, index, self.origin_s, self.spec.sample_rate, self.spec.expected_audio_s)

        async def stream() -> None:
            try:
                connection = websockets.connect(self.url, open_timeout=self.timeout_s, **self.connect_kwargs)
                async with connection as ws:
                    await self._session(ws, timeline, index)
            except Exception as exc:
                status = _handshake_status(exc)
                if status in REFUSAL_STATUSES:
                    timeline.refuse(status)
                elif status is not None:
                    timeline.fail(f"WebSocket handshake: HTTP {status}", status)
                else:
                    raise

        return await run_timed(stream, timeline, self.timeout_s)

    async def aclose(self) -> None:
        """Nothing to close: each session has its own connection, closed when it ends."""

    async def _session(self, ws: Any, timeline: Timeline, index: int) -> None:
        # send concurrently with reading: a server may answer `start` with an error and close early
        sender = asyncio.ensure_future(self._send_all(ws, index))
        pcm = PcmCounter()
        try:
            async for message in ws:
                if isinstance(message, bytes):
                    timeline.audio(pcm.add(message))
                elif self._on_event(json.loads(message), timeline):
                    return
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sender

    async def _send_all(self, ws: Any, index: int) -> None:
        for message in ws_messages(self.spec, index, self._prompt.next()):
            await ws.send(message if isinstance(message, bytes) else json.dumps(message))

    @staticmethod
    def _on_event(event: dict[str, Any], timeline: Timeline) -> bool:
        """Handle one JSON event; True when the session is over."""
        kind = event.get("type")
        if kind == "done":
            timeline.record.server = server_view(event)
            return True
        if kind == "error":
            # ours: {"type": "error", "error": {"code", "message", "field"}}; others: flat fields
            detail = event["error"] if isinstance(event.get("error"), dict) else event
            code = detail.get("code", detail.get("status"))
            if code in REFUSAL_STATUSES or code == "overloaded":
                timeline.refuse(code if isinstance(code, int) else 503, detail.get("retry_after_s"))
            else:
                timeline.fail(f"server error: {code}: {detail.get('message', '')}".rstrip(": "))
            return True
        return False


async def register_voice(url: str, name: str, prompt_text: str, prompt_wav: str | Path,
                         timeout_s: float = 60.0) -> str:
    """POST /v1/voices; returns "registered" or "exists". Other answers raise RuntimeError."""
    data = {"name": name, "prompt_text": prompt_text}
    files = {"prompt_wav": (Path(prompt_wav).name, Path(prompt_wav).read_bytes(), "audio/wav")}
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        response = await client.post(f"{server_root(url)}/v1/voices", data=data, files=files)
    if response.status_code in (200, 201):
        return "registered"
    if response.status_code == 409 or (response.status_code == 400 and "exist" in response.text.lower()):
        return "exists"
    raise RuntimeError(f"voice registration: HTTP {response.status_code}: {response.text[:MAX_ERROR_BODY]}")
