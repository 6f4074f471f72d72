"""Soak test: minutes of mixed load with random client disconnects against the real server on the CPU.

Starts `cosystream serve` as a subprocess (tiny model: --model-dir, else a random one written by
cosystream.testing.random_model) and drives it with `--concurrency` clients looping over a mix of
/v1/tts (registered voice, raw PCM), /v1/audio/speech (WAV), the WebSocket (text pieces), zero-shot
/v1/tts with an uploaded prompt, and register → synthesise → delete of a throw-away voice. Each request
hangs up early with probability --disconnect-prob. It checks that every completed stream is whole
(forced token counts give exact lengths; WAV must parse), that /ready stays up, that the server's RSS,
open file descriptors and threads stay flat after warm-up, and that the engine is idle at the end.

    python benchmarks/soak.py --minutes 5 --concurrency 8 --disconnect-prob 0.3 --json soak.json

Exit status 0 when every check passed. Figures for docs/reliability.md come from the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import soundfile as sf
from websockets.asyncio.client import connect

from cosystream.testing.audio import tone_wav

REPO = Path(__file__).resolve().parents[1]
SAMPLES_PER_TOKEN = 960  # 24 kHz / 25 speech tokens per s
VOICE, VOICE_TEXT = "soak", "Hello there, this is the soak voice."
TEXTS = ["Hello there, how are you today?", "The quick brown fox jumps over the lazy dog.",
         "Streaming speech keeps going.", "One more sentence for the soak."]
KINDS = {"tts": 3, "speech": 3, "ws": 2, "zero_shot": 1, "voice_churn": 1}  # relative weights
START_TIMEOUT_S = 180


@dataclass
class Sample:
    """The server process and its engine at one moment."""

    t_s: float
    rss_bytes: int
    num_fds: int
    num_threads: int
    ready: bool
    engine: dict[str, float]


@dataclass
class Tally:
    requests: Counter = field(default_factory=Counter)  # by kind
    completed: Counter = field(default_factory=Counter)
    disconnects: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    error_samples: list[str] = field(default_factory=list)

    def record(self, kind: str, outcome: str) -> None:
        self.requests[kind] += 1
        if outcome == "completed":
            self.completed[kind] += 1
        elif outcome == "disconnected":
            self.disconnects[kind] += 1
        else:
            self.errors[kind] += 1
            if len(self.error_samples) < 20:
                self.error_samples.append(f"{kind}: {outcome}")


# ---------------------------------------------------------------- the server process

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_dir: Path, work: Path, port: int, max_streams: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "cosystream.cli", "serve", "--model-dir", str(model_dir), "--port", str(port),
           "--device", "cpu", "--voices-db", str(work / "voices.db"), "--max-streams", str(max_streams),
           "--log-level", "warning",
           # every request is to run: the soak checks a server under continuous load for leaks and broken
           # streams, and on a CPU the admission budget would refuse most of its load
           "--first-audio-budget-s", "off"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(work / "server.log", "w"))


def proc_figures(pid: int) -> tuple[int, int, int]:
    """(RSS bytes, open fds, threads) of a process, from /proc (psutil when /proc is missing)."""
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        rss = int(fields["VmRSS"].split()[0]) * 1024
        return rss, len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"])
    import psutil

    proc = psutil.Process(pid)
    return proc.memory_info().rss, proc.num_fds(), proc.num_threads()


async def engine_gauges(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    out = {}
    for line in text.splitlines():
        if line.startswith("cosystream_engine_"):
            name, value = line.rsplit(" ", 1)
            out[name[len("cosystream_engine_"):]] = float(value)
    return out


async def sample(client: httpx.AsyncClient, pid: int, t0: float) -> Sample:
    ready = (await client.get("/ready")).status_code == 200
    rss, fds, threads = proc_figures(pid)
    return Sample(round(time.monotonic() - t0, 1), rss, fds, threads, ready, await engine_gauges(client))


async def wait_ready(client: httpx.AsyncClient, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode}")
        try:
            if (await client.get("/ready")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError("the server did not become ready")


# ---------------------------------------------------------------- one request of each kind


def whole_pcm(data: bytes, num_tokens: int) -> str:
    want = 2 * SAMPLES_PER_TOKEN * num_tokens
    return "completed" if len(data) == want else f"incomplete pcm: {len(data)} bytes, expected {want}"


def whole_wav(data: bytes, num_tokens: int) -> str:
    try:
        audio, rate = sf.read(io.BytesIO(data), dtype="float32")
    except Exception as exc:  # any parse failure is a broken stream
        return f"invalid wav: {exc}"
    if rate != 24000 or audio.shape[0] != SAMPLES_PER_TOKEN * num_tokens or not np.isfinite(audio).all():
        return f"wrong wav: {audio.shape[0]} samples at {rate} Hz, expected {SAMPLES_PER_TOKEN * num_tokens}"
    return "completed"


async def read_http(response: httpx.Response, leave_after: int | None) -> bytes | None:
    """The whole body, or None after `leave_after` pieces (the client hangs up)."""
    if response.status_code != 200:
        raise RuntimeError(f"status {response.status_code}: {(await response.aread())[:200]!r}")
    data, num_pieces = bytearray(), 0
    async for piece in response.aiter_raw():
        data += piece
        num_pieces += 1
        if leave_after is not None and num_pieces >= leave_after:
            return None  # leaving the stream context closes the connection mid-body
    return bytes(data)


async def http_request(client: httpx.AsyncClient, path: str, leave_after: int | None, check, num_tokens: int,
                       **kw: Any) -> str:
    async with client.stream("POST", path, **kw) as response:
        data = await read_http(response, leave_after)
    return "disconnected" if data is None else check(data, num_tokens)


async def run_ws(base_ws: str, text: str, num_tokens: int, leave_after: int | None) -> str:
    frames, done = bytearray(), None
    async with connect(base_ws + "/v1/tts/stream", open_timeout=60) as ws:
        await ws.send(json.dumps({"type": "start", "voice": VOICE, "response_format": "pcm",
                                  "force_tokens": num_tokens}))
        for word in text.split():
            await ws.send(json.dumps({"type": "text", "text": word + " "}))
        await ws.send(json.dumps({"type": "end"}))
        async for message in ws:
            if isinstance(message, bytes):
                frames += message
                if leave_after is not None and (leave_after := leave_after - 1) <= 0:
                    return "disconnected"  # leaving the block closes the socket mid-stream
                continue
            event = json.loads(message)
            if event["type"] in ("done", "error"):
                done = event
                break
    if done is None or done["type"] != "done":
        return f"ws ended without done: {done}"
    if done["num_samples"] != SAMPLES_PER_TOKEN * num_tokens:
        return f"ws done says {done['num_samples']} samples"
    return whole_pcm(bytes(frames), num_tokens)


async def voice_churn(client: httpx.AsyncClient, rng: random.Random, num_tokens: int,
                      leave_after: int | None) -> str:
    name = f"churn-{rng.getrandbits(40):x}"
    files = {"prompt_wav": ("p.wav", tone_wav(seed=rng.randrange(100)), "audio/wav")}
    added = await client.post("/v1/voices", data={"name": name, "prompt_text": VOICE_TEXT}, files=files)
    if added.status_code != 201:
        return f"register: {added.status_code} {added.text[:200]}"
    try:
        return await http_request(client, "/v1/tts", leave_after, whole_pcm, num_tokens, json={
            "text": rng.choice(TEXTS), "voice": name, "force_tokens": num_tokens, "response_format": "pcm"})
    finally:
        deleted = await client.delete(f"/v1/voices/{name}")
        if deleted.status_code not in (200, 204):
            raise RuntimeError(f"delete: {deleted.status_code} {deleted.text[:200]}")


async def one_request(kind: str, client: httpx.AsyncClient, base_ws: str, rng: random.Random,
                      leave_after: int | None) -> str:
    n, text = rng.randint(20, 120), rng.choice(TEXTS)
    if kind == "tts":
        return await http_request(client, "/v1/tts", leave_after, whole_pcm, n, json={
            "text": text, "voice": VOICE, "force_tokens": n, "response_format": "pcm", "seed": rng.randrange(99)})
    if kind == "speech":
        return await http_request(client, "/v1/audio/speech", leave_after, whole_wav, n, json={
            "model": "cosyvoice2", "input": text, "voice": VOICE, "response_format": "wav", "force_tokens": n})
    if kind == "zero_shot":
        files = {"prompt_wav": ("p.wav", tone_wav(seed=rng.randrange(100)), "audio/wav")}
        data = {"text": text, "prompt_text": VOICE_TEXT, "force_tokens": str(n), "response_format": "pcm"}
        return await http_request(client, "/v1/tts", leave_after, whole_pcm, n, data=data, files=files)
    if kind == "ws":
        return await run_ws(base_ws, text, n, leave_after)
    return await voice_churn(client, rng, n, leave_after)


# ---------------------------------------------------------------- load and checks

async def client_loop(worker: int, args: argparse.Namespace, base: str, deadline: float, tally: Tally) -> None:
    rng = random.Random(args.seed * 1000 + worker)
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        while time.monotonic() < deadline:
            kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
            leave_after = rng.randint(1, 3) if rng.random() < args.disconnect_prob else None
            try:
                outcome = await one_request(kind, client, "ws" + base[len("http"):], rng, leave_after)
            except Exception as exc:  # counted; the soak goes on
                outcome = f"{type(exc).__name__}: {exc}"
            tally.record(kind, outcome)


async def monitor(client: httpx.AsyncClient, pid: int, t0: float, stop: asyncio.Event, every_s: float,
                  samples: list[Sample]) -> None:
    while not stop.is_set():
        samples.append(await sample(client, pid, t0))
        with contextlib.suppress(TimeoutError):  # the wait is the sampling period
            await asyncio.wait_for(stop.wait(), every_s)


async def settle(client: httpx.AsyncClient, timeout_s: float = 60) -> dict[str, float]:
    """Engine gauges once no request is left in it (aborts land a moment after the last hang-up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = await engine_gauges(client)
        idle = gauges.get("num_active") == 0 and gauges.get("queue_depth") == 0
        if idle or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(0.2)


def rss_trend_mb(samples: list[Sample]) -> float:
    """Median RSS of the last third of the samples minus that of the first third, MiB. Medians, because the
    allocator makes RSS swing by tens of MiB from one sample to the next; a leak moves both thirds' level."""
    third = max(1, len(samples) // 3)
    first = float(np.median([s.rss_bytes for s in samples[:third]]))
    last = float(np.median([s.rss_bytes for s in samples[-third:]]))
    return (last - first) / 2**20


def checks(args: argparse.Namespace, tally: Tally, samples: list[Sample], final: Sample) -> dict[str, bool]:
    warm = [s for s in samples if s.t_s >= args.warmup_s] or samples[-1:]
    base, eng = warm[0], final.engine
    return {
        "no_errors": sum(tally.errors.values()) == 0,
        "all_kinds_completed": all(tally.completed[k] > 0 for k in KINDS),
        "always_ready": all(s.ready for s in samples) and final.ready,
        "rss_flat": rss_trend_mb([*warm, final]) <= args.max_rss_growth_mb,
        "fds_flat": final.num_fds - base.num_fds <= args.max_fd_growth,
        "threads_flat": final.num_threads - base.num_threads <= args.max_thread_growth,
        "engine_idle": eng.get("num_active") == 0 and eng.get("queue_depth") == 0
        and eng.get("num_free_slots") == args.max_streams
        and eng.get("num_free_flow_slots") == eng.get("num_flow_slots"),
        "voice_caches_flat": eng.get("num_voice_prompts", 0) <= base.engine.get("num_voice_prompts", 0) + 1,
    }


async def drive(args: argparse.Namespace, model_dir: Path, work: Path) -> dict[str, Any]:
    port = free_port()
    server = start_server(model_dir, work, port, args.max_streams)
    base, tally, samples = f"http://127.0.0.1:{port}", Tally(), []
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            await wait_ready(client, server)
            files = {"prompt_wav": ("v.wav", tone_wav(), "audio/wav")}
            (await client.post("/v1/voices", data={"name": VOICE, "prompt_text": VOICE_TEXT}, files=files)
             ).raise_for_status()
            t0, stop = time.monotonic(), asyncio.Event()
            watcher = asyncio.create_task(monitor(client, server.pid, t0, stop, args.sample_s, samples))
            deadline = t0 + args.minutes * 60
            await asyncio.gather(*(client_loop(w, args, base, deadline, tally) for w in range(args.concurrency)))
            stop.set()
            await watcher
            await settle(client)
            final = await sample(client, server.pid, t0)
    finally:
        server.terminate()
        server.wait(timeout=60)
    return report(args, tally, samples, final)


def report(args: argparse.Namespace, tally: Tally, samples: list[Sample], final: Sample) -> dict[str, Any]:
    result = checks(args, tally, samples, final)
    warm = [s for s in samples if s.t_s >= args.warmup_s] or samples[-1:]
    return {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "requests": sum(tally.requests.values()), "completed": sum(tally.completed.values()),
        "disconnects": sum(tally.disconnects.values()), "errors": sum(tally.errors.values()),
        "by_kind": {k: {"requests": tally.requests[k], "completed": tally.completed[k],
                        "disconnects": tally.disconnects[k], "errors": tally.errors[k]} for k in KINDS},
        "error_samples": tally.error_samples,
        "start": asdict(samples[0]), "after_warmup": asdict(warm[0]), "end": asdict(final),
        "peak_rss_bytes": max(s.rss_bytes for s in [*samples, final]),
        "rss_trend_after_warmup_mb": round(rss_trend_mb([*warm, final]), 1),
        "series": [(s.t_s, round(s.rss_bytes / 2**20, 1), s.num_fds, s.num_threads) for s in [*samples, final]],
        "checks": result, "ok": all(result.values()),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--disconnect-prob", type=float, default=0.3)
    p.add_argument("--model-dir", type=Path, default=None, help="default: a random tiny model in a temp dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-streams", type=int, default=8)
    p.add_argument("--warmup-s", type=float, default=None, help="default: a fifth of the run, at most 60 s")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between resource samples")
    p.add_argument("--max-rss-growth-mb", type=float, default=64.0)
    p.add_argument("--max-fd-growth", type=int, default=8)
    p.add_argument("--max-thread-growth", type=int, default=4)
    p.add_argument("--json", type=Path, default=None, help="write the full result here")
    args = p.parse_args(argv)
    if args.warmup_s is None:
        args.warmup_s = min(60.0, args.minutes * 12)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cosystream-soak-") as tmp:
        work = Path(tmp)
        model_dir = args.model_dir
        if model_dir is None:
            from cosystream.testing.random_model import random_checkpoint

            model_dir = random_checkpoint(work / "model", "tiny", seed=args.seed)
        result = asyncio.run(drive(args, Path(model_dir), work))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({k: result[k] for k in ("requests", "completed", "disconnects", "errors", "checks", "ok")},
                     indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
