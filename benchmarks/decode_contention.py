"""How much the token-to-wave worker's work slows the LM's decode steps when both share the GPU.

    python benchmarks/decode_contention.py --model-dir /tmp/m05 --device cuda --dtype bfloat16

The engine runs decode steps on a high-priority CUDA stream while its worker thread runs flow/HiFT batches on
another (engine/core.py). In the open loop the engine's own statistics put a step at ≈ 1.0 ms beside an idle
worker or chunks but ≈ 4 ms beside official final passes (docs/benchmarks.md, fourteenth session). This
isolates that: `--rows` LM rows decode `--steps` steps back to back (the engine's launch-ahead: step N+1 is
queued before step N's tokens are read), first alone, then while a second thread loops one kind of worker
job on its own stream: official final passes of `--streams` streams (250 tokens after a 6 s prompt), or
first chunks of as many streams. Prints the median and p90 step period (host clock between two reads, as the
engine's statistics) and the worker's jobs done meanwhile, as one JSON line per case.

`--final-pass-sms 0,100` repeats the cases for each value of `EngineConfig.final_pass_sms` (official final
passes on a CUDA green context of that many SMs; 0: the whole GPU) and times each worker job alone: how much
capping the passes' SMs keeps the decode steps at their own speed, and what it costs the passes.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import threading
import time

import torch
from profile_stages import random_voice  # this folder is on the path when the script runs

from cosystream.checkpoint import load_checkpoint
from cosystream.config import ChunkSchedule, EngineConfig
from cosystream.engine.chunking import ChunkPlanner
from cosystream.engine.lm_runner import LMRunner, RowSampling
from cosystream.engine.loader import load_flow, load_hift, load_llm
from cosystream.engine.token2wav import Token2WavRunner

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROMPT_TOKENS = 150


def decode_periods(runner: LMRunner, rows: int, steps: int) -> list[float]:
    """Seconds between the reads of consecutive steps, launching each step before reading the one before."""
    periods, ahead, last = [], runner.launch(rows, 600), None
    for _ in range(steps):
        nxt = runner.launch(rows, 600)
        runner.collect(ahead)
        now = time.perf_counter()
        if last is not None:
            periods.append(now - last)
        last, ahead = now, nxt
    runner.collect(ahead)
    return periods


def job_ms_alone(job, device: torch.device, iters: int = 10) -> float:
    """Median wall milliseconds of one worker job, nothing else running."""
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        job()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(1e3 * (time.perf_counter() - t0))
    return round(statistics.median(samples), 2)


def worker_loop(job, stop: threading.Event, done: list[int], stream: torch.cuda.Stream | None) -> None:
    torch.set_grad_enabled(False)
    if stream is None:
        while not stop.is_set():
            job()
            done[0] += 1
        return
    with torch.cuda.stream(stream):
        while not stop.is_set():
            job()
            torch.cuda.current_stream().synchronize()  # as a worker phase ends: its audio goes to the host
            done[0] += 1


def measure(runner: LMRunner, rows: int, steps: int, job, device: torch.device) -> dict:
    lm_stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
    worker_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    stop, done = threading.Event(), [0]
    thread = threading.Thread(target=worker_loop, args=(job, stop, done, worker_stream)) if job else None
    if thread is not None:
        thread.start()
        time.sleep(0.5)  # let the worker reach its steady state before the steps are timed
    try:
        if lm_stream is not None:
            with torch.cuda.stream(lm_stream):
                periods = decode_periods(runner, rows, steps)
        else:
            periods = decode_periods(runner, rows, steps)
    finally:
        stop.set()
        if thread is not None:
            thread.join()
    ms = sorted(1e3 * p for p in periods)
    return {"step_p50_ms": round(statistics.median(ms), 3), "step_p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3),
            "step_max_ms": round(ms[-1], 3), "worker_jobs": done[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--rows", type=int, default=16, help="LM rows decoding at once")
    parser.add_argument("--streams", type=int, default=16, help="streams in each worker job")
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps per case (at most 700)")
    parser.add_argument("--final-pass-sms", default="0", help="comma list of EngineConfig.final_pass_sms values")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    ckpt = load_checkpoint(args.model_dir)

    lm = load_llm(ckpt, device, dtype)
    runner = LMRunner(lm, max_slots=args.rows, max_len=1024, use_graphs=device.type == "cuda")
    d = lm.dims
    sampling = RowSampling(seed=0, top_p=d.top_p, top_k=d.top_k, win_size=d.win_size, tau_r=d.tau_r,
                           min_len=10_000, ban_special=True)
    prompt = torch.randn(212, d.hidden_size, device=device, dtype=dtype) * 0.02

    def fresh_rows() -> None:  # every case decodes from the prompt's end (positions stay within max_len)
        for slot in range(args.rows):
            runner.set_row_sampling(slot, sampling)
            runner.prefill(slot, prompt)
            runner.set_active(slot, True)

    flow, hift = load_flow(ckpt, device, dtype), load_hift(ckpt, device, dtype)
    inputs, tokens = random_voice(PROMPT_TOKENS)
    for sms in (int(x) for x in args.final_pass_sms.split(",")):
        config = EngineConfig(device=str(device), flow_slots=args.streams + 2, flow_frames=832, final_pass_sms=sms)
        for line in contention_cases(Token2WavRunner(flow, hift, config), inputs, tokens, args, device,
                                     runner, fresh_rows):
            print(json.dumps({"final_pass_sms": sms, **line}), flush=True)
        gc.collect()  # the runner's graph caches hold it in reference cycles
        if device.type == "cuda":
            torch.cuda.empty_cache()  # its pool and graphs are gone: the next runner needs their memory


def contention_cases(t2w: Token2WavRunner, inputs, tokens: list[int], args, device: torch.device,
                     runner: LMRunner, fresh_rows) -> list[dict]:
    """One result per worker job: decode steps beside it, and the job's own time alone."""
    cases = worker_cases(t2w, inputs, tokens, args.streams, device)
    for job in cases.values():  # warm-up: captures every graph before anything is timed
        if job is not None:
            job()
    lines = []
    for name, job in cases.items():
        fresh_rows()
        result = measure(runner, args.rows, args.steps, job, device)
        if job is not None:
            result["job_ms_alone"] = job_ms_alone(job, device)
        lines.append({"case": name, "rows": args.rows, "streams": args.streams, **result})
    return lines


def worker_cases(t2w: Token2WavRunner, inputs, tokens: list[int], streams: int, device: torch.device) -> dict:
    """The worker jobs to time decode steps beside: none, first chunks, official final passes."""
    prompt_cache = t2w.prompt_cache(inputs, "voice")

    def final_passes() -> None:
        target = torch.tensor(tokens[:250], device=device)
        t2w.pool.full_passes([(prompt_cache, target)] * streams)

    def first_chunks() -> None:
        states = [t2w.start(inputs, "voice", seed=i) for i in range(streams)]
        plans = [ChunkPlanner(ChunkSchedule(), PROMPT_TOKENS).next_plan(len(tokens), False) for _ in states]
        t2w.run([(s, tokens, p) for s, p in zip(states, plans, strict=True)])
        for s in states:
            t2w.release(s)

    cases = {"alone": None, "beside_first_chunks": first_chunks}
    if t2w.pool is not None:
        cases["beside_final_passes"] = final_passes
    return cases


if __name__ == "__main__":
    main()
