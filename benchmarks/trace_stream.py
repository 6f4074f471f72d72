"""Where one stream's total time goes: a timeline of a lone request (the standard workload, registered voice).

    python benchmarks/trace_stream.py --model-dir /tmp/m05 --device cuda --dtype bfloat16 [--requests 3]

Runs requests one after another (c=1) through `AsyncEngine.synthesize` and prints, per request, when (ms
from submission) the LM had produced the tokens each chunk needs, when each token-to-wave job started and
ended on the worker (with the chunks it carried: index, new tokens, final), and when each chunk's audio
reached the caller. The gaps between "tokens ready", "job start" and "audio" are the scheduler's; a job's
own length is GPU work. Wraps engine internals (EngineCore._accept_token, Token2WavRunner.run) for the run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import workload  # beside this file

from cosystream.config import config_overrides
from cosystream.params import Mode, SamplingParams, SynthesisParams


def instrument(engine: Any, events: list[tuple[float, str, Any]]) -> None:
    """Log token counts and worker jobs into `events` as (perf_counter time, kind, detail)."""
    core, t2w = engine.core, engine.core.t2w
    accept, run = core._accept_token, t2w.run

    def accept_token(req: Any, seg: Any, token: int) -> None:
        accept(req, seg, token)
        events.append((time.perf_counter(), "tokens", len(seg.tokens)))

    def run_jobs(jobs: Any, *args: Any, **kwargs: Any) -> Any:
        plans = [(plan.index, plan.num_new, plan.is_final, len(tokens)) for _, tokens, plan in jobs]
        events.append((time.perf_counter(), "job_start", plans))
        try:
            return run(jobs, *args, **kwargs)
        finally:
            events.append((time.perf_counter(), "job_end", plans))

    core._accept_token = accept_token
    t2w.run = run_jobs


def timeline(events: list[tuple[float, str, Any]], t0: float, marks: set[int]) -> list[str]:
    lines = []
    for t, kind, detail in events:
        if kind == "tokens" and detail not in marks:
            continue
        lines.append(f"{(t - t0) * 1e3:8.1f} ms  {kind:10s} {detail}")
    return lines


async def amain(args: argparse.Namespace) -> None:
    from cosystream.engine.async_engine import AsyncEngine

    tmp = Path(tempfile.mkdtemp())
    wav = workload.write_workload_wav(tmp / "voice.wav")
    config: dict[str, Any] = dict(device=args.device, dtype=args.dtype, voices_db=str(tmp / "voices.db"))
    config.update(config_overrides(args.config))
    engine = AsyncEngine.from_pretrained(args.model_dir, **config)
    try:
        await asyncio.to_thread(engine.warmup)
        await engine.add_voice(workload.VOICE_NAME, str(wav), workload.PROMPT_TEXT)
        params = SynthesisParams(text=workload.TARGET_TEXT, mode=Mode.zero_shot, voice=workload.VOICE_NAME,
                                 force_tokens=workload.FORCE_TOKENS, first_hop=args.first_hop,
                                 sampling=SamplingParams(seed=0))
        for _ in range(args.warmup):
            async for _chunk in engine.synthesize(params):
                pass
        events: list[tuple[float, str, Any]] = []
        instrument(engine, events)
        marks = {int(m) for m in args.token_marks.split(",")}
        for i in range(args.requests):
            events.clear()
            t0 = time.perf_counter()
            async for chunk in engine.synthesize(params):
                events.append((time.perf_counter(), "audio", (chunk.index, len(chunk.pcm), chunk.is_final)))
            print(f"request {i}:")
            print("\n".join(timeline(sorted(events, key=lambda e: e[0]), t0, marks)), flush=True)
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--first-hop", type=int, default=None)
    ap.add_argument("--token-marks", default="1,28,78,178,250",
                    help="token counts to show (the official schedule's chunks need 28, 78, 178, 250)")
    ap.add_argument("--config", action="append", default=[], help="EngineConfig FIELD=VALUE (repeatable)")
    asyncio.run(amain(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
