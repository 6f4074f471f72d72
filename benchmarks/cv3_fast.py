"""CosyVoice3 flow per chunk: the pooled fast path (static slots, batched streams, CUDA graphs) vs the eager path.

Random weights with the real Fun-CosyVoice3-0.5B shapes (or `--size tiny`, e.g. on a CPU). For each batch size
B, B streams of one registered voice run the engine's chunk plan in lockstep; every round it times
  * `fast ms`: `CV3Token2WavRunner.flow_chunks` over the B chunks (one graph replay per padded frame count),
  * `eager ms`: the same chunks through each stream's eager `Token2WavStream.new_mel`, one after another,
  * `fast vocoder ms`: `CV3Token2WavRunner.vocode_chunks` over the B chunks (equal-shape windows batched, one
    graph replay each); `eager vocoder ms`: each stream's `HiftStream.push`, one after another (both on the
    eager mels),
and checks that both flow paths agree: the relative RMS difference ‖Δmel‖/‖mel‖ of every chunk (bf16
rounding differs between a batched and a single-stream pass) must stay under `--tol` (exit status 1
otherwise). The official final call (full attention over the whole utterance, `final` True) is a pooled
full pass on the fast path and `CV3Flow.inference` on the eager one.
The first repeat captures the graphs; the last is reported. Example (GPU):
    python benchmarks/cv3_fast.py --device cuda --dtype bfloat16 --batches 1,8,16
and on a CPU:
    python benchmarks/cv3_fast.py --size tiny --device cpu --dtype float32 --batches 1,4 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from cosystream.config import ChunkSchedule
from cosystream.engine.chunking import ChunkPlanner
from cosystream.engine.cv3_token2wav import CV3Token2WavRunner
from cosystream.frontend.prompt import ModelInputs
from cosystream.models.cosyvoice3.flow import CV3Flow
from cosystream.models.cosyvoice3.hift import CausalHiFT, HiftStream
from cosystream.models.cosyvoice3.stream import ChunkCall
from cosystream.testing.random_model_cv3 import SIZES_CV3, hparams_cv3

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[CV3Flow, CausalHiFT]:
    hp = hparams_cv3(args.size)
    torch.manual_seed(0)
    flow = CV3Flow(hp.flow).to(device=device, dtype=dtype).eval()
    flow.decoder.rand_noise = flow.decoder.rand_noise.float()
    hift = CausalHiFT(hp.hift).to(device=device, dtype=dtype).eval()
    hift.f0_predictor.double()
    hift.init_noise(2 + (args.prompt_tokens + args.tokens) / 25)
    return flow, hift


def batch_inputs(args: argparse.Namespace, flow: CV3Flow, batch: int) -> tuple[ModelInputs, list[list[int]], int]:
    """B streams of one random voice: (its inputs, each stream's tokens, the frames a slot needs)."""
    gen = torch.Generator().manual_seed(batch)
    prompt = torch.randint(0, 6561, (args.prompt_tokens,), generator=gen, dtype=torch.int32)
    inputs = ModelInputs(mode="zero_shot", text_ids=torch.zeros(0, dtype=torch.int32),
                         xvector=torch.randn(192, generator=gen), flow_prompt_speech_tokens=prompt,
                         prompt_mel=torch.randn(2 * args.prompt_tokens, 80, generator=gen))
    tokens = [torch.randint(0, 6561, (args.tokens,), generator=gen).tolist() for _ in range(batch)]
    block = flow.decoder.estimator.dims.static_chunk_size
    return inputs, tokens, flow.ratio * (args.prompt_tokens + args.tokens) + block


def run_batch(args: argparse.Namespace, flow: CV3Flow, hift: CausalHiFT, batch: int, device: torch.device
              ) -> tuple[list[tuple], float, float, str]:
    """-> (rows of the last repeat, largest relative RMS Δmel, largest relative RMS Δaudio, graph note)."""
    block = flow.decoder.estimator.dims.static_chunk_size
    inputs, tokens, slot_frames = batch_inputs(args, flow, batch)
    runner = CV3Token2WavRunner(flow, hift, flow_slots=batch, slot_frames=slot_frames,
                                cuda_graphs=not args.no_graphs)
    rows, worst, worst_wav = [], 0.0, 0.0
    with torch.inference_mode():
        for _ in range(args.repeats):
            rows, worst, worst_wav = [], 0.0, 0.0
            states = [runner.start(inputs, voice_key="bench") for _ in range(batch)]
            hifts = [HiftStream(hift) for _ in range(batch)]
            assert all(s.pooled is not None for s in states)
            planner = ChunkPlanner(ChunkSchedule(), args.prompt_tokens, block=block // flow.ratio)
            while (plan := planner.next_plan(args.tokens, done=True)) is not None:
                jobs = [(s, t, plan) for s, t in zip(states, tokens, strict=True)]
                call = ChunkCall(plan.token_end, plan.offset, plan.is_final)
                eager_mels, eager_ms = [], 0.0
                for s, t in zip(states, tokens, strict=True):
                    ids = torch.tensor(t[:plan.token_end], device=device).view(1, -1)
                    sync(device)
                    t0 = time.perf_counter()
                    eager_mels.append(s.stream.new_mel(ids, call))
                    sync(device)
                    eager_ms += (time.perf_counter() - t0) * 1e3
                sync(device)
                t0 = time.perf_counter()
                mels, _ = runner.flow_chunks(jobs)
                sync(device)
                fast_ms = (time.perf_counter() - t0) * 1e3
                # both vocoders voice the eager mels, so their difference is the vocoder's alone
                t0 = time.perf_counter()
                eager_wavs = [h.push(mel, plan.is_final) for h, mel in zip(hifts, eager_mels, strict=True)]
                sync(device)
                voc_eager_ms = (time.perf_counter() - t0) * 1e3
                t0 = time.perf_counter()
                wavs, _ = runner.vocode_chunks([(s, mel, plan.is_final) for s, mel in zip(states, eager_mels,
                                                                                           strict=True)])
                sync(device)
                voc_ms = (time.perf_counter() - t0) * 1e3
                diff = max(float((a - b).abs().max()) for a, b in zip(mels, eager_mels, strict=True))
                rel = max(float((a - b).norm() / b.norm()) for a, b in zip(mels, eager_mels, strict=True))
                wav_rel = max(float((a - b).norm() / b.norm().clamp(min=1e-12))
                              for a, b in zip(wavs, eager_wavs, strict=True))
                worst = max(worst, rel)
                worst_wav = max(worst_wav, wav_rel)
                rows.append((batch, call.num_tokens, call.token_offset, call.finalize, mels[0].shape[2], fast_ms,
                             eager_ms, voc_ms, voc_eager_ms, diff, rel, wav_rel))
                if plan.is_final:
                    for s in states:
                        runner.release(s)
    if runner.graph_error is not None:
        note = f"batch {batch}: graph capture failed, the fast path ran eagerly: {runner.graph_error}"
    elif runner.graphs is not None and runner.graphs.enabled:
        note = (f"batch {batch}: {len(runner.graphs.graphs)} flow graphs, {len(runner.vocoder_graphs.graphs)} "
                "vocoder graphs")
    else:
        note = f"batch {batch}: no graphs (CPU or --no-graphs)"
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows, worst, worst_wav, note


def profile_batch(args: argparse.Namespace, flow: CV3Flow, hift: CausalHiFT, batch: int, device: torch.device
                  ) -> str:
    """The kernels of one whole plan of B streams on the pooled path without graphs (a graph replays the same
    kernels), flow and vocoder calls only: torch.profiler's table, by device time."""
    block = flow.decoder.estimator.dims.static_chunk_size
    inputs, tokens, slot_frames = batch_inputs(args, flow, batch)
    runner = CV3Token2WavRunner(flow, hift, flow_slots=batch, slot_frames=slot_frames, cuda_graphs=False)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def one_plan() -> None:
        states = [runner.start(inputs, voice_key="bench") for _ in range(batch)]
        planner = ChunkPlanner(ChunkSchedule(), args.prompt_tokens, block=block // flow.ratio)
        while (plan := planner.next_plan(args.tokens, done=True)) is not None:
            mels, _ = runner.flow_chunks([(s, t, plan) for s, t in zip(states, tokens, strict=True)])
            runner.vocode_chunks([(s, mel, plan.is_final) for s, mel in zip(states, mels, strict=True)])
            if plan.is_final:
                for s in states:
                    runner.release(s)

    with torch.inference_mode():
        one_plan()  # warm: allocator, autotuning
        sync(device)
        with torch.profiler.profile(activities=activities) as prof:
            one_plan()
            sync(device)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return f"### batch {batch}: one whole plan, pooled path, no graphs\n\n```\n" + \
        prof.key_averages().table(sort_by=sort, row_limit=args.profile_rows) + "\n```\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="0.5b", choices=sorted(SIZES_CV3))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--prompt-tokens", type=int, default=150)
    p.add_argument("--tokens", type=int, default=250)
    p.add_argument("--batches", default="1,8,16", help="streams voiced together, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="runs of the whole plan; the last one is reported")
    p.add_argument("--no-graphs", action="store_true", help="the pooled path without CUDA graphs")
    p.add_argument("--profile", action="store_true",
                   help="also print torch.profiler's kernel table of one whole plan per batch size")
    p.add_argument("--profile-rows", type=int, default=30)
    p.add_argument("--tol", type=float, default=None,
                   help="largest ‖Δmel‖/‖mel‖ of a chunk allowed between the paths (default: 1e-5 float32, "
                        "0.05 bf16/fp16)")
    p.add_argument("--audio-tol", type=float, default=None,
                   help="largest ‖Δwav‖/‖wav‖ of a chunk between the vocoder paths on the same mel (default: 1e-4 "
                        "float32, 0.1 bf16/fp16)")
    args = p.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    tol = args.tol if args.tol is not None else (1e-5 if dtype == torch.float32 else 0.05)
    audio_tol = args.audio_tol if args.audio_tol is not None else (1e-4 if dtype == torch.float32 else 0.1)
    flow, hift = build(args, device, dtype)
    commit = os.environ.get("COSYSTREAM_COMMIT") or subprocess.run(  # the device's copy has a stale .git
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"CosyVoice3 {args.size} flow per chunk, pooled fast path vs eager · {name} · {args.dtype} · "
          f"prompt {args.prompt_tokens} · {args.tokens} tokens · graphs {not args.no_graphs} · commit {commit}\n")
    print("| streams | tokens | offset | final | new frames | fast flow ms | eager flow ms | speed-up "
          "| fast vocoder ms | eager vocoder ms | max abs Δmel | ‖Δmel‖/‖mel‖ | ‖Δwav‖/‖wav‖ |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    failed, notes = [], []
    for batch in (int(b) for b in args.batches.split(",")):
        rows, worst, worst_wav, note = run_batch(args, flow, hift, batch, device)
        notes.append(note)
        for b, n, off, fin, new, fast, eager, voc, voc_eager, diff, rel, wav_rel in rows:
            print(f"| {b} | {n} | {off} | {fin} | {new} | {fast:.1f} | {eager:.1f} | {eager / fast:.1f}x | {voc:.1f} "
                  f"| {voc_eager:.1f} | {diff:.2e} | {rel:.2e} | {wav_rel:.2e} |")
        if not worst <= tol:
            failed.append(("mel", batch, worst))
        if not worst_wav <= audio_tol:
            failed.append(("audio", batch, worst_wav))
    print("\n" + "\n".join(notes))
    if args.profile:
        for batch in (int(b) for b in args.batches.split(",")):
            print("\n" + profile_batch(args, flow, hift, batch, device))
    if failed:
        print(f"MISMATCH: fast and eager paths differ by more than {tol} (mel) / {audio_tol} (audio), relative "
              f"RMS: {failed}")
        sys.exit(1)
    print(f"fast == eager: every chunk's relative RMS difference within {tol} (mel), {audio_tol} (audio)")


if __name__ == "__main__":
    main()
