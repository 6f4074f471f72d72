"""Pick the launch tiles of the LM decode step's weight-streaming linear (kernels/decode.py _LINEAR_TILES).

    python benchmarks/linear_tiles.py [--rows 1,16,32] [--json linear_tiles.json] [--budget-s 420]
    python benchmarks/linear_tiles.py --rows 1 --shapes down,gate_up --wide --tiles-json tiles.json

Shapes are CosyVoice2-0.5B's decode step (Qwen2, hidden 896, MLP 4864, 14 + 2·2 heads of 64, speech head
6564 classes). Each candidate runs as the step runs it: one call per layer, each on its own weight (24
copies, so the weights stream from HBM as in the step, not from the 50 MB L2), inside one CUDA graph,
replayed; the time per call includes the graph's per-kernel launch cost. The baseline is what the kernel
replaces: cuBLAS (F.linear), for the down projection after the separate SiLU·up kernel. Every candidate's
output is checked against F.linear before it is timed. Prints a table and the `_LINEAR_TILES` entries.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F
from kernel_tiles import graph_us  # beside this file

from cosystream.kernels import decode, reference
from cosystream.kernels.decode import LinearTile

LAYERS = 24
# name -> (n_out, n_in, bias, silu prologue)
SHAPES = {
    "qkv": (1152, 896, True, False),
    "o": (896, 896, False, False),
    "gate_up": (9728, 896, False, False),
    "down": (896, 4864, False, True),
    "head": (6564, 896, True, False),
}


def candidates(n_in: int, name: str = "", wide: bool = False) -> list[LinearTile]:
    """The sweep's tiles; `wide`: narrower output blocks (more programs than SMs) and more splits, for the two
    large projections only (gate/up runs whole in the step: one split)."""
    if wide:
        grid = {"down": ((32, 64), (64, 128, 256), (8, 16), (4, 8), (3, 4)),
                "gate_up": ((32, 64, 128), (64, 128, 256), (1,), (4, 8), (3, 4))}.get(name)
        if grid is None:
            return []
    else:
        grid = ((64, 128), (64, 128, 256), (1, 2, 4, 8), (4, 8), (3, 4))
    out = []
    for bn, bk, splits, warps, stages in itertools.product(*grid):
        if n_in // splits >= bk and not (name == "gate_up" and splits > 1):
            out.append(LinearTile(bn, bk, splits, warps, stages))
    return out


def summed(y: torch.Tensor) -> torch.Tensor:
    return y.float().sum(0) if y.dim() == 3 else y.float()


def sweep_shape(name: str, rows: int, tiles: list[LinearTile], deadline: float) -> dict:
    n_out, n_in, has_bias, silu = SHAPES[name]
    g = torch.Generator().manual_seed(0)
    width = 2 * n_in if silu else n_in
    x = torch.randn(rows, width, generator=g).cuda().bfloat16()
    weights = [(torch.randn(n_out, n_in, generator=g) * n_in ** -0.5).cuda().bfloat16() for _ in range(LAYERS)]
    bias = (torch.randn(n_out, generator=g) * 0.1).cuda().bfloat16() if has_bias else None
    inp = reference.silu_mul(x) if silu else x
    want = F.linear(inp, weights[0], bias).float()

    def ours(w: torch.Tensor, tile: LinearTile) -> torch.Tensor:
        if silu:
            return decode.silu_linear(x, w, tile=tile)
        return decode.linear(x, w, bias, tile=tile, partials=name not in ("head", "gate_up"))  # as in the step

    base = graph_us([lambda w=w: F.linear(reference.silu_mul(x) if silu else x, w, bias) for w in weights])
    results = []
    for tile in tiles:
        if time.monotonic() > deadline:
            break
        try:
            err = float((summed(ours(weights[0], tile)) - want).norm() / want.norm())
        except Exception as e:  # noqa: BLE001 - e.g. a tile that needs more shared memory than there is
            results.append(dict(tile=tile.__dict__, us=None, err=repr(e)[:120]))
            continue
        if not err < 1e-2:
            results.append(dict(tile=tile.__dict__, us=None, err=err))
            continue
        results.append(dict(tile=tile.__dict__, us=graph_us([lambda w=w, t=tile: ours(w, t) for w in weights]),
                            err=err))
    timed = sorted((r for r in results if r["us"] is not None), key=lambda r: r["us"])
    megabytes = n_out * n_in * 2 / 1e6
    best = timed[0] if timed else None
    return dict(name=name, rows=rows, n_out=n_out, n_in=n_in, cublas_us=base, weight_mb=megabytes,
                best=best, top=timed[:5], tried=len(results), failed=[r for r in results if r["us"] is None])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,32")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop trying candidates after this long")
    ap.add_argument("--wide", action="store_true", help="the wider grid for down and gate/up (see candidates)")
    ap.add_argument("--tiles-json", default=None,
                    help="write the winners as decode_launch.py --tiles reads them: {'n_out,n_in,rows bucket': tile}")
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget_s
    rows_list = [int(r) for r in args.rows.split(",")]
    report = []
    print("| shape | rows | weight MB | cuBLAS µs | best µs | TB/s | tile (n, k, splits, warps, stages) | tried |")
    print("|---|---|---|---|---|---|---|---|")
    tops: dict[str, list[LinearTile]] = {}
    for rows in rows_list:
        for name in args.shapes.split(","):
            n_in = SHAPES[name][1]
            # past the first rows count, only the previous winners are tried (each new BLOCK_M compiles anew)
            tiles = tops.get(name) if rows > 16 and name in tops else candidates(n_in, name, args.wide)
            if not tiles:
                continue
            r = sweep_shape(name, rows, tiles, deadline)
            report.append(r)
            if r["best"] is None:
                print(f"| {name} | {rows} | {r['weight_mb']:.1f} | {r['cublas_us']:.2f} | — | — | — | {r['tried']} |")
                continue
            tops[name] = [LinearTile(**t["tile"]) for t in r["top"]]
            t = r["best"]["tile"]
            tbs = r["weight_mb"] / r["best"]["us"]  # MB per µs = TB/s
            print(f"| {name} | {rows} | {r['weight_mb']:.1f} | {r['cublas_us']:.2f} | {r['best']['us']:.2f} | "
                  f"{tbs:.2f} | {t['block_n']}, {t['block_k']}, {t['splits']}, {t['warps']}, {t['stages']} | "
                  f"{r['tried']} |", flush=True)
    print("\n_LINEAR_TILES entries (n_out, n_in, rows bucket):")
    for r in report:
        if r["best"] is not None:
            t = r["best"]["tile"]
            print(f"    ({r['n_out']}, {r['n_in']}, {r['rows']}): LinearTile({t['block_n']}, {t['block_k']}, "
                  f"{t['splits']}, {t['warps']}, {t['stages']}),  # {r['name']}: {r['best']['us']:.2f} µs "
                  f"(cuBLAS {r['cublas_us']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__), results=report),
                      f, indent=1)
    if args.tiles_json:
        winners = {f"{r['n_out']},{r['n_in']},{decode._rows_bucket(r['rows'])}": r["best"]["tile"]
                   for r in report if r["best"] is not None}
        with open(args.tiles_json, "w") as f:
            json.dump(winners, f, indent=1)


if __name__ == "__main__":
    main()
