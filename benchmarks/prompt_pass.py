"""A wave of new voices' prompt pass on the prompt lane, alone on the GPU, and where its time goes (issue 38).

    python benchmarks/prompt_pass.py /tmp/m05 [--voices 1,4,15] [--prompt-tokens 150] [--slots 28] \
        [--frames 832] [--repeats 10] [--out FILE.json] [--profile VOICES]

A new voice's stream needs the flow run over its prompt's frames before its first chunk: `open_new_voices` queues
that pass for a wave of voices on the prompt lane (engine/prompt_lane.py), the encoder then one graph per Euler
step, each step's keys and conv tails copied into the voices' caches. Under load at 16 streams the engine's trace
shows a pass of 15 voices taking ~120 ms of GPU time. This times the same call with nothing else on the GPU, from
the pass's own events (started, encoded, each step, done), with the voices' caches made (each step's keys copied
into them) and without (a voice not kept for later streams), so the pass's own cost, its copies and what load adds
can be told apart. Medians of `--repeats` passes, ms.

`--profile VOICES` instead runs one pass of that many voices eagerly (no graphs: the same kernels, each
launched by the host) under torch.profiler and prints the GPU kernels by total time: where the pass's GPU
time goes, kernel by kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cosystream.checkpoint import load_checkpoint
from cosystream.cuda_graphs import bucket, capture_stream
from cosystream.engine.flow_runner import FlowRunner
from cosystream.engine.loader import load_flow
from cosystream.models.flow import UPSAMPLE
from cosystream.models.flow_stream import FlowStream


def prompts(flow, voices: int, tokens: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(voices)
    vocab = flow.input_embedding.weight.shape[0]
    return [(torch.randint(0, vocab, (1, tokens), generator=gen).to(device),
             torch.randn(1, UPSAMPLE * tokens, 80, generator=gen).to(device),
             torch.randn(1, 192, generator=gen).to(device)) for _ in range(voices)]


def one_pass(runner: FlowRunner, stream: FlowStream, args: list, keep: bool = True) -> dict[str, float]:
    """The pass's GPU time by part, from its events (the stream is closed again after it); keep: with the voices'
    caches made (each step's keys copied into them), as for voices kept for later streams."""
    opened = runner.open_new_voices(stream, args, keep=[keep] * len(args))
    pooled = [p for p, _ in opened]
    events = pooled[0].building
    if events is None:
        raise RuntimeError("the pass did not run on the prompt lane (no CUDA?)")
    torch.cuda.synchronize()
    for p in pooled:
        runner.close(p)
    runner.finished_passes()  # (the runner keeps them for the cost model)
    return {"pass": events.started.elapsed_time(events.done),
            "encoder": events.started.elapsed_time(events.encoded),
            "steps": events.encoded.elapsed_time(events.done)}


def measure(runner: FlowRunner, stream: FlowStream, args: list, repeats: int, keep: bool) -> dict[str, float]:
    # the lane's graphs of this wave captured as the engine's warm-up does, then one pass untimed
    runner.capture_prompt_pass(bucket(len(args)), stream.prompt_cache_tokens(args[0][0].shape[1]))
    one_pass(runner, stream, args, keep)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        part = one_pass(runner, stream, args, keep)
        part["host"] = (time.perf_counter() - t0) * 1e3
        samples.append(part)
    return {k: round(statistics.median(s[k] for s in samples), 2) for k in samples[0]}


def profile(runner: FlowRunner, stream: FlowStream, args: list, top: int = 30) -> str:
    """The GPU kernels of one eager pass, by total time (after one pass untimed)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    one_pass(runner, stream, args)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        one_pass(runner, stream, args)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in kernels)
    lines = [f"{len(args)} voices: {total / 1e3:.2f} ms of kernel time in {sum(e.count for e in kernels)} kernels"]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        lines.append(f"{e.self_device_time_total / 1e3:8.2f} ms {100 * e.self_device_time_total / total:5.1f}% "
                     f"{e.count:6d}x  {e.key[:150]}")
    lines.append("where the copies, fills and element-wise kernels come from (the launching op, its callers):")
    lines += [f"{us / 1e3:8.2f} ms {n:6d}x  {where}" for where, (us, n) in _launch_sites(prof.events())[:top]]
    return "\n".join(lines)


def _launch_sites(events) -> list[tuple[str, tuple[float, int]]]:
    """Kernel time of copies, fills and torch element-wise kernels, by the CPU op that launched them and the
    ops above it (with its input shapes)."""
    sites: dict[str, list] = {}
    for e in events:
        for k in getattr(e, "kernels", []):
            if not any(s in k.name for s in ("copy", "Memset", "elementwise", "Memcpy", "Fill")):
                continue
            chain, parent = [], e.cpu_parent
            while parent is not None and len(chain) < 4:
                chain.append(parent.name[:60])
                parent = parent.cpu_parent
            where = f"{e.name} {e.input_shapes} <- {' <- '.join(chain) or '?'} [{k.name[:60]}]"
            site = sites.setdefault(where, [0.0, 0])
            site[0] += k.duration
            site[1] += 1
    return sorted(((w, (us, n)) for w, (us, n) in sites.items()), key=lambda item: -item[1][0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--voices", default="1,4,15")
    ap.add_argument("--prompt-tokens", type=int, default=150, help="the standard workload's 6 s prompt: 150")
    ap.add_argument("--slots", type=int, default=28)
    ap.add_argument("--frames", type=int, default=832)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out")
    ap.add_argument("--profile", type=int, metavar="VOICES", help="one eager pass of VOICES under the profiler")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    device = torch.device("cuda")
    flow = load_flow(load_checkpoint(args.model_dir), device, torch.bfloat16)
    if args.profile:
        runner = FlowRunner(flow, args.slots, args.frames, use_graphs=False)
        print(profile(runner, FlowStream(flow), prompts(flow, args.profile, args.prompt_tokens, device)))
        return
    runner = FlowRunner(flow, args.slots, args.frames, capture_stream=capture_stream(device))
    stream = FlowStream(flow)
    rows = []
    for voices in (int(v) for v in args.voices.split(",")):
        wave = prompts(flow, voices, args.prompt_tokens, device)
        with_copies = measure(runner, stream, wave, args.repeats, keep=True)
        without = measure(runner, stream, wave, args.repeats, keep=False)  # no cache made for later streams
        rows.append({"voices": voices, "with_copies": with_copies, "without_copies": without})
    print(f"{torch.cuda.get_device_name()}: prompt of {args.prompt_tokens} tokens, medians of {args.repeats}, ms")
    print("| voices | pass | encoder | Euler steps | host (queue + wait) | pass, no cache kept | its steps |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        w, wo = r["with_copies"], r["without_copies"]
        print(f"| {r['voices']} | {w['pass']:.1f} | {w['encoder']:.1f} | {w['steps']:.1f} | {w['host']:.1f} "
              f"| {wo['pass']:.1f} | {wo['steps']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "prompt_tokens": args.prompt_tokens, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
