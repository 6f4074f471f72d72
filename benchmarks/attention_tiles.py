"""Pick the launch tiles of the estimator's pooled attention kernel (kernels/flow.py ATTENTION_TILES) on the GPU.

    python benchmarks/attention_tiles.py [--json attention_tiles.json]

Shapes are the CosyVoice2-0.5B estimator's (8 heads of 64) at the engine's four regimes: one stream's first
chunk (2 CFG rows × 100 new frames after 250 cached ones, chunk mask), 16 streams' first chunks, and the
official final pass (full attention over 800 frames padded to 896) of one and of 16 streams. Each candidate
runs as the engine runs it (20 calls inside one CUDA graph, benchmarks/kernel_tiles.py); the reference
line is torch's scaled_dot_product_attention on the same keys gathered out of the pool (a lower bound the
kernel cannot reach without reading the pool in place: it is given the keys contiguous and unmasked).
Every candidate's output is checked against the shipped tile's before it is timed.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from kernel_tiles import per_call_us  # beside this file

from cosystream.kernels import flow
from cosystream.kernels.flow import Tile

HEADS, HEAD_DIM = 8, 64
INNER = HEADS * HEAD_DIM

# regime -> (streams, new frames, first new frame, chunk)
REGIMES = {
    "chunk_b1": (1, 100, 250, 50),
    "chunk_b16": (16, 100, 250, 50),
    "final_b1": (1, 896, 0, 0),
    "final_b16": (16, 896, 0, 0),
}
CANDIDATES = [Tile(bm, bn, w, st) for bm, bn, w, st in [
    (64, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 3), (16, 64, 4, 3), (32, 32, 4, 3), (16, 32, 2, 3),
    (64, 128, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 32, 4, 3), (128, 32, 4, 3),
    (128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 4), (64, 128, 4, 2)]]


def case(streams: int, num_q: int, first: int, chunk: int, dev: str, dt: torch.dtype) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = 2 * streams
    length = first + num_q
    valid = length if chunk else length - 96  # the final pass: 800 real frames padded to 896
    pool_k = (torch.randn(rows + 1, 1024, INNER, generator=g)).to(dev, dt)
    pool_v = (torch.randn(rows + 1, 1024, INNER, generator=g)).to(dev, dt)
    q = (torch.randn(rows, num_q, INNER, generator=g)).to(dev, dt)
    pool_rows = torch.arange(1, rows + 1, device=dev)  # row 0 unused: rows are looked up, not assumed
    q_pos = (first + torch.arange(num_q, device=dev)).repeat(rows, 1)
    limit = torch.full((rows,), valid, device=dev)
    return dict(q=q, pool_k=pool_k, pool_v=pool_v, rows=pool_rows, q_pos=q_pos, key_limit=limit, chunk=chunk,
                attn_len=length, num_heads=HEADS)


def sdpa_us(c: dict) -> float:
    keys = c["key_limit"][0].item()
    k = c["pool_k"][c["rows"], :keys].view(-1, keys, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    v = c["pool_v"][c["rows"], :keys].view(-1, keys, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    q = c["q"].view(c["q"].shape[0], -1, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    return per_call_us(lambda: F.scaled_dot_product_attention(q, k, v))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    results: dict[str, dict] = {}
    print("| regime | tile (m, n, warps, stages) | µs per call |\n|---|---|---|", flush=True)
    for name, shape in REGIMES.items():
        c = case(*shape, dev, dt)
        want = flow.pooled_attention(**c, tile=CANDIDATES[0])
        times = {}
        for tile in CANDIDATES:
            got = flow.pooled_attention(**c, tile=tile)
            err = float((got.float() - want.float()).abs().max())
            if err > 2e-2:
                print(f"| {name} | {tile} | WRONG (max error {err:.3g}) |", flush=True)
                continue
            times[str((tile.block_m, tile.block_n, tile.warps, tile.stages))] = per_call_us(
                lambda tile=tile, c=c: flow.pooled_attention(**c, tile=tile))
        best = min(times, key=times.get)
        shipped = flow.ATTENTION_TILES[(shape[3] > 0, 2 * shape[0] * shape[1] <= 512)]
        for key, us in sorted(times.items(), key=lambda kv: kv[1]):
            mark = " **best**" if key == best else ""
            print(f"| {name} | {key} | {us:.1f}{mark} |", flush=True)
        ref = sdpa_us(c)
        print(f"| {name} | torch SDPA on gathered keys | {ref:.1f} |", flush=True)
        results[name] = {"times_us": times, "best": best, "sdpa_us": ref,
                         "shipped": str((shipped.block_m, shipped.block_n, shipped.warps, shipped.stages))}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
