"""Do two flow ODE calls finish sooner side by side on two CUDA streams than one after the other?

Each ODE call of the token-to-wave worker is one CUDA-graph replay of ten estimator steps (≈ 365 kernels a
step); a call of one stream costs nearly what a call of sixteen does, so the GPU idles inside small calls.
This builds `--lanes` flow pools on the 0.5B flow (each with its own slots, graphs, graph memory pool and
capture stream, as a second worker would need), captures each shape in every pool, and times, per shape
pair, the two calls alone, one after the other on one stream, and at once on two streams.

    python benchmarks/flow_lanes.py /tmp/m05 [--pairs 1x100+1x100,2x100+1x200,...] [--repeats 20]
        [--profile 1x100,15x250@0]

`--profile` also prints, for each listed shape alone, where its replay's GPU time goes (kernels grouped by name).

A shape is STREAMSxNEW_FRAMES[@START] (START: the frames already in the slot, the prompt's 250 by default).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from cosystream.checkpoint import load_checkpoint
from cosystream.cuda_graphs import bucket, capture_stream
from cosystream.engine.flow_runner import FlowRunner
from cosystream.engine.loader import load_flow

DEFAULT_PAIRS = ("1x100+1x100", "1x200+1x200", "2x100+1x200", "4x100+4x200", "1x250@0+16x100",
                 "15x250@0+1x250@0", "16x100+16x200", "8x100+8x100")


def parse_shape(text: str) -> tuple[int, int, int]:
    head, _, start = text.partition("@")
    streams, new = head.split("x")
    return int(streams), int(new), int(start) if start else 250


class Lane:
    """One flow pool with its own graphs, replayed on its own stream."""

    def __init__(self, flow, slots: int, frames: int, device: torch.device) -> None:
        self.runner = FlowRunner(flow, slots, frames, capture_stream=capture_stream(device))
        self.stream = torch.cuda.Stream(device)

    def graph(self, shape: tuple[int, int, int]) -> torch.cuda.CUDAGraph:
        streams, new, start = shape
        padded = bucket(streams)
        attn = self.runner.attn_len_for(start + new)
        self.runner.capture(padded, new, attn)
        return self.runner.graphs.graphs[(padded, new, attn)][0]


def time_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


def measure_pair(lanes: list[Lane], pair: str, repeats: int) -> dict:
    a_shape, b_shape = (parse_shape(s) for s in pair.split("+"))
    ga, gb = lanes[0].graph(a_shape), lanes[1].graph(b_shape)
    sa, sb = lanes[0].stream, lanes[1].stream

    def alone(graph, stream):
        with torch.cuda.stream(stream):
            graph.replay()

    def serial():
        with torch.cuda.stream(sa):
            ga.replay()
            gb.replay()

    def together():
        with torch.cuda.stream(sa):
            ga.replay()
        with torch.cuda.stream(sb):
            gb.replay()

    return {"pair": pair, "a_ms": time_ms(lambda: alone(ga, sa), repeats),
            "b_ms": time_ms(lambda: alone(gb, sb), repeats), "serial_ms": time_ms(serial, repeats),
            "together_ms": time_ms(together, repeats)}


def kernel_table(lane: Lane, shape_text: str, top: int) -> list[dict]:
    """The GPU time of one replay of `shape_text` by kernel name (CUPTI sees the kernels a graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    graph = lane.graph(parse_shape(shape_text))
    with torch.cuda.stream(lane.stream):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.cuda.stream(lane.stream):
            graph.replay()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key, "calls": e.count, "us": e.device_time_total} for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    print(f"\n{shape_text}: {sum(r['calls'] for r in rows)} kernels, {total / 1e3:.1f} ms of kernel time")
    for r in rows[:top]:
        print(f"  {r['us'] / 1e3:7.2f} ms {r['us'] / total:5.1%} {r['calls']:5d}x  {r['kernel'][:110]}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--pairs", default=",".join(DEFAULT_PAIRS))
    ap.add_argument("--slots", type=int, default=17, help="slots per lane (the largest call's streams + 1)")
    ap.add_argument("--frames", type=int, default=832)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--profile", default="", help="shapes whose replay to profile by kernel (comma-separated)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    device = torch.device("cuda")
    flow = load_flow(load_checkpoint(args.model_dir), device, torch.bfloat16)
    lanes = [Lane(flow, args.slots, args.frames, device) for _ in range(2)]
    rows = [measure_pair(lanes, pair, args.repeats) for pair in args.pairs.split(",") if pair]
    print(f"{torch.cuda.get_device_name()}: medians of {args.repeats}, ms")
    print("| calls | first alone | second alone | one after the other | side by side | saved |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        saved = 1 - r["together_ms"] / r["serial_ms"]
        print(f"| {r['pair']} | {r['a_ms']:.1f} | {r['b_ms']:.1f} | {r['serial_ms']:.1f} | {r['together_ms']:.1f} "
              f"| {saved:.0%} |")
    profiles = {shape: kernel_table(lanes[0], shape, args.top) for shape in args.profile.split(",") if shape}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "profiles": profiles}, f, indent=1)


if __name__ == "__main__":
    main()
