"""The flow pool's two big copies, element by element (torch's copy_) against 8-byte words (`copy_words`).

    python benchmarks/pool_copies.py /tmp/m05 [--slots 28] [--frames 832] [--prompt-frames 250] [--voices 15]

- open: a stream opened from a voice's cache, its keys and values for every Euler step copied into a slot;
- pass: a wave of new voices' prompt pass copying each step's keys and values out of their slots into the
  voices' caches (`--voices` voices x the ODE's steps, as `NewVoices._copy_into_caches` does).
Pool and caches are shaped as the engine's for the model (its steps, attention blocks and width), bf16. Medians
of 20 on CUDA events, ms, and the rate in GB/s (bytes read plus written).
"""

from __future__ import annotations

import argparse

import torch
from profile_stages import timed

from cosystream.checkpoint import load_checkpoint
from cosystream.engine.pool_copy import copy_words
from cosystream.models.flow import Flow

REPEATS = 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--slots", type=int, default=28)
    ap.add_argument("--frames", type=int, default=832)
    ap.add_argument("--prompt-frames", type=int, default=250)
    ap.add_argument("--voices", type=int, default=15)
    args = ap.parse_args()
    with torch.device("meta"):  # the model's shapes, no weights
        cfm = Flow(load_checkpoint(args.model_dir).hparams.flow).decoder
    est, steps = cfm.estimator, cfm.num_steps
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    pool = torch.zeros(steps, est.num_attention_blocks, 2, 2 * (args.slots + 1), args.frames, est.inner_dim,
                       device=dev, dtype=bf16)
    n = args.prompt_frames
    caches = [torch.randn(steps, est.num_attention_blocks, 2, 2, n, est.inner_dim, device=dev, dtype=bf16)
              for _ in range(args.voices)]
    rows = [slice(2 * v, 2 * v + 2) for v in range(args.voices)]
    ways = {"element by element": lambda dst, src: dst.copy_(src), "as words": copy_words}
    print(f"{torch.cuda.get_device_name()}: pool {tuple(pool.shape)} ({pool.numel() * 2 / 1e9:.1f} GB), "
          f"a voice's cache {tuple(caches[0].shape)} ({caches[0].numel() * 2 / 1e9:.3f} GB)")
    print("| copy | way | ms | GB/s |")
    print("|---|---|---|---|")
    for name, way in ways.items():
        ms = timed(lambda way=way: way(pool[:, :, :, rows[0], :n], caches[0]), dev, REPEATS, warmup=1)
        moved = 2 * caches[0].numel() * 2
        print(f"| open: one voice's cache into a slot | {name} | {ms:.3f} | {moved / ms / 1e6:.0f} |")
    for name, way in ways.items():
        def wave(way=way) -> None:
            for k in range(steps):
                for v in range(args.voices):
                    way(caches[v][k], pool[k, :, :, rows[v], :n])
        ms = timed(wave, dev, REPEATS, warmup=1)
        moved = 2 * sum(c.numel() for c in caches) * 2
        print(f"| pass: {args.voices} voices' caches out of their slots, step by step | {name} | {ms:.3f} "
              f"| {moved / ms / 1e6:.0f} |")
    for v in range(args.voices):  # the words moved the same bits
        assert torch.equal(caches[v], pool[:, :, :, rows[v], :n])


if __name__ == "__main__":
    main()
