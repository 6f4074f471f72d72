"""`cosystream bench`: load-test a running server over HTTP or WebSocket and write JSON + a plot.

    cosystream bench --url http://127.0.0.1:8000 --target tts --voice alice --text "Hello there." \\
        --force-tokens 250 --concurrency 1,4,16,64,128 --requests-per-level 64 --out results.json --plot results.png
    cosystream bench --target openai --voice alloy --text "Hello." --rate 0.5,1,2 --duration 60
    cosystream bench --workload bench/workload.json --concurrency 1,8   # see benchmarks/workload.py
    cosystream bench --workload bench/workload.json --concurrency 64 --procs 4   # clients in 4 processes

Ctrl-C stops the run (in-flight requests are dropped) and still writes what finished; a second Ctrl-C aborts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import platform
import signal
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cosystream.bench.clients import (
    TARGETS,
    RequestSpec,
    endpoint_url,
    fetch_server_times,
    make_client,
    register_voice,
)
from cosystream.bench.loadgen import LevelPlan, build_plans, run_benchmark, run_event_loop
from cosystream.bench.procs import ClientJob, run_level_in_processes
from cosystream.bench.report import (
    LevelSummary,
    RequestRecord,
    build_results,
    format_first_audio_breakdown,
    format_table,
    write_json,
    write_plot,
)

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # the shell's code for "ended by SIGINT"


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `bench`; sets `handler(args) -> exit status`."""
    p = subparsers.add_parser("bench", help="load-test a running server (HTTP / WebSocket / OpenAI)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root, or a full endpoint URL")
    p.add_argument("--target", choices=TARGETS, default="tts",
                   help="tts: POST /v1/tts; ws: WS /v1/tts/stream; openai: POST /v1/audio/speech (pcm)")
    p.add_argument("--voice", default=None, help="voice name (default: the workload's)")
    p.add_argument("--prompt-wav", default=None, metavar="FILE",
                   help="zero-shot without a registered voice: upload this recording with every request "
                        "(--target tts or ws; the prompt's analysis and encoding become part of each request)")
    p.add_argument("--prompt-text", default=None, help="the transcript of --prompt-wav")
    p.add_argument("--distinct-prompts", action="store_true",
                   help="with --prompt-wav: another recording in every request (its last two samples changed), "
                        "so the server analyses each as new instead of reusing the first one's features")
    p.add_argument("--text", action="append", default=None, help="text to say; repeat for round-robin texts")
    p.add_argument("--workload", default=None, metavar="FILE",
                   help="JSON {texts, voice, prompt_text, prompt_wav, force_tokens, ...}, or text: one per line")
    p.add_argument("--mode", default=None, help="synthesis mode (default zero_shot)")
    p.add_argument("--force-tokens", type=int, default=None, help="generate exactly N speech tokens (960·N samples)")
    p.add_argument("--first-hop", type=int, default=None, help="first chunk size in speech tokens")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: the server's, random) and Poisson arrival seed (default 0)")
    p.add_argument("--model", default="cosyvoice2", help="the OpenAI `model` field")
    p.add_argument("--concurrency", default=None,
                   help="closed-loop levels, e.g. 1,4,16,64,128 (a refused stream waits the server's Retry-After, "
                        "then sends again)")
    p.add_argument("--rate", default=None, help="open-loop levels in requests/s (Poisson), e.g. 0.5,1,2.5")
    p.add_argument("--duration", type=float, default=None, help="seconds per level (stop sending after it)")
    p.add_argument("--requests-per-level", type=int, default=None,
                   help="requests per level (default: 4 per stream, min 8; open loop: 30 s of arrivals)")
    p.add_argument("--warmup-requests", type=int, default=2, help="sequential requests before the levels")
    p.add_argument("--first-audio-deadline-s", type=float, default=1.0,
                   help="first audio later than this after the send counts as a deadline miss (default 1, the "
                        "default admission budget of `cosystream serve`); underruns are the later chunks' misses")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request before it counts as an error")
    p.add_argument("--sample-rate", type=int, default=24000, help="sample rate of the PCM16 the server returns")
    p.add_argument("--no-register-voice", action="store_true",
                   help="do not POST the workload's prompt_wav to /v1/voices before starting")
    p.add_argument("--out", default="bench_results.json", help="JSON with every request and the summaries")
    p.add_argument("--plot", default=None,
                   help="PNG of first-audio percentiles and x realtime (audio s per wall s) per level")
    p.add_argument("--procs", type=int, default=1,
                   help="client processes a level's streams (or arrivals) are split over, so the client's own "
                        "CPU is not part of what it measures at high concurrency (warm-up: in this process)")
    p.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE",
                   help="a fact about the run kept in the JSON's meta.tags, e.g. commit=abc1234 or gpu=H100; "
                        "repeatable")
    p.set_defaults(handler=run_bench)
    return p


@dataclass(frozen=True)
class VoiceUpload:
    name: str
    prompt_text: str
    prompt_wav: Path


def run_bench(args: argparse.Namespace) -> int:
    try:
        spec, upload = _spec_from_args(args)
        plans = _plans_from_args(args)
        tags = _tags(args.tag)
    except (ValueError, OSError) as exc:
        print(f"cosystream bench: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        records, summaries, interrupted = run_event_loop(_run(args, spec, upload, plans))  # meta.client_loop
    except KeyboardInterrupt:  # the second Ctrl-C: no results
        _log("aborted")
        return EXIT_INTERRUPTED
    meta = {**_meta(args, spec, plans, started_at, interrupted), "tags": tags}
    path = write_json(args.out, build_results(meta, summaries, records))
    print(format_table(summaries))
    if breakdown := format_first_audio_breakdown(records, [s.level for s in summaries]):  # warm-up left out
        print("\nwhere first audio goes (means, ms; the engine's stages from its submission, flow and vocoder the "
              "first chunk's durations, the server's from the request's arrival, the client's from its send):\n"
              + breakdown)
    _log(f"wrote {path}")
    if args.plot and summaries:
        _log(f"wrote {write_plot(args.plot, summaries, title=f'{args.target} {endpoint_url(args.url, args.target)}')}")
    if interrupted:
        return EXIT_INTERRUPTED
    return 0 if any(s.num_ok for s in summaries) else 1


# ---- arguments ------------------------------------------------------------------------------------------


def load_workload(path: str | Path) -> dict[str, Any]:
    """A JSON workload (relative prompt_wav paths are relative to the file) or a text file of texts."""
    path = Path(path)
    if path.suffix.lower() != ".json":
        texts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        return {"texts": texts}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"--workload: {path}: expected a JSON object")
    if "text" in data and "texts" not in data:
        data["texts"] = [data.pop("text")]
    if isinstance(data.get("texts"), str):
        data["texts"] = [data["texts"]]
    if data.get("prompt_wav"):
        data["prompt_wav"] = str((path.parent / data["prompt_wav"]).resolve())
    return data


def _spec_from_args(args: argparse.Namespace) -> tuple[RequestSpec, VoiceUpload | None]:
    workload = load_workload(args.workload) if args.workload else {}
    texts = tuple(args.text or workload.get("texts") or ())
    if not texts:
        raise ValueError("give --text or a --workload with texts")
    prompt_wav, prompt_text = _prompt_upload(args)
    spec = RequestSpec(
        texts=texts, voice=None if prompt_wav else args.voice or workload.get("voice"),
        mode=args.mode or workload.get("mode", "zero_shot"),
        force_tokens=_first(args.force_tokens, workload.get("force_tokens")),
        first_hop=_first(args.first_hop, workload.get("first_hop")), seed=args.seed, model=args.model,
        sample_rate=args.sample_rate, prompt_wav=prompt_wav, prompt_text=prompt_text,
        distinct_prompts=args.distinct_prompts)
    upload = None
    # only the workload's own voice is uploaded: a --voice override names a voice the server already has
    if workload.get("prompt_wav") and spec.voice == workload.get("voice") and not args.no_register_voice:
        upload = VoiceUpload(spec.voice, workload.get("prompt_text", ""), Path(workload["prompt_wav"]))
    return spec, upload


def _prompt_upload(args: argparse.Namespace) -> tuple[str | None, str]:
    """(--prompt-wav as a checked absolute path or None, its transcript)."""
    if args.prompt_wav is None:
        if args.prompt_text is not None:
            raise ValueError("--prompt-text: goes with --prompt-wav")
        if args.distinct_prompts:
            raise ValueError("--distinct-prompts: goes with --prompt-wav")
        return None, ""
    if args.target == "openai":
        raise ValueError("--prompt-wav: --target openai names a registered voice (upload with tts or ws)")
    if args.voice is not None:
        raise ValueError("--prompt-wav and --voice: give one (an uploaded prompt or a registered voice)")
    path = Path(args.prompt_wav)
    if not path.is_file():
        raise ValueError(f"--prompt-wav: {path}: no such file")
    return str(path.resolve()), args.prompt_text or ""


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _plans_from_args(args: argparse.Namespace) -> list[LevelPlan]:
    try:
        concurrency = [int(v) for v in _split(args.concurrency)]
        rates = [float(v) for v in _split(args.rate)]
    except ValueError:
        given = f"{args.concurrency!r}, {args.rate!r}"
        raise ValueError(f"--concurrency/--rate: comma-separated numbers, got {given}") from None
    if not concurrency and not rates:
        concurrency = [1]
    if args.requests_per_level is not None and args.requests_per_level < 1:
        raise ValueError("--requests-per-level: must be >= 1")
    if args.duration is not None and args.duration <= 0:
        raise ValueError("--duration: must be > 0")
    if args.timeout <= 0 or args.warmup_requests < 0:
        raise ValueError("--timeout must be > 0 and --warmup-requests >= 0")
    if args.procs < 1:
        raise ValueError(f"--procs: must be >= 1, got {args.procs}")
    return build_plans(concurrency, rates, args.requests_per_level, args.duration)


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


# ---- the run --------------------------------------------------------------------------------------------


async def _run(args: argparse.Namespace, spec: RequestSpec, upload: VoiceUpload | None,
               plans: list[LevelPlan]) -> tuple[list[RequestRecord], list[LevelSummary], bool]:
    stop = asyncio.Event()
    remove_handlers = _stop_on_signals(stop)
    try:
        if upload is not None:
            await _register(args.url, upload, args.timeout)
        origin_s = time.perf_counter()
        client = make_client(args.url, args.target, spec, args.timeout, origin_s)
        def in_processes(plan: LevelPlan, seed: int) -> Any:
            job = ClientJob(args.url, args.target, spec, args.timeout, origin_s, plan, seed)
            return run_level_in_processes(job, args.procs, stop)

        async def server_times(records: list[RequestRecord]) -> None:
            await fetch_server_times(args.url, records, args.timeout)

        try:
            records, summaries = await run_benchmark(client.send, plans, stop, args.warmup_requests, args.seed or 0,
                                                      _log, level_fn=in_processes if args.procs > 1 else None,
                                                      after_level=server_times,
                                                      first_audio_deadline_s=args.first_audio_deadline_s)
        finally:
            await client.aclose()
    finally:
        remove_handlers()
    return records, summaries, stop.is_set()


async def _register(url: str, upload: VoiceUpload, timeout_s: float) -> None:
    # a server that cannot register (not ours, or read-only) may still know the voice: warn, go on
    try:
        outcome = await register_voice(url, upload.name, upload.prompt_text, upload.prompt_wav, timeout_s)
        _log(f"voice {upload.name!r}: {outcome}")
    except Exception as exc:  # HTTP answers, transport errors, an unreadable wav: all the same warning
        _log(f"warning: could not register voice {upload.name!r}: {type(exc).__name__}: {exc}")


def _stop_on_signals(stop: asyncio.Event):
    """First SIGINT/SIGTERM sets `stop`; the next SIGINT raises KeyboardInterrupt as usual."""
    loop = asyncio.get_running_loop()
    installed = []

    def on_signal() -> None:
        _log("stopping: finishing the run with what completed (Ctrl-C again to abort)")
        stop.set()
        with contextlib.suppress(Exception):
            loop.remove_signal_handler(signal.SIGINT)

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # Windows, or not the main thread
            pass

    def remove() -> None:
        for sig in installed:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)

    return remove


def _tags(items: list[str]) -> dict[str, str]:
    tags: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--tag: expected KEY=VALUE, got {item!r}")
        tags[key.strip()] = value.strip()
    return tags


def _meta(args: argparse.Namespace, spec: RequestSpec, plans: list[LevelPlan], started_at: str,
          interrupted: bool) -> dict[str, Any]:
    return {
        "tool": "cosystream bench", "target": args.target, "endpoint": endpoint_url(args.url, args.target),
        "started_at": started_at, "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "client_host": platform.node(), "python": platform.python_version(), "interrupted": interrupted,
        "client_loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        "request": asdict(spec), "levels": [asdict(p) for p in plans], "warmup_requests": args.warmup_requests,
        "timeout_s": args.timeout, "seed": args.seed, "client_procs": args.procs,
    }


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
