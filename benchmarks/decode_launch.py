"""A/B of the LM decode step's launch options on one machine: programmatic dependent launch
(cosystream.kernels.PDL), RoPE with the cache write inside the attention kernel
(kernels.decode.ROPE_IN_ATTENTION: one kernel a layer fewer) and the loads of what the kernel before does not
write made before the wait for it (kernels.EARLY_LOADS: the attention's cached keys, the norms' weights, the
sampler's row state). (Commit 53b2f5d also A/B'd the linears' weights
loaded before their wait, with one-K-step tiles, and 76ebd11 the reductions run in the last program of the
kernel before them: both slower, removed.)

    python benchmarks/decode_launch.py --model-dir /tmp/m05 --batches 1,16

Each variant gets its own LMRunner whose graphs are captured with the option set; the variants are then
timed in interleaved rounds (so drift of the machine hits all of them alike). Per batch and variant:
`step_ms`, the median of one synchronous step (`LMRunner.decode`: replay, token copy, host wait) as the
engine's first-audio path sees it, and `stream_ms`, 100 replays queued back to back over their count (the
device time per step when the host keeps ahead, as in steady decoding).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cosystream import kernels
from cosystream.checkpoint import load_checkpoint
from cosystream.engine.lm_runner import LMRunner, RowSampling
from cosystream.engine.loader import load_llm
from cosystream.kernels import decode, prefetch

# name -> (PDL, ROPE_IN_ATTENTION, EARLY_LOADS)
VARIANTS = {"plain": (False, False, False), "pdl": (True, False, False), "pdl_rope": (True, True, False),
            "early": (True, True, True)}


def make_runner(lm, batches: list[int], options: tuple[bool, bool, bool],
                tiles: dict[tuple[int, int, int], decode.LinearTile] | None = None,
                prefetch_mb: float | None = None, prefetch_programs: int | None = None) -> LMRunner:
    """A runner whose graphs are captured with these options (and these linear tiles in place of the table's,
    and this L2 prefetch window in MB, `cosystream.kernels.prefetch`; None: the module's)."""
    kernels.PDL, decode.ROPE_IN_ATTENTION, kernels.EARLY_LOADS = options
    saved, saved_window, saved_programs = dict(decode._LINEAR_TILES), prefetch.WINDOW_MB, prefetch.PROGRAMS
    saved_rows = prefetch.MAX_ROWS
    prefetch.MAX_ROWS = 1 << 20  # every batch prefetches (the A/B of the window itself; the engine stops at MAX_ROWS)
    decode._LINEAR_TILES.update(tiles or {})
    if prefetch_mb is not None:
        prefetch.WINDOW_MB = prefetch_mb
    if prefetch_programs is not None:
        prefetch.PROGRAMS = prefetch_programs
    try:
        return _captured_runner(lm, batches)
    finally:
        decode._LINEAR_TILES.clear()
        decode._LINEAR_TILES.update(saved)
        prefetch.WINDOW_MB, prefetch.PROGRAMS, prefetch.MAX_ROWS = saved_window, saved_programs, saved_rows


def read_tiles(path: str) -> dict[tuple[int, int, int], decode.LinearTile]:
    """linear_tiles.py --tiles-json output: {"n_out,n_in,rows bucket": {block_n, block_k, splits, warps, stages}}."""
    with open(path) as f:
        raw = json.load(f)
    return {tuple(int(v) for v in key.split(",")): decode.LinearTile(**tile) for key, tile in raw.items()}


def _captured_runner(lm, batches: list[int]) -> LMRunner:
    d = lm.dims
    runner = LMRunner(lm, max_slots=max(batches), max_len=1024)
    sampling = RowSampling(seed=0, top_p=d.top_p, top_k=d.top_k, win_size=d.win_size, tau_r=d.tau_r,
                           min_len=100_000, ban_special=True)
    prompt = torch.randn(212, d.hidden_size, device=runner.device, dtype=runner.dtype) * 0.02
    for slot in range(max(batches)):
        runner.set_row_sampling(slot, sampling)
        runner.prefill(slot, prompt)
        runner.set_active(slot, True)
    for b in batches:
        runner.decode(b, 500)  # captures this variant's graph with its options
    return runner


def time_variant(runner: LMRunner, b: int, iters: int) -> tuple[float, float]:
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        runner.decode(b, 500)
        samples.append((time.perf_counter() - t0) * 1e3)
    graph = runner.graphs[runner.bucket_for(b, 500)]
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        graph.replay()
    end.record()
    end.synchronize()
    return statistics.median(samples), start.elapsed_time(end) / 100


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiles", default=None, help="linear_tiles.py --tiles-json file: adds the variant "
                    "'early_tiles' (the default step with those linear tiles)")
    ap.add_argument("--prefetch-mb", default="", help="comma-separated L2 prefetch windows in MB: adds the "
                    "variants 'early_pfN' (the default step with that window, cosystream.kernels.prefetch)")
    ap.add_argument("--prefetch-programs", default="", help="comma-separated program counts of the prefetch "
                    "kernel: each --prefetch-mb window runs with each ('early_pfN_pP'); default: the module's")
    ap.add_argument("--shared-weights", action="store_true", help="every layer reads the first one's weights "
                    "(L2-resident; profile_stages.share_weights): what HBM fetches cost the step")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    names = args.variants.split(",")
    with torch.inference_mode():
        lm = load_llm(load_checkpoint(args.model_dir), torch.device("cuda"), torch.bfloat16)
        runners = {name: make_runner(lm, batches, VARIANTS[name], prefetch_mb=0.0) for name in names}
        if args.tiles:
            runners["early_tiles"] = make_runner(lm, batches, VARIANTS["early"], read_tiles(args.tiles), 0.0)
        for mb in filter(None, args.prefetch_mb.split(",")):
            for p in args.prefetch_programs.split(","):
                name = f"early_pf{mb}" + (f"_p{p}" if p else "")
                runners[name] = make_runner(lm, batches, VARIANTS["early"], prefetch_mb=float(mb),
                                            prefetch_programs=int(p) if p else None)
        if args.shared_weights:
            from profile_stages import share_weights

            shared = load_llm(load_checkpoint(args.model_dir), torch.device("cuda"), torch.bfloat16)
            share_weights(list(shared.layers))
            runners["early_shared"] = make_runner(shared, batches, VARIANTS["early"], prefetch_mb=0.0)
        results: dict[str, dict[str, list[float]]] = {}
        for _ in range(args.rounds):
            for name, runner in runners.items():
                for b in batches:
                    step, stream = time_variant(runner, b, args.iters)
                    r = results.setdefault(f"{name} b{b}", {"step_ms": [], "stream_ms": []})
                    r["step_ms"].append(step)
                    r["stream_ms"].append(stream)
    print("| variant | step ms (median of rounds) | stream ms/step | rounds (step) |\n|---|---|---|---|")
    for key, r in results.items():
        print(f"| {key} | {statistics.median(r['step_ms']):.3f} | {statistics.median(r['stream_ms']):.3f} | "
              f"{', '.join(f'{x:.3f}' for x in r['step_ms'])} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {"device": torch.cuda.get_device_name(), "batches": batches}, "results": results},
                      f, indent=2)


if __name__ == "__main__":
    main()
