"""Launch tiles of the flow estimator's Triton kernels at the shapes the engine runs them, on the GPU.

    python benchmarks/flow_tiles.py [--ops conv,attention,ff1,block] [--shapes 32x250,32x50,2x250,2x25] \
        [--tiles 32x32w8s3,...] [--json FILE]

A shape is CFG rows x new frames: 32x250 a wave of 15-16 new voices' prompt pass (6 s prompts), 2x250 one
voice's, 32x50 sixteen streams' chunks, 2x25 one stream's first chunk. Ops:
- conv: the fused causal conv (`causal_conv`) at the estimator's three widths (input channels 320: the first
  ResNet's, 256: the others, 512: the up ResNet's; 256 out) with its norm, Mish and time-term epilogue;
- attention: `pooled_attention` of the new frames over the pool under the chunk mask (a chunk's rows attend to
  `--context` frames before it, a prompt pass's to its own frames only);
- ff1: the first feed-forward of a transformer block: the residual add and LayerNorm, the GEMM and GELU in
  one kernel (`norm_linear`), against what rows past the chunk path's limit run (`add_layer_norm`, cuBLAS,
  torch's GELU; "baseline");
- block: a whole transformer block with the default tiles, as the chunk path runs it (5 Triton kernels:
  `FastEstimator._pooled_transformers`) against the path of rows past its limit (cuBLAS GEMMs and separate
  norm, pool-write and GELU kernels: `FastEstimator._transformers`; "baseline"): where that limit
  (`flow_fast.PROLOGUE_GEMM_MAX_ROWS`) should lie.
Each candidate runs 20 calls back to back in one CUDA graph, replayed (µs per call, median of 10 replays),
with the engine's default tile first; `--tiles` (FRAMESxCHANNELSwWARPSsSTAGES; for attention
QUERIESxKEYSw..s..) limits the candidates.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cosystream.kernels import flow
from cosystream.kernels.flow import ATTENTION_TILES, SMALL_ROWS, TILES, Tile, row_class

CALLS, REPLAYS = 20, 10
DIM, INNER, FF, HEADS, CHUNK = 256, 512, 1024, 8, 50  # the CosyVoice2-0.5B estimator's


def graph_us(fn: Callable[[], object]) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    samples = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(samples)


def _randn(gen: torch.Generator) -> Callable[..., torch.Tensor]:
    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to("cuda", torch.bfloat16)
    return t


def conv_cases(rows: int, frames: int) -> dict[str, tuple[Tile, Callable[[Tile | None], object]]]:
    t = _randn(torch.Generator().manual_seed(0))
    cases = {}
    for n_in in (320, 256, 512):
        x, w, b = t(rows, n_in, frames), t(DIM, n_in, 3, scale=(3 * n_in) ** -0.5), t(DIM)
        state, tail = t(rows, n_in, 2), t(rows, n_in, 2)
        norm_w, norm_b, add = t(DIM) + 1, t(DIM), t(rows, DIM)

        def call(tile, x=x, w=w, b=b, state=state, tail=tail, norm_w=norm_w, norm_b=norm_b, add=add):
            return flow.causal_conv(x, state, 0, w, b, norm_w, norm_b, 1e-5, mish=True, add=add, tail_out=tail,
                                    tile=tile)
        cases[f"conv {n_in}"] = (flow.conv_tile(rows, frames), call)
    return cases


def attention_cases(rows: int, frames: int, context: int) -> dict[str, tuple[Tile, Callable[[Tile | None], object]]]:
    """A prompt pass (frames >= 200: no context) or chunks after `context` frames."""
    t = _randn(torch.Generator().manual_seed(1))
    start = 0 if frames >= 200 else context
    pool_k, pool_v = t(rows, start + frames, INNER), t(rows, start + frames, INNER)
    q = t(rows, frames, 3 * INNER)[..., :INNER]
    own = torch.arange(rows, device="cuda")
    q_pos = (start + torch.arange(frames, device="cuda")).repeat(rows, 1)
    limit = torch.full((rows,), start + frames, device="cuda")
    default = ATTENTION_TILES[(True, rows * frames <= SMALL_ROWS)]

    def call(tile):
        return flow.pooled_attention(q, pool_k, pool_v, own, q_pos, limit, CHUNK, start + frames, HEADS, tile=tile)
    return {f"attention after {start}": (default, call)}


def ff1_cases(rows: int, frames: int) -> dict[str, tuple[Tile, Callable[[Tile | None], object]]]:
    t = _randn(torch.Generator().manual_seed(2))
    x, res = t(rows, frames, DIM), t(rows, frames, DIM)
    ln = (t(DIM) + 1, t(DIM), 1e-5)
    w, b = t(FF, DIM, scale=DIM ** -0.5), t(FF)

    def call(tile):
        if tile is None:  # the baseline: what rows past the chunk path's limit run
            m, _ = flow.add_layer_norm(x, res, *ln)
            return F.gelu(F.linear(m, w, b))
        return flow.norm_linear(x, res, ln, w, b, gelu=True, tile=tile)
    return {"ff1": (TILES[("gelu", row_class(rows * frames))], call)}


def block_cases(rows: int, frames: int, context: int) -> dict[str, tuple[Tile, Callable[[Tile | None], object]]]:
    """One transformer block both ways (the tile argument: None for the baseline path, else the chunk path)."""
    t = _randn(torch.Generator().manual_seed(3))
    start = 0 if frames >= 200 else context
    x, res = t(rows, frames, DIM), t(rows, frames, DIM)
    n1, n3 = (t(DIM) + 1, t(DIM), 1e-5), (t(DIM) + 1, t(DIM), 1e-5)
    w_qkv = t(3 * INNER, DIM, scale=DIM ** -0.5)
    w_out, b_out = t(DIM, INNER, scale=INNER ** -0.5), t(DIM)
    w_1, b_1 = t(FF, DIM, scale=DIM ** -0.5), t(FF)
    w_2, b_2 = t(DIM, FF, scale=FF ** -0.5), t(DIM)
    pool_k, pool_v = t(rows, start + frames, INNER), t(rows, start + frames, INNER)
    own = torch.arange(rows, device="cuda")
    write_pos = (start + torch.arange(frames, device="cuda")).repeat(rows, 1)
    limit = torch.full((rows,), start + frames, device="cuda")

    def attention(q):
        return flow.pooled_attention(q, pool_k, pool_v, own, write_pos, limit, CHUNK, start + frames, HEADS)

    def call(tile):
        if tile is None:  # rows past the chunk path's limit
            a, h = flow.add_layer_norm(x, res, *n1)
            q, k, v = F.linear(a, w_qkv).split(INNER, dim=-1)
            flow.pool_write(k, v, pool_k, pool_v, own, write_pos)
            m, h = flow.add_layer_norm(F.linear(attention(q), w_out, b_out), h, *n3)
            return F.linear(F.gelu(F.linear(m, w_1, b_1)), w_2, b_2)
        q, h = flow.norm_qkv_pool_write(x, res, n1, w_qkv, pool_k, pool_v, own, write_pos)
        f, h = flow.norm_linear(flow.linear_residual(attention(q), w_out, b_out), h, n3, w_1, b_1, gelu=True)
        return flow.linear_residual(f, w_2, b_2)
    return {"block": (TILES[("gelu", row_class(rows * frames))], call)}


def candidates(op: str, tiles: str | None) -> list[Tile]:
    if tiles:
        return [Tile(*(int(v) for v in t.replace("w", "x").replace("s", "x").split("x"))) for t in tiles.split(",")]
    if op == "conv":
        return [Tile(bt, bc, w, s) for bt, bc, w, s in itertools.product((16, 32, 64), (32, 64), (4, 8), (2, 3))]
    if op == "attention":
        return [Tile(bm, bn, w, s) for bm, bn, w, s in itertools.product((16, 32, 64, 128), (32, 64), (4, 8), (2, 3))]
    return [Tile(bm, bn, w, 2) for bm, bn, w in itertools.product((32, 64, 128), (64, 128, 256), (4, 8))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="conv,attention,ff1,block")
    ap.add_argument("--shapes", default="32x250,32x50,2x250,2x25")
    ap.add_argument("--context", type=int, default=300, help="frames before a chunk (attention)")
    ap.add_argument("--tiles")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = []
    print(f"{torch.cuda.get_device_name()}, bf16, µs per call")
    print("| op | rows x frames | default tile | µs | best tile | µs | baseline µs |")
    print("|---|---|---|---|---|---|---|")
    for op in args.ops.split(","):
        for shape in args.shapes.split(","):
            rows, frames = (int(v) for v in shape.split("x"))
            if op == "conv":
                cases = conv_cases(rows, frames)
            elif op == "attention":
                cases = attention_cases(rows, frames, args.context)
            elif op == "block":
                cases = block_cases(rows, frames, args.context)
            else:
                cases = ff1_cases(rows, frames)
            for name, (default, call) in cases.items():
                timed = {}
                tried = [default] if op == "block" else [default, *candidates(op, args.tiles)]
                for tile in dict.fromkeys(tried):
                    try:
                        timed[tile] = graph_us(lambda tile=tile, call=call: call(tile))
                    except Exception as e:  # a tile that does not fit (shared memory) is skipped
                        print(f"<!-- {name} {shape} {tile}: {type(e).__name__} -->")
                base = graph_us(lambda call=call: call(None)) if op in ("ff1", "block") else float("nan")
                best = min(timed, key=timed.get)
                print(f"| {name} | {shape} | {default} | {timed[default]:.1f} | {best} | {timed[best]:.1f} "
                      f"| {base:.1f} |", flush=True)
                results.append({"op": name, "shape": shape, "default": vars(default), "baseline_us": base,
                                "all": [{**vars(t), "us": us} for t, us in timed.items()]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
