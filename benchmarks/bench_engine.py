"""Measure the engine in-process (no HTTP): the same load levels, playback clock and report as `cosystream bench`.

Drives `AsyncEngine.synthesize` in closed loop (fixed concurrency) or open loop (Poisson rate) with the standard
workload of benchmarks/workload.py (its voice is registered first, in a throw-away voice database unless
--voices-db is given) and prints a markdown table; --out / --plot write the same JSON / PNG as `cosystream bench`.

    python benchmarks/bench_engine.py --model-dir pretrained_models/CosyVoice2-0.5B --device cuda \\
        --dtype bfloat16 --concurrency 1,4,16,64 --requests-per-level 64 --out engine.json --plot engine.png

Run from the repository root with the package importable (pip install -e .).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import workload  # beside this file: python puts the script's folder first on sys.path

from cosystream.bench.loadgen import SendFn, build_plans, run_benchmark, run_timed
from cosystream.bench.report import (
    LevelSummary,
    RequestRecord,
    Timeline,
    build_results,
    format_first_audio_breakdown,
    format_table,
    write_json,
    write_plot,
)
from cosystream.config import config_overrides
from cosystream.errors import Overloaded, UnknownVoice
from cosystream.outputs import SAMPLE_RATE
from cosystream.params import Mode, SamplingParams, SynthesisParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="CosyVoice2 model directory (official layout)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--max-streams", type=int, default=None, help="EngineConfig.max_streams (default: the engine's)")
    p.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                   help="any other EngineConfig field, e.g. final_attention=chunk or flow_slots=24")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run eagerly")
    p.add_argument("--voices-db", default=None, help="voice database (default: a temporary one)")
    p.add_argument("--voice", default=workload.VOICE_NAME)
    p.add_argument("--prompt-wav", default=None, help="prompt recording (default: the standard workload's)")
    p.add_argument("--prompt-text", default=workload.PROMPT_TEXT)
    p.add_argument("--prompt-per-request", action="store_true",
                   help="zero-shot without a registered voice: every request carries the prompt recording and "
                        "text (its prompt analysis and the flow's pass over the prompt are part of each request)")
    p.add_argument("--distinct-prompts", action="store_true",
                   help="with --prompt-per-request: every request's recording differs (its last two samples), so "
                        "the engine reuses nothing of an earlier request's prompt (the cold zero-shot path)")
    p.add_argument("--text", default=workload.TARGET_TEXT)
    p.add_argument("--force-tokens", type=int, default=workload.FORCE_TOKENS, help="0: stop at end of speech")
    p.add_argument("--first-hop", type=int, default=None)
    p.add_argument("--offline", action="store_true",
                   help="stream=False requests (one flow pass per request after its last token); the level's "
                        "aggregate real-time factor x gives the offline batch RTF 1/x")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--concurrency", default=None, help="closed-loop levels, e.g. 1,4,16,64")
    p.add_argument("--rate", default=None, help="open-loop levels in requests/s, e.g. 1,2.5")
    p.add_argument("--duration", type=float, default=None)
    p.add_argument("--requests-per-level", type=int, default=None)
    p.add_argument("--warmup-requests", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--out", default=None, help="JSON path (same schema as `cosystream bench`)")
    p.add_argument("--plot", default=None, help="PNG path")
    return p


def make_params(args: argparse.Namespace, prompt_wav: Path | None = None) -> SynthesisParams:
    """The request every level sends; with `prompt_wav` (--prompt-per-request) it carries its voice's recording
    and transcript instead of naming the registered voice."""
    voice = dict(prompt_audio=prompt_wav.read_bytes(), prompt_text=args.prompt_text) if prompt_wav else dict(
        voice=args.voice)
    return SynthesisParams(
        text=args.text, mode=Mode.zero_shot, stream=not args.offline, first_hop=args.first_hop,
        force_tokens=args.force_tokens or None, sampling=SamplingParams(seed=args.seed, greedy=args.greedy), **voice)


def distinct_recordings(params: SynthesisParams) -> Callable[[], SynthesisParams]:
    """`params` with another recording at every call: its last two 16-bit samples hold a counter (the same
    length and voice, other bytes, so a content-keyed cache never hits)."""
    counter = itertools.count()
    audio = bytes(params.prompt_audio)

    def next_params() -> SynthesisParams:
        return dataclasses.replace(params, prompt_audio=audio[:-4] + next(counter).to_bytes(4, "little"))

    return next_params


def make_send(engine: Any, params: SynthesisParams | Callable[[], SynthesisParams], timeout_s: float,
              origin_s: float) -> SendFn:
    """One engine request per call, timed on the same playback clock as the network client. `params` may be
    a function giving each request's."""
    params_for = params if callable(params) else lambda: params
    first = params_for()
    expected_s = first.force_tokens * workload.SAMPLES_PER_TOKEN / SAMPLE_RATE if first.force_tokens else None

    async def send(level: str, index: int) -> RequestRecord:
        timeline = Timeline(level, index, origin_s, SAMPLE_RATE, expected_s)
        request = params_for()

        async def stream() -> None:
            try:
                async for chunk in engine.synthesize(request):
                    timeline.audio(len(chunk.pcm))
                    if chunk.times is not None:
                        timeline.record.server = chunk.times.as_dict()
            except Overloaded as exc:
                timeline.refuse(503, exc.retry_after_s)

        return await run_timed(stream, timeline, timeout_s)

    return send


async def ensure_voice(engine: Any, name: str, prompt_wav: str | Path, prompt_text: str) -> str:
    """Register the workload's voice unless the store already has it; returns what happened."""
    try:
        engine.get_voice(name)
        return "exists"
    except UnknownVoice:
        await engine.add_voice(name, str(prompt_wav), prompt_text)
        return "registered"


async def run(engine: Any, args: argparse.Namespace, prompt_wav: Path, stop: asyncio.Event | None = None,
              log: Any = None) -> tuple[list[RequestRecord], list[LevelSummary]]:
    """Register the voice, then warm up and run every level against `engine`."""
    stop = stop or asyncio.Event()
    _log(f"voice {args.voice!r}: {await ensure_voice(engine, args.voice, prompt_wav, args.prompt_text)}")
    concurrency = [int(v) for v in _split(args.concurrency)]
    rates = [float(v) for v in _split(args.rate)]
    plans = build_plans(concurrency or ([] if rates else [1]), rates, args.requests_per_level, args.duration)
    params = make_params(args, prompt_wav if args.prompt_per_request else None)
    if args.distinct_prompts:
        params = distinct_recordings(params)
    send = make_send(engine, params, args.timeout, time.perf_counter())
    return await run_benchmark(send, plans, stop, args.warmup_requests, args.seed, log or _log)


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _commit() -> str:
    """The commit that runs: $COSYSTREAM_COMMIT where the tree is a copy without a current .git (the
    device machine's), else git's HEAD."""
    if os.environ.get("COSYSTREAM_COMMIT"):
        return os.environ["COSYSTREAM_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def _amain(args: argparse.Namespace, tmp: Path, busy: list[dict[str, Any]] | None = None
                 ) -> tuple[list[RequestRecord], list[LevelSummary]]:
    from cosystream.engine.async_engine import AsyncEngine

    prompt_wav = Path(args.prompt_wav) if args.prompt_wav else workload.write_workload_wav(tmp / "voice.wav")
    config: dict[str, Any] = {"device": args.device, "dtype": args.dtype, "cuda_graphs": not args.no_cuda_graphs,
                              "voices_db": args.voices_db or str(tmp / "voices.db")}
    if args.max_streams is not None:
        config["max_streams"] = args.max_streams
    config.update(config_overrides(args.config))
    engine = AsyncEngine.from_pretrained(args.model_dir, **config)
    try:
        await asyncio.to_thread(engine.warmup)  # graph capture is not part of any request's latency
        return await run(engine, args, prompt_wav, log=_busy_logger(engine, busy))
    finally:
        engine.close()


def _busy_logger(engine: Any, sink: list[dict[str, Any]] | None = None) -> Any:
    """A log function that follows each line (warm-up, every level) with the engine's busy time since the
    previous one, so every level gets its own breakdown. `sink` (the JSON's meta.engine_stats) gets the engine's
    stats as read at the start and after each line: the differences of consecutive snapshots are a level's
    counters, so a run can be analysed after the fact."""
    mark = {"stats": engine.stats(), "t": time.perf_counter()}
    if sink is not None:
        sink.append({"after": "start", "wall_s": 0.0, "stats": mark["stats"]})

    def log(message: str) -> None:
        _log(message)
        stats, now = engine.stats(), time.perf_counter()
        _log("  " + _busy_line(mark["stats"], stats, now - mark["t"]))
        if sink is not None:
            sink.append({"after": message.splitlines()[0] if message else "", "wall_s": round(now - mark["t"], 6),
                         "stats": stats})
        mark.update(stats=stats, t=now)

    return log


def _busy_line(before: dict[str, float], after: dict[str, float], wall_s: float) -> str:
    """Where the GPU owner's time went between two reads of the engine's stats."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    batches = max(d.get("token2wav_batches", 0.0), 1.0)
    return (f"engine busy over {wall_s:.1f} s: LM {d.get('lm_busy_seconds', 0.0):.1f} s "
            f"({d.get('num_steps', 0.0):.0f} steps), token-to-wave {d.get('token2wav_busy_seconds', 0.0):.1f} s "
            f"(flow {d.get('token2wav_flow_seconds', 0.0):.1f}, vocoder {d.get('token2wav_vocoder_seconds', 0.0):.1f}; "
            f"final passes {d.get('token2wav_final_seconds', 0.0):.1f} s for {d.get('token2wav_finals', 0.0):.0f}, "
            f"phases with a due pass {d.get('token2wav_due_final_seconds', 0.0):.1f} s in "
            f"{d.get('token2wav_due_final_phases', 0.0):.0f}; "
            f"{d.get('token2wav_batches', 0.0):.0f} batches, {d.get('token2wav_chunks', 0.0) / batches:.1f} "
            f"chunks per batch, {1000 * d.get('token2wav_busy_seconds', 0.0) / batches:.1f} ms per batch)"
            + _step_line(d) + _stage_line(d) + _calls_line(d) + _prompt_line(d, after))


def _prompt_line(d: dict[str, float], after: dict[str, float]) -> str:
    """Recordings sent with requests: analysis batches, the flow's passes over new prompts, the upload cache
    (`d`: the counters' growth; `after`: the gauges now, for the largest batches since the engine started)."""
    if not d.get("upload_cache_misses") and not d.get("flow_prompts_built"):
        return ""
    analysed = d.get("prompt_analysis_prompts", 0.0)
    batches = d.get("prompt_analysis_batches", 0.0)
    built, calls = d.get("flow_prompts_built", 0.0), d.get("flow_prompt_build_calls", 0.0)
    return (f"\n  new recordings: {d.get('upload_cache_misses', 0.0):.0f} analysed ({analysed:.0f} in "
            f"{batches:.0f} GPU batches, largest so far {after.get('prompt_analysis_largest_batch', 0.0):.0f}), "
            f"{d.get('upload_cache_hits', 0.0):.0f} reused; flow prompt passes: {built:.0f} prompts in "
            f"{calls:.0f} calls (largest so far {after.get('flow_prompt_build_largest', 0.0):.0f})")


def _step_line(d: dict[str, float]) -> str:
    """Mean decode step (and the steps of 20 ms or more) by what the token-to-wave worker ran meanwhile."""
    def steps(name: str) -> str:
        prefix = f"{name}s_beside_"
        kinds = [k[len(prefix):] for k in d if k.startswith(prefix) and d[k] > 0]
        return ", ".join(f"{kind} {1000 * d[f'{name}_seconds_beside_{kind}'] / d[prefix + kind]:.2f} ms "
                         f"({d[prefix + kind]:.0f})" for kind in sorted(kinds))

    line = steps("decode_step")
    if not line:
        return ""
    slow = steps("decode_slow_step") or "none"
    prefix = "decode_slow_step_seconds_in_"
    parts = ", ".join(f"{k[len(prefix):]} {d[k]:.2f} s" for k in sorted(d) if k.startswith(prefix))
    return (f"\n    decode step beside the worker's {line}; steps of 20 ms or more: {slow}"
            + (f"; their time in {parts}" if parts else ""))


def _stage_line(d: dict[str, float]) -> str:
    """Token-to-wave seconds per stage over the run: GPU (host) — where the worker's time goes."""
    stages = [k[len("token2wav_"):-len("_gpu_seconds")] for k in d if k.endswith("_gpu_seconds")]
    parts = [f"{s} {d[f'token2wav_{s}_gpu_seconds']:.2f} ({d.get(f'token2wav_{s}_host_seconds', 0.0):.2f})"
             for s in stages]
    return "\n  token-to-wave stages, GPU s (host s): " + ", ".join(parts) if parts else ""


def _calls_line(d: dict[str, float]) -> str:
    """The worker's graph calls by shape (streams x frames): how many, and their GPU ms each."""
    prefix = "token2wav_calls_"
    tags = sorted(k[len(prefix):] for k in d if k.startswith(prefix) and not k.endswith("_seconds") and d[k] > 0)
    parts = [f"{t} {d[prefix + t]:.0f}" + (f" × {1000 * d[prefix + t + '_seconds'] / d[prefix + t]:.1f} ms"
                                           if prefix + t + "_seconds" in d else "") for t in tags]
    return "\n  token-to-wave calls (streams x frames): " + ", ".join(parts) if parts else ""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.distinct_prompts and not args.prompt_per_request:
        parser.error("--distinct-prompts: goes with --prompt-per-request")
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    busy: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cosystream-bench-") as tmp:
        try:
            records, summaries = asyncio.run(_amain(args, Path(tmp), busy))
        except KeyboardInterrupt:
            _log("interrupted")
            return 130
    device = _device_name(args.device)
    print(f"{started_at[:10]} · {device} · {args.dtype} · commit {_commit()} · force_tokens {args.force_tokens}\n")
    print(format_table(summaries))
    if breakdown := format_first_audio_breakdown(records, [s.level for s in summaries]):  # warm-up left out
        print("\nwhere first audio goes (means, ms; the first five from submission):\n" + breakdown)
    if args.out:
        meta = {"tool": "benchmarks/bench_engine.py", "started_at": started_at, "device": device,
                "dtype": args.dtype, "commit": _commit(), "args": vars(args), "engine_stats": busy}
        _log(f"wrote {write_json(args.out, build_results(meta, summaries, records))}")
    if args.plot and summaries:
        _log(f"wrote {write_plot(args.plot, summaries, title=f'engine in-process · {device} · {args.dtype}')}")
    return 0 if any(s.num_ok for s in summaries) else 1


if __name__ == "__main__":
    raise SystemExit(main())
