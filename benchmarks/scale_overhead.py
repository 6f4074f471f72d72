"""What serving through Ray Serve costs, apart from the engine: the single-process server and the Ray app of N
replicas, both serving a stand-in engine on a fixed timetable, on a CPU.

    python3 benchmarks/scale_overhead.py run --model-dir MODEL [--servers single,ray2] [--c1 40] \\
        [--levels 8,32] [--requests 128] [--out DIR]

The engine is the real one built from MODEL (the fixture model is enough: it serves registration, voices,
admission's reports), except that `synthesize` is the stand-in (`standin`): every request gets the standard
workload's audio (250 tokens = 10 s at 24 kHz, in the chunk schedule's 25, 50, 100 and 75-token chunks) from one
"engine" thread, the first chunk FIRST_CHUNK_S after submission and the next every CHUNK_GAP_S (the H200's pace at
one stream), handed to the event loop as the engine hands its chunks (call_soon_threadsafe). So every millisecond
a client sees beyond that timetable, and every CPU second the server's processes spend, is the serving path's:
HTTP, the app, and behind Ray its proxy, router and the proxy-replica transport.

For each server: c=1 (`--c1` requests one after another): client first audio and total time over the timetable,
and the server's stages (`cosystream bench`'s table: arrival to engine, proxy to replica, sent); then the
closed-loop levels (`--levels`, streams over all replicas, `--requests` each): requests/s, first audio, and the
CPU time per request of each server process (single: the server; Ray: the proxy, the replicas, the rest of Ray),
read from /proc around each level. On a GPU machine a replica's CPU time per request is GIL time its engine
thread, which drives the GPU from Python, does not get.

Also the servers on their own: `serve-single --port P` and `serve-ray --replicas N --port P` (what `run` starts).

    python3 benchmarks/scale_overhead.py access-log --model-dir MODEL [--rounds 8] [--requests 256]

Ray Serve's access line per request in the replica, off (the default, ray_app.replica_logging) and on
(`ray_access_log`), alternated in one Ray session: each block deploys the 1-replica app with one setting (a new
replica process), then `--requests` requests at 16 streams, and reads the CPU per request of the replica and of the
proxy. The proxy's setting never changes, so the ratio replica / proxy shows the setting's effect apart from the
shared machine's drift, which moves both.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
HOOK = "benchmarks.scale_overhead:standin"
SAMPLE_RATE = 24000
SAMPLES_PER_TOKEN = 960
CHUNK_TOKENS = (25, 50, 100, 75)  # the standard workload (benchmarks/workload.py): 250 tokens, official schedule
FIRST_CHUNK_S = 0.05
CHUNK_GAP_S = 0.07
FORCE_TOKENS = sum(CHUNK_TOKENS)


class Timetable:
    """One thread that calls each due callback at its time (the stand-in engine thread)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._count = 0
        self._cv = threading.Condition()
        threading.Thread(target=self._run, name="standin-engine", daemon=True).start()

    def at(self, when: float, fn: Callable[[], None]) -> None:
        with self._cv:
            self._count += 1
            heapq.heappush(self._heap, (when, self._count, fn))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.perf_counter():
                    self._cv.wait(None if not self._heap else self._heap[0][0] - time.perf_counter())
                _, _, fn = heapq.heappop(self._heap)
            fn()


def standin(engine: Any) -> Any:
    """The engine with synthesis replaced by the fixed timetable (ReplicaSpec.engine_hook; `serve-single`)."""
    import asyncio

    from cosystream.outputs import AudioChunk, StageTimes

    timetable = Timetable()
    pcm = [np.zeros(n * SAMPLES_PER_TOKEN, np.float32) for n in CHUNK_TOKENS]
    audio_s = FORCE_TOKENS * SAMPLES_PER_TOKEN / SAMPLE_RATE

    async def synthesize(params: Any) -> AsyncIterator[AudioChunk]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[AudioChunk] = asyncio.Queue()
        t0 = time.perf_counter()
        for index, samples in enumerate(pcm):
            is_final = index == len(pcm) - 1
            times = StageTimes(first_audio_s=FIRST_CHUNK_S, total_s=FIRST_CHUNK_S + CHUNK_GAP_S * (len(pcm) - 1),
                               num_tokens=FORCE_TOKENS, audio_s=audio_s) if is_final else None
            chunk = AudioChunk(pcm=samples, index=index, is_final=is_final, times=times,
                               request_id=params.request_id or "")
            timetable.at(t0 + FIRST_CHUNK_S + CHUNK_GAP_S * index,
                         lambda c=chunk: loop.call_soon_threadsafe(queue.put_nowait, c))
        while True:
            chunk = await queue.get()
            yield chunk
            if chunk.is_final:
                return

    engine.synthesize = synthesize
    return engine


# ---------------------------------------------------------------- the servers

def serve_single(model_dir: str, port: int) -> None:
    import uvicorn

    from cosystream.engine.async_engine import AsyncEngine
    from cosystream.server.app import build_app, configure_logging
    from cosystream.server.state import ServerSettings

    configure_logging("warning")
    engine = standin(AsyncEngine.from_pretrained(model_dir, device="cpu", dtype="float32",
                                                 voices_db=f"/tmp/scale_overhead_{port}.db", first_audio_budget_s=None))
    uvicorn.run(build_app(engine, ServerSettings(warmup=False)), host="127.0.0.1", port=port, log_level="warning")


def serve_ray(model_dir: str, port: int, replicas: int) -> None:
    from cosystream.scale.ray_app import serve_replicas

    serve_replicas(_ray_spec(model_dir, port), replicas, "127.0.0.1", port)


def _ray_spec(model_dir: str, port: int) -> Any:
    from cosystream.scale.ray_app import ReplicaSpec
    from cosystream.server.state import ServerSettings

    return ReplicaSpec(model_dir=model_dir, device="cpu", voices_db=f"/tmp/scale_overhead_{port}.db",
                       engine_kwargs={"first_audio_budget_s": None}, settings=ServerSettings(warmup=False),
                       log_level="warning", engine_hook=HOOK)


# ---------------------------------------------------------------- CPU time of a process tree

def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):  # a thread or process that ended meanwhile
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def process_tree(root: int) -> list[int]:
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += _children(pid)
    return pids


def role(pid: int, root: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    if "ProxyActor" in cmd:
        return "proxy"
    if "ServeReplica" in cmd:
        return "replicas"
    if "cosystream.scale.engine_process" in cmd:
        return "engines"
    for part in ("ServeController", "gcs_server", "raylet"):
        if part in cmd:
            return part
    return "server" if pid == root else "ray, other"


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def cpu_by_role(root: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for pid in process_tree(root):
        out[role(pid, root)] = out.get(role(pid, root), 0.0) + cpu_seconds(pid)
    return out


# ---------------------------------------------------------------- the run

def _wait_ready(url: str, server: subprocess.Popen, timeout_s: float = 400.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            ready = httpx.get(url + "/ready", timeout=5)
            if ready.status_code == 200 and ready.json().get("status", "ok") == "ok":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1.0)
    raise RuntimeError("the server was not ready in time")


def _bench(url: str, workload: Path, out: Path, *flags: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "cosystream.cli", "bench", "--url", url, "--target", "tts", "--workload",
           str(workload), "--force-tokens", str(FORCE_TOKENS), "--timeout", "60", "--out", str(out), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True)
    tables = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    print("\n".join(tables), flush=True)
    return json.loads(out.read_text())


def measure(name: str, args: argparse.Namespace, workload: Path, out_dir: Path) -> dict[str, Any]:
    port = args.port
    url = f"http://127.0.0.1:{port}"
    replicas = int(name[3:]) if name.startswith("ray") else 0
    cmd = [sys.executable, __file__, "serve-ray" if replicas else "serve-single", "--model-dir", args.model_dir,
           "--port", str(port)] + (["--replicas", str(replicas)] if replicas else [])
    log = open(out_dir / f"serve_{name}.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    result: dict[str, Any] = {"server": name, "replicas": max(replicas, 1)}
    try:
        _wait_ready(url, server)
        _bench(url, workload, out_dir / f"{name}_warm.json", "--concurrency", "1", "--requests-per-level", "4",
               "--warmup-requests", "0")
        c1 = _bench(url, workload, out_dir / f"{name}_c1.json", "--concurrency", "1", "--requests-per-level",
                    str(args.c1), "--warmup-requests", "0", "--no-register-voice")
        result["c1"] = c1["levels"][0]
        result["c1_stages"] = _stage_means(c1)
        result["levels"] = []
        for level in args.levels:
            before = cpu_by_role(server.pid)
            run = _bench(url, workload, out_dir / f"{name}_c{level}.json", "--concurrency", str(level),
                         "--requests-per-level", str(args.requests), "--warmup-requests", "0", "--no-register-voice")
            after = cpu_by_role(server.pid)
            summary = run["levels"][0]
            ok = max(summary["num_ok"], 1)
            summary["cpu_ms_per_request"] = {k: 1000 * (after.get(k, 0.0) - before.get(k, 0.0)) / ok for k in after}
            result["levels"].append(summary)
    finally:
        server.send_signal(2)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    return result


def _stage_means(run: dict[str, Any]) -> dict[str, float]:
    """Mean server stages (ms) of a run's successful requests: arrival to engine, proxy to replica, sent."""
    keys = ("to_engine_s", "proxy_s", "server_first_audio_s")
    reqs = [r for r in run["requests"] if r.get("level") != "warmup" and r.get("status") == 200]
    out = {}
    for key in keys:
        values = [r["server"][key] for r in reqs if isinstance(r.get("server", {}).get(key), (int, float))]
        if values:
            out[key] = 1000 * sum(values) / len(values)
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = [f"stand-in timetable: first chunk {FIRST_CHUNK_S * 1000:.0f} ms, then every {CHUNK_GAP_S * 1000:.0f} ms "
             f"(total {1000 * (FIRST_CHUNK_S + CHUNK_GAP_S * (len(CHUNK_TOKENS) - 1)):.0f} ms)", "",
             "| server | c=1 first audio p50 / p90 ms | over timetable p50 ms | total p50 ms | arrival to engine / "
             "proxy to replica / sent ms |", "|---|---|---|---|---|"]
    total_s = FIRST_CHUNK_S + CHUNK_GAP_S * (len(CHUNK_TOKENS) - 1)
    for r in results:
        c1, st = r["c1"], r["c1_stages"]
        fa, tot = c1["first_audio_s"], c1["total_s"]
        stages = " / ".join(f"{st[k]:.1f}" if k in st else "-" for k in ("to_engine_s", "proxy_s",
                                                                          "server_first_audio_s"))
        lines.append(f"| {r['server']} | {fa['p50'] * 1000:.1f} / {fa['p90'] * 1000:.1f} | "
                     f"{(fa['p50'] - FIRST_CHUNK_S) * 1000:+.1f} | {tot['p50'] * 1000:.1f} "
                     f"({(tot['p50'] - total_s) * 1000:+.1f}) | {stages} |")
    lines += ["", "| server | streams | ok | req/s | first audio p50 / p99 ms | total p50 ms | CPU ms per request |",
              "|---|---|---|---|---|---|---|"]
    for r in results:
        for lv in r["levels"]:
            cpu = ", ".join(f"{k} {v:.1f}" for k, v in sorted(lv["cpu_ms_per_request"].items()) if v > 0.05)
            fa = lv["first_audio_s"] or {}
            lines.append(f"| {r['server']} | {lv['value']:g} | {lv['num_ok']}/{lv['num_requests']} "
                         f"| {lv['achieved_rate']:.1f} | {fa.get('p50', 0) * 1000:.0f} / {fa.get('p99', 0) * 1000:.0f} "
                         f"| {(lv['total_s'] or {}).get('p50', 0) * 1000:.0f} | {cpu} |")
    return "\n".join(lines) + "\n"


def access_log_ab(args: argparse.Namespace, workload: Path, out_dir: Path) -> str:
    """The replica's CPU per request with Ray's access line off and on, alternated (module docstring)."""
    import ray
    from ray import serve

    from cosystream.scale.ray_app import APP_NAME, RAY_ENV_DEFAULTS, build_application

    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    url = f"http://127.0.0.1:{args.port}"
    spec = _ray_spec(args.model_dir, args.port)
    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(os.cpu_count() or 1, 2))
    rows = ["| round | Ray access line | replica CPU ms per request | proxy CPU ms per request | replica / proxy "
            "| req/s |", "|---|---|---|---|---|---|"]
    ratios: dict[str, list[float]] = {"off": [], "on": []}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        for index in range(args.rounds):
            for setting in ("off", "on"):
                serve.run(build_application(spec, 1, ray_access_log=setting == "on"), name=APP_NAME,
                          route_prefix="/")
                flags = ("--concurrency", "16", "--warmup-requests", "0", "--no-register-voice")
                if index == 0 and setting == "off":  # the voice and a first round of requests, uncounted
                    _bench(url, workload, out_dir / "warm.json", "--concurrency", "16", "--requests-per-level",
                           "32", "--warmup-requests", "0")
                before = cpu_by_role(os.getpid())
                level = _bench(url, workload, out_dir / f"r{index}_{setting}.json", *flags,
                               "--requests-per-level", str(args.requests))["levels"][0]
                after = cpu_by_role(os.getpid())
                ok = max(level["num_ok"], 1)
                replica, proxy = ((after.get(k, 0.0) - before.get(k, 0.0)) * 1000 / ok for k in ("replicas", "proxy"))
                ratios[setting].append(replica / proxy)
                rows.append(f"| {index} | {setting} | {replica:.2f} | {proxy:.2f} | {replica / proxy:.3f} "
                            f"| {level['achieved_rate']:.1f} |")
                print(rows[-1], flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    for setting, values in ratios.items():
        rows.append(f"\nreplica / proxy with the access line {setting}: mean {sum(values) / len(values):.3f}, "
                    f"{min(values):.3f} – {max(values):.3f}")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "serve-single", "serve-ray", "access-log"):
        p = sub.add_parser(name)
        p.add_argument("--model-dir", required=True)
        p.add_argument("--port", type=int, default=18431)
        if name == "serve-ray":
            p.add_argument("--replicas", type=int, default=2)
        if name == "run":
            p.add_argument("--servers", default="single,ray2", help="single, rayN (comma-separated)")
            p.add_argument("--c1", type=int, default=40)
            p.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",") if x], default=[8, 32])
            p.add_argument("--requests", type=int, default=128)
            p.add_argument("--out", default="/tmp/scale_overhead")
        if name == "access-log":
            p.add_argument("--rounds", type=int, default=8)
            p.add_argument("--requests", type=int, default=256)
            p.add_argument("--out", default="/tmp/scale_overhead_access_log")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    if args.command == "serve-single":
        serve_single(args.model_dir, args.port)
    elif args.command == "serve-ray":
        serve_ray(args.model_dir, args.port, args.replicas)
    else:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        workload = out_dir / "wl"
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "workload.py"), str(workload)], check=True,
                       stdout=subprocess.DEVNULL)
        if args.command == "access-log":
            text = access_log_ab(args, workload / "workload.json", out_dir)
            (out_dir / "summary.md").write_text(text)
            print(text)
            return 0
        results = []
        for name in args.servers.split(","):
            print(f"== {time.strftime('%T')} {name}", flush=True)
            results.append(measure(name, args, workload / "workload.json", out_dir))
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
        text = table(results)
        (out_dir / "summary.md").write_text(text)
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
