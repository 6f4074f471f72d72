"""The HTTP server's own cost per request, with a fake engine (no model, no GPU): CPU time and admission delay.

    python benchmarks/server_overhead.py [--streams 16] [--waves 150] [--http h11|httptools] [--loop asyncio|uvloop]

Starts `cosystream.server.app.build_app` around the server tests' fake engine (tests/server/fake_engine.py) in a
child process under uvicorn with the given HTTP parser and event loop, then sends waves of `--streams`
concurrent `/v1/tts` requests (closed loop, one keep-alive connection each, as `cosystream bench`). The fake
engine holds each wave until its last request has arrived, then streams two 1 s chunks to every request.
Prints, over the waves after the first, how long after a wave's first send its last request reached the engine
(the admission a burst's last request waits for: parsing, validation, routing, one after another on the
server's loop) and the server process's CPU time per request. What the server costs under load on the GPU
machine's slower host CPU is a multiple of this.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def serve(args: argparse.Namespace) -> None:
    """The child: uvicorn around a fake engine that logs (arrival time, own CPU seconds) per request."""
    sys.path.insert(0, str(REPO / "tests" / "server"))
    from dataclasses import replace

    import numpy as np
    import uvicorn
    from fake_engine import FakeEngine

    from cosystream.outputs import AudioChunk
    from cosystream.server.app import build_app
    from cosystream.server.state import ServerSettings

    log = open(args.log, "w", buffering=1)  # noqa: SIM115 - open for the child's life

    class WaveEngine(FakeEngine):
        arrived = 0
        wave: asyncio.Event | None = None

        async def synthesize(self, params):  # type: ignore[override]
            log.write(f"{time.monotonic()} {time.process_time()}\n")
            if self.arrived % args.streams == 0:
                self.wave = asyncio.Event()
            wave = self.wave
            self.arrived += 1
            if self.arrived % args.streams == 0:
                log.write(f"release {time.monotonic()}\n")
                wave.set()
            await wave.wait()
            for index in range(2):
                yield AudioChunk(pcm=np.zeros(24000, np.float32), index=index, is_final=index == 1,
                                 times=self.times if index == 1 else None, request_id=params.request_id or "")

    app = build_app(WaveEngine(max_streams=4 * args.streams), replace(ServerSettings(), warmup=False,
                                                                      close_engine=False))
    config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning", http=args.http,
                            loop=args.loop)
    server = uvicorn.Server(config)
    original_startup = server.startup

    async def startup(sockets=None):
        await original_startup(sockets)
        print("ready", flush=True)

    server.startup = startup  # type: ignore[method-assign]
    server.run()


class RawConnection:
    """A bare HTTP/1.1 keep-alive POST over asyncio streams (chunked responses only): the client side's cost
    without httpx, to tell the load generator's own delay from the server's."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, on_data) -> None:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        reader = self.reader
        assert reader is not None
        headers = await reader.readuntil(b"\r\n\r\n")
        if b"chunked" not in headers.lower():
            raise RuntimeError(f"expected a chunked response: {headers[:200]!r}")
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                return
            on_data(data[:-2])

    async def aclose(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def send_waves(port: int, streams: int, waves: int, raw: bool = False
                     ) -> tuple[list[float], list[list[float]]]:
    import json

    import httpx

    body = {"text": "Hello there, how are you today?", "voice": "alice", "response_format": "pcm"}
    clients = [RawConnection(port) if raw else httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30)
               for _ in range(streams)]

    async def one(client, sends: list[float], firsts: list[float]) -> None:
        sends.append(time.monotonic())
        if raw:
            seen = []

            def on_data(data: bytes) -> None:
                if not seen:
                    seen.append(True)
                    firsts.append(time.monotonic())

            await client.post("/v1/tts", json.dumps(body).encode(), on_data)
            return
        async with client.stream("POST", "/v1/tts", json=body) as response:
            async for _ in response.aiter_bytes():
                if len(firsts) < len(sends) and not getattr(response, "_seen", False):
                    response._seen = True  # type: ignore[attr-defined]
                    firsts.append(time.monotonic())

    first_sends, first_audio = [], []
    for _ in range(waves):
        sends: list[float] = []
        firsts: list[float] = []
        await asyncio.gather(*(one(c, sends, firsts) for c in clients))
        first_sends.append(min(sends))
        first_audio.append(firsts)
    for c in clients:
        await c.aclose()
    return first_sends, first_audio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--waves", type=int, default=150)
    ap.add_argument("--http", default="httptools", choices=["h11", "httptools"])
    ap.add_argument("--loop", default="uvloop", choices=["asyncio", "uvloop"])
    ap.add_argument("--port", type=int, default=8771)
    ap.add_argument("--client", default="httpx", choices=["httpx", "raw"],
                    help="the load's client: httpx (as cosystream bench) or bare asyncio streams")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--log", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args)
        return
    log = Path(f"/tmp/server_overhead_{os.getpid()}.log")
    child = subprocess.Popen([sys.executable, __file__, "--serve", "--log", str(log), "--port", str(args.port),
                              "--streams", str(args.streams), "--http", args.http, "--loop", args.loop],
                             stdout=subprocess.PIPE, text=True)
    try:
        if child.stdout is None or child.stdout.readline().strip() != "ready":
            raise SystemExit("server_overhead: the server did not start")
        first_sends, first_audio = asyncio.run(send_waves(args.port, args.streams, args.waves, args.client == "raw"))
    finally:
        child.terminate()
        child.wait()
    lines = log.read_text().splitlines()
    log.unlink()
    releases = [float(line.split()[1]) for line in lines if line.startswith("release")]
    rows = [tuple(map(float, line.split())) for line in lines if not line.startswith("release")]
    n = args.streams
    waves = [rows[i * n:(i + 1) * n] for i in range(args.waves)]
    admission = [(max(t for t, _ in wave) - sent) * 1e3 for wave, sent in zip(waves[1:], first_sends[1:], strict=True)]
    cpu_ms = (waves[-1][0][1] - waves[1][0][1]) * 1e3 / (n * (args.waves - 2))
    admission.sort()
    # delivery: from the fake engine's release of a wave's chunks to the client's first bytes of each request
    first = sorted((min(f) - r) * 1e3 for f, r in zip(first_audio[1:], releases[1:], strict=True))
    last = sorted((max(f) - r) * 1e3 for f, r in zip(first_audio[1:], releases[1:], strict=True))
    print(f"http={args.http} loop={args.loop} client={args.client} streams={n} waves={args.waves}: "
          f"last request at the engine "
          f"p50 {statistics.median(admission):.1f} / p90 {admission[int(0.9 * len(admission))]:.1f} ms after the "
          f"wave's first send; server CPU {cpu_ms:.3f} ms per request; first audio at the client after the "
          f"engine's release: first request p50 {statistics.median(first):.1f}, last request p50 "
          f"{statistics.median(last):.1f} / p90 {last[int(0.9 * len(last))]:.1f} ms")


if __name__ == "__main__":
    main()
