"""What the hop from a Ray replica to its engine process costs (scale/engine_process.py), on a CPU, without Ray.

    python3 benchmarks/engine_hop.py --model-dir MODEL [--requests 200] [--concurrency 1,8]

Starts one engine process whose synthesis is the stand-in of benchmarks/scale_overhead.py (every request gets the
standard workload's four chunks on a fixed timetable, the first FIRST_CHUNK_S after submission), and sends
`--requests` requests through the replica's ASGI side (its headers layer and the forwarder), called directly in
this process as Ray's replica calls it (`--direct`: straight to the engine process over the same socket). For each
concurrency: the time to the first audio byte and to the end over the timetable (the hop and the engine process's
own server, both ways), and this process's CPU time per request, which is what a replica spends forwarding (on a
GPU machine, CPU the replica's process spends apart from the engine's).
Run from the repository root (the engine process imports the stand-in from `benchmarks`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.scale_overhead import CHUNK_GAP_S, CHUNK_TOKENS, FIRST_CHUNK_S, HOOK  # noqa: E402


async def one_request(app: Any, body: bytes, index: int) -> tuple[float, float]:
    """(first audio byte, end) in seconds after the call, one POST /v1/tts through `app`."""
    t0 = time.perf_counter()
    first: float | None = None
    given = False

    async def receive() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal first
        if message["type"] == "http.response.start" and message["status"] != 200:
            raise RuntimeError(f"status {message['status']}")
        if message["type"] == "http.response.body" and message.get("body") and first is None:
            first = time.perf_counter() - t0

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/tts", "raw_path": b"/v1/tts", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"replica"), (b"content-type", b"application/json"),
                         (b"x-request-id", f"hop-{index}".encode())],
             "client": ("127.0.0.1", 40000 + index % 1000), "server": ("127.0.0.1", 8000), "state": {}}
    await app(scope, receive, send)
    assert first is not None
    return first, time.perf_counter() - t0


async def level(app: Any, body: bytes, requests: int, concurrency: int) -> dict[str, Any]:
    queue = list(range(requests))
    firsts: list[float] = []
    ends: list[float] = []

    async def stream() -> None:
        while queue:
            first, end = await one_request(app, body, queue.pop())
            firsts.append(first)
            ends.append(end)

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    timetable_end = FIRST_CHUNK_S + CHUNK_GAP_S * (len(CHUNK_TOKENS) - 1)
    q = statistics.quantiles
    return {"concurrency": concurrency, "requests": requests,
            "first_over_timetable_ms": {"p50": 1000 * (statistics.median(firsts) - FIRST_CHUNK_S),
                                        "p90": 1000 * (q(firsts, n=10)[-1] - FIRST_CHUNK_S)},
            "end_over_timetable_ms": {"p50": 1000 * (statistics.median(ends) - timetable_end)},
            "replica_cpu_ms_per_request": 1000 * cpu / requests, "req_per_s": requests / wall}


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    from fastapi.responses import JSONResponse

    from cosystream.scale.engine_process import EngineProcess, Forwarder
    from cosystream.scale.ray_app import ReplicaSpec, _ReplicaHeaders
    from cosystream.server.state import ServerSettings

    spec = ReplicaSpec(model_dir=args.model_dir, device="cpu", voice_store="file",
                       voices_db=str(Path(args.work) / "voices.db"), engine_kwargs={"first_audio_budget_s": None},
                       settings=ServerSettings(warmup=False), log_level="warning", engine_hook=HOOK)
    engine = await EngineProcess.start(spec, "hop", "cpu", None)

    async def cluster(route: str, scope: Any) -> Any:
        return JSONResponse({})

    async def announce(name: str) -> None:
        return None

    forwarder = Forwarder(engine, cluster, announce, spec.settings.max_upload_bytes)
    app = _Direct(engine) if args.direct else _ReplicaHeaders(forwarder, "hop")
    body = json.dumps({"text": "Hi there.", "response_format": "pcm", "force_tokens": sum(CHUNK_TOKENS)}).encode()
    try:
        await level(app, body, 20, 1)  # warm: connections, the app's first requests
        return [await level(app, body, args.requests, c) for c in args.concurrency]
    finally:
        await engine.close()
        engine.stop()


class _Direct:
    """The engine process called straight through the replica's session, neither its headers layer nor the
    forwarder in between (`--direct`: the floor under the forwarder's figures)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = (await receive())["body"]
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        async with self.engine.session.post("http://engine/v1/tts", data=body, headers=headers) as response:
            await send({"type": "http.response.start", "status": response.status, "headers": []})
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8])
    parser.add_argument("--work", default="/tmp/engine_hop")
    parser.add_argument("--direct", action="store_true", help="straight to the engine process (the floor)")
    args = parser.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    for row in asyncio.run(main_async(args)):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
