"""A/B of the LM decode step's attention: one pass per (row, kv head) vs split-K + combine.

    python benchmarks/ab_decode_attention.py --model-dir /tmp/m05 [--batches 1,16,64]

Times the graphed decode step (`LMRunner.decode`, median of CUDA-event timings) at attended-length
buckets 256 and 512 with `kernels.decode.SINGLE_PASS_MAX_LEN` set to 0 (always split) and to 512.
"""

from __future__ import annotations

import argparse

import torch
from profile_stages import timed  # beside this file

from cosystream.checkpoint import load_checkpoint
from cosystream.engine.lm_runner import LMRunner, RowSampling
from cosystream.engine.loader import load_llm
from cosystream.kernels import decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    batches = [int(b) for b in args.batches.split(",")]
    lm = load_llm(load_checkpoint(args.model_dir), device, dtype)
    d = lm.dims
    prompt = torch.randn(212, d.hidden_size, device=device, dtype=dtype) * 0.02
    print("| single-pass max | attended bucket | " + " | ".join(f"b={b} ms" for b in batches) + " |")
    print("|---|---|" + "---|" * len(batches))
    for limit in (0, 512):
        decode.SINGLE_PASS_MAX_LEN = limit
        runner = LMRunner(lm, max_slots=max(batches), max_len=1024)  # fresh graphs for this setting
        for slot in range(max(batches)):
            runner.set_row_sampling(slot, RowSampling(seed=slot, top_p=d.top_p, top_k=d.top_k, win_size=d.win_size,
                                                      tau_r=d.tau_r, min_len=10_000, ban_special=True))
            runner.prefill(slot, prompt)
            runner.set_active(slot, True)
        for max_position in (240, 500):
            ms = [timed(lambda b=b, p=max_position, r=runner: r.decode(b, p), device, args.iters) for b in batches]
            bucket = runner.bucket_for(1, max_position)[1]
            print(f"| {limit} | {bucket} | " + " | ".join(f"{v:.3f}" for v in ms) + " |", flush=True)


if __name__ == "__main__":
    main()
