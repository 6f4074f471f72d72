"""Where the token-to-wave worker's time goes when a wave of new voices opens (issue 38).

    python benchmarks/open_profile.py --model-dir /tmp/m05r [--streams 16] [--waves 3] [--force-tokens 60] \
        [--config FIELD=VALUE ...] [--device cpu] [--out FILE.json]

An in-process engine on CUDA serves `--waves` waves of `--streams` zero-shot requests at once, each with a new
recording of the workload's voice (bench_engine.py's `--distinct-prompts`: the same length, other bytes). Every
call of the worker's `open_streams` (the phase that opens streams ahead of their first chunks, new voices' prompt
passes included), `opened` (the wait that ends such a phase: the worker's stream, then the stopwatch's events) and
`run` (its chunk phases) is measured on the worker thread: its wall time, where it made the host wait for the
device (torch's sync debug mode, the call sites in cosystream), and the wall time of the steps inside it on the
worker thread (slot openings, the prompt pass queued on the lane, the stream's sync `_now`, `settle`, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import workload  # beside this file: python puts the script's folder first on sys.path
from bench_engine import distinct_recordings

from cosystream.config import config_overrides
from cosystream.params import Mode, SamplingParams, SynthesisParams

_SYNC_MESSAGE = "called a synchronizing"


class Calls:
    """Wraps methods of the worker (`wrap`): per call, its name, items, wall seconds, host syncs (call sites),
    and the wall seconds of the parts inside it (`part`: methods it calls, timed on the worker thread only; a
    cProfile would not do: since Python 3.12 it records every thread's calls)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self._inside = threading.local()
        self._show = warnings.showwarning
        warnings.showwarning = self._on_warning

    def close(self) -> None:
        warnings.showwarning = self._show

    def wrap(self, name: str, method: Any) -> Any:
        def measured(*args: Any, **kwargs: Any) -> Any:
            return self._call(name, method, *args, **kwargs)
        return measured

    def part(self, name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            record = getattr(self._inside, "record", None)
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                if record is not None:
                    parts = record["parts"]
                    parts[name] = round(parts.get(name, 0.0) + (time.perf_counter() - t0) * 1e3, 3)
        return timed

    def _call(self, name: str, method: Any, *args: Any, **kwargs: Any) -> Any:
        items = len(args[0]) if args else 0
        record: dict[str, Any] = {"call": name, "items": items, "syncs": [], "parts": {}}
        self._inside.record = record
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            record["wall_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
            self._inside.record = None
            self.calls.append(record)

    def _on_warning(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                    line: Any = None) -> None:
        record = getattr(self._inside, "record", None)
        if _SYNC_MESSAGE not in str(message):
            self._show(message, category, filename, lineno, file, line)
            return
        if record is None:  # another thread's (the LM's steps), or outside the call
            return
        frames = [f for f in traceback.extract_stack() if "/cosystream/" in f.filename]
        record["syncs"].append(" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-4:])))


def time_parts(calls: Calls, t2w: Any) -> None:
    """The steps of opening streams, each timed inside the calls (instance attributes shadow the methods)."""
    pool = t2w.pool
    for owner, names in ((t2w, ("_prompt_args", "_by_cache_boundary", "_register", "_state", "_start_or_error",
                                "_now")),
                         (t2w.watch, ("settle",)),
                         (t2w.stream, ("empty_prompt",)),
                         (pool, ("open", "_cache_buffers", "_prompt_pass_on_lane", "_ode_inputs", "_encode_all",
                                 "_copy_into_caches", "open_new_voices") if pool is not None else ())):
        for name in names:
            setattr(owner, name, calls.part(name, getattr(owner, name)))


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from cosystream.engine.async_engine import AsyncEngine

    config: dict[str, Any] = {"device": args.device, "dtype": args.dtype, "voices_db": str(tmp / "voices.db")}
    config.update(config_overrides(args.config))
    engine = AsyncEngine.from_pretrained(args.model_dir, **config)
    t2w = engine.core.t2w
    wav = tmp / "voice.wav"
    workload.write_workload_wav(wav)
    new = distinct_recordings(SynthesisParams(text=workload.TARGET_TEXT, mode=Mode.zero_shot,
                                              prompt_audio=wav.read_bytes(), prompt_text=workload.PROMPT_TEXT,
                                              force_tokens=args.force_tokens))

    async def one(index: int) -> float:
        params = dataclasses.replace(new(), sampling=SamplingParams(seed=index))
        t0 = time.perf_counter()
        first = None
        async for _ in engine.synthesize(params):
            first = first if first is not None else time.perf_counter() - t0
        return first if first is not None else float("nan")

    try:
        await asyncio.to_thread(engine.warmup)
        for i in range(2):  # the first new voices: kernels and allocations
            await one(-1 - i)
        calls = Calls()
        t2w.open_streams = calls.wrap("open_streams", t2w.open_streams)
        t2w.run = calls.wrap("run", t2w.run)
        t2w.opened = calls.wrap("opened", t2w.opened)  # a phase that only opened streams waits for them here
        time_parts(calls, t2w)
        cuda = args.device == "cuda"
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
            warnings.simplefilter("always")
        waves = []
        for w in range(args.waves):
            before = len(calls.calls)
            firsts = await asyncio.gather(*(one(w * args.streams + i) for i in range(args.streams)))
            waves.append({"first_audio_ms": sorted(round(f * 1e3, 1) for f in firsts),
                          "calls": calls.calls[before:]})
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
        calls.close()
    finally:
        engine.close()
    return {"streams": args.streams, "waves": waves}


def print_report(report: dict[str, Any]) -> None:
    for w, wave in enumerate(report["waves"]):
        print(f"wave {w}: first audio ms {wave['first_audio_ms']}")
        runs = [call for call in wave["calls"] if call["call"] == "run"]
        run_syncs: dict[str, int] = {}
        for call in runs:
            for site in call["syncs"]:
                run_syncs[site] = run_syncs.get(site, 0) + 1
        print(f"  run (chunk phases): {len(runs)} calls, {sum(c['wall_ms'] for c in runs):.1f} ms, "
              f"{sum(len(c['syncs']) for c in runs)} host syncs")
        for site, n in sorted(run_syncs.items(), key=lambda kv: -kv[1])[:8]:
            print(f"    {n:4d} x {site}")
        for call in (call for call in wave["calls"] if call["call"] in ("open_streams", "opened")):
            sites: dict[str, int] = {}
            for site in call["syncs"]:
                sites[site] = sites.get(site, 0) + 1
            what = f"open_streams of {call['items']}" if call["call"] == "open_streams" else "opened (the wait after)"
            print(f"  {what}: {call['wall_ms']:.1f} ms, {len(call['syncs'])} host syncs")
            for site, n in sorted(sites.items(), key=lambda kv: -kv[1])[:8]:
                print(f"    {n:4d} x {site}")
            parts = sorted(call["parts"].items(), key=lambda kv: -kv[1])
            print("    parts (ms, nested ones inside their callers'): "
                  + ", ".join(f"{name} {ms:.1f}" for name, ms in parts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (no host syncs to count)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--waves", type=int, default=3)
    p.add_argument("--force-tokens", type=int, default=60)
    p.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--out")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = asyncio.run(run(args, Path(tmp)))
    print_report(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
