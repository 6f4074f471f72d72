"""Pick the launch tiles of the flow estimator's Triton GEMMs (kernels/flow.py TILES) on the GPU.

    python benchmarks/kernel_tiles.py [--rows 200,1600,3200,26624] [--json tiles.json]

Each candidate runs as the engine runs it: 20 calls back to back inside one CUDA graph, replayed; the
time per call therefore includes the graph's per-kernel launch cost. The baseline is what the fused
kernel replaces: cuBLAS (F.linear) followed by the separate epilogue kernel(s). The Triton kernels launch
with PDL on Hopper (cosystream.kernels.flow.PDL), so back-to-back calls overlap as in the estimator's chain.
Shapes are the CosyVoice2-0.5B estimator's (dim 256, attention 512, feed-forward 1024); rows = CFG rows ×
new frames (200: one stream's first chunk, 1600/3200: 16 streams, 26624: the official final pass of 16
streams, 2 × 832 frames each).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
import torch.nn.functional as F

from cosystream.kernels import flow
from cosystream.kernels.flow import Tile

DIM, INNER, FF = 256, 512, 1024
CALLS, REPLAYS = 20, 10


def graph_us(calls: list) -> float:
    """Median µs per call of the callables, run back to back inside one CUDA graph, replayed."""
    for fn in {id(c): c for c in calls}.values():
        fn()  # compile / warm up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    samples = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(samples)


def per_call_us(fn) -> float:
    return graph_us([fn] * CALLS)


def cases(m: int, dev: str, dt: torch.dtype) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dt)

    ln = (t(DIM) + 1, t(DIM), 1e-5)
    frames = m // 2
    pool = torch.zeros(2, 4, max(1024, frames), INNER, device=dev, dtype=dt)
    rows = torch.tensor([0, 1], device=dev)
    write_pos = torch.arange(frames, device=dev).repeat(2, 1)
    x, res = t(2, frames, DIM), t(2, frames, DIM)
    w_1, b_1 = t(FF, DIM, scale=DIM ** -0.5), t(FF)
    w_q = t(3 * INNER, DIM, scale=DIM ** -0.5)

    def qkv_unfused():
        a, _ = flow.add_layer_norm(x, res, *ln)
        _, k, v = F.linear(a, w_q).chunk(3, -1)
        flow.pool_write(k, v, pool[0], pool[1], rows, write_pos)

    conv_x = t(2, 256, frames)
    conv_w, conv_b = t(256, 256, 3, scale=(3 * 256) ** -0.5), t(256)
    state, tail_buf = t(2, 256, 2), t(2, 256, 2)
    time_add = t(2, 256)

    def conv_unfused():  # what the estimator ran before the conv kernel: cat, tail copy, cuDNN, norm + Mish
        xx = torch.cat([state, conv_x], dim=2)
        state.copy_(xx[:, :, -2:])
        return flow.channel_norm_mish(F.conv1d(xx, conv_w, conv_b), ln[0], ln[1], 1e-5, time_add)

    o, f = t(2, frames, INNER), t(2, frames, FF)
    w_o, b_o = t(DIM, INNER, scale=INNER ** -0.5), t(DIM)
    w_2, b_2 = t(DIM, FF, scale=FF ** -0.5), t(DIM)
    w_r, b_r = t(DIM, DIM, scale=DIM ** -0.5), t(DIM)
    return {
        "out proj": ("linear", lambda: F.linear(o, w_o, b_o),
                     lambda tile: flow.linear_residual(o, w_o, b_o, tile=tile)),
        "ff2+res": ("linear", lambda: F.linear(f, w_2, b_2) + res,
                    lambda tile: flow.linear_residual(f, w_2, b_2, res, tile=tile)),
        "res conv": ("linear", lambda: F.linear(conv_x.transpose(1, 2), w_r, b_r),
                     lambda tile: flow.linear_residual(conv_x.transpose(1, 2), w_r, b_r, tile=tile)),
        "conv+LN+Mish+add": ("conv", conv_unfused,
                             lambda tile: flow.causal_conv(conv_x, state, 0, conv_w, conv_b, ln[0], ln[1], 1e-5,
                                                           mish=True, add=time_add, tail_out=tail_buf, tile=tile)),
        "res+LN+ff1+GELU": ("gelu", lambda: F.gelu(F.linear(flow.add_layer_norm(x, res, *ln)[0], w_1, b_1)),
                            lambda tile: flow.norm_linear(x, res, ln, w_1, b_1, gelu=True, tile=tile)),
        "res+LN+qkv": ("proj", lambda: F.linear(flow.add_layer_norm(x, res, *ln)[0], w_q),
                       lambda tile: flow.norm_linear(x, res, ln, w_q, None, tile=tile)),
        "res+LN+qkv+pool": ("qkv", qkv_unfused,
                            lambda tile: flow.norm_qkv_pool_write(x, res, ln, w_q, pool[0], pool[1], rows, write_pos,
                                                                  tile=tile)),
    }


def candidates(kind: str, m: int) -> list[Tile]:
    large = m > 2048
    if kind == "conv":  # block_m = frames per program, block_n = input channels per step, output-channel blocks
        if large:
            return [Tile(bt, bc, w, s) for bt, bc, w, s in itertools.product((16, 32, 64, 128), (32, 64), (4, 8),
                                                                             (2, 3))]
        return [Tile(bt, bc, w, s, co) for bt, bc, w, s, co in itertools.product((16, 32), (32, 64), (4, 8), (2, 3),
                                                                                 (1, 2, 4, 8))]
    if kind == "linear":  # linear_residual: block_m rows, block_n outputs a program (K in steps of 64)
        return [Tile(bm, bn, w, s) for bm, bn, w, s in itertools.product((16, 32, 64), (32, 64, 128), (4, 8), (2, 3))]
    if large:  # the whole K (256) is one tile: stages do not matter
        return [Tile(bm, bn, w, 2) for bm, bn, w in itertools.product((64, 128), (64, 128, 256), (4, 8))]
    return [Tile(bm, bn, w, s) for bm, bn, w, s in itertools.product((16, 32, 64), (64, 128), (4, 8), (2, 3))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="200,1600,3200")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ops", default=None, help="comma-separated op names to sweep (default: all)")
    args = ap.parse_args()
    results = []
    print("| op | rows | cuBLAS + epilogue µs | best tile | fused µs | all tiles (µs) |\n|---|---|---|---|---|---|")
    for m in [int(v) for v in args.rows.split(",")]:
        for name, (kind, baseline, fused) in cases(m, "cuda", torch.bfloat16).items():
            if args.ops and name not in args.ops.split(","):
                continue
            base = per_call_us(baseline)
            timed = {}
            for tile in candidates(kind, m):
                try:
                    timed[tile] = per_call_us(lambda tile=tile, fused=fused: fused(tile))
                except Exception as e:  # a tile that does not fit (shared memory) is skipped, not fatal
                    print(f"<!-- {name} {tile}: {type(e).__name__} -->")
            best = min(timed, key=timed.get)
            spread = ", ".join(f"{t.block_m}x{t.block_n}w{t.warps}s{t.stages}c{t.co_blocks}:{us:.1f}"
                               for t, us in timed.items())
            print(f"| {name} | {m} | {base:.1f} | {best} | {timed[best]:.1f} | {spread} |", flush=True)
            results.append({"op": name, "rows": m, "baseline_us": base, "best": vars(best), "best_us": timed[best],
                            "all": [{**vars(t), "us": us} for t, us in timed.items()]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
