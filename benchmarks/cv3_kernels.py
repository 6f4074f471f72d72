"""CosyVoice3 DiT ops at the real shapes: each Triton kernel of the pooled flow (kernels/flow.py) against its
torch statement (kernels/reference.py, what the pool ran before the kernels), µs per call.

For each (streams B, new frames N, key frames) of the engine's chunk plan (prompt 150 tokens, 250 tokens: chunks
of 50/100/200 new frames over a growing prefix, and the official final pass over the whole utterance), the
2B estimator rows of one layer of one Euler step:
  * attention: rotary + K/V write into the slot pool + attention over each row's pool row (block-causal chunks;
    a final pass reads its own keys from the projection);
  * conv: the conv position embedding's grouped conv (31 taps, 16 groups) + Mish, over the 30-frame tail + N;
  * adaln: the gated residual add + the adaLN-modulated LayerNorm.
Random inputs, bf16. `--attention-tiles` also times the attention kernel under other launch tiles
(block_m x block_n x warps x stages), to pick ATTENTION_TILES for these shapes. Example:
    python benchmarks/cv3_kernels.py --batches 1,16
"""

from __future__ import annotations

import argparse

import torch

from cosystream.kernels import flow, reference
from cosystream.kernels.flow import Tile
from cosystream.testing.random_model_cv3 import hparams_cv3

SIZE = "0.5b"
# (new frames, start frame, full pass) of the standard plan's flow calls at a 150-token prompt, 250 tokens
CALLS = [(100, 250, False), (100, 300, False), (200, 400, False), (800, 0, True)]


def timed(fn, reps: int) -> float:
    """Median µs of `fn` over `reps` calls, after a warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


class Case:
    """One flow call's inputs for one layer: 2B rows of N new frames from `start` (full: a final pass)."""

    def __init__(self, batch: int, n: int, start: int, full: bool, dev: torch.device, dtype: torch.dtype) -> None:
        d = hparams_cv3(SIZE).flow.dit
        self.d, self.n, self.start, self.full = d, n, start, full
        self.inner, rows = d.heads * d.dim_head, 2 * batch
        gen = torch.Generator(device=dev).manual_seed(n + start)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=dev, dtype=dtype)

        self.pool = rand(2, 2 * (batch + 1), start + n + 16, self.inner)
        self.qkv = rand(rows, n, 3 * self.inner)
        self.q_pos = (start + torch.arange(n, device=dev)).expand(rows, -1).contiguous()
        freqs = torch.rand(d.dim_head // 2, device=dev).repeat_interleave(2)
        angles = self.q_pos[..., None].float() * freqs
        self.cos, self.sin = angles.cos().contiguous(), angles.sin().contiguous()
        self.limit = torch.full((rows,), start + n, device=dev)
        self.rows = torch.arange(rows, device=dev) + (0 if full else 2)  # a final pass: the batch's own rows
        self.chunk = 0 if full else d.static_chunk_size
        self.x = rand(rows, d.dim, d.conv_pos_kernel - 1 + n)  # the tail and the new frames (the pool's cat)
        self.conv_w = rand(d.dim, d.dim // d.conv_pos_groups, d.conv_pos_kernel) / 40
        self.conv_b = rand(d.dim)
        self.h, self.y = rand(rows, n, d.dim), rand(rows, n, d.dim)
        self.w, self.b, self.gate = rand(d.dim), rand(d.dim), rand(d.dim)

    def attention(self, ops, tile: Tile | None = None) -> None:
        """Rotary + K/V write + attention (the rotary turns qkv in place each call: a rotation, bounded)."""
        qkv, inner = self.qkv, self.inner
        if self.full:
            keys, values = qkv[..., inner:2 * inner], qkv[..., 2 * inner:]
            ops.partial_rotary(qkv, self.cos, self.sin)
        else:
            keys, values = self.pool[0], self.pool[1]
            ops.partial_rotary(qkv, self.cos, self.sin, (keys, values, self.rows, self.q_pos))
        extra = {} if tile is None else {"tile": tile}
        ops.pooled_attention(qkv[..., :inner], keys, values, self.rows, self.q_pos, self.limit, self.chunk,
                             self.start + self.n, self.d.heads, **extra)

    def conv(self, ops) -> None:
        ops.grouped_conv_mish(self.x, self.conv_w, self.conv_b, self.h)

    def adaln(self, ops) -> None:
        ops.add_layer_norm(self.y, self.h, self.w, self.b, 1e-6, gate=self.gate)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--attention-tiles", default="", help="extra tiles 'm,n,warps,stages;...' to time")
    args = p.parse_args()
    dev = torch.device("cuda")
    tiles = [Tile(*map(int, t.split(","))) for t in args.attention_tiles.split(";") if t]
    print(f"CosyVoice3 {SIZE} DiT ops, one layer of one Euler step · {torch.cuda.get_device_name(dev)} · bf16 · "
          "µs per call (median)\n")
    print("| streams | new frames | start | full | op | torch statements µs | Triton µs | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        for n, start, full in CALLS:
            case = Case(batch, n, start, full, dev, torch.bfloat16)
            for name in ("attention", "conv", "adaln"):
                op = getattr(case, name)
                t_ref = timed(lambda op=op: op(reference), args.reps)
                t_new = timed(lambda op=op: op(flow), args.reps)
                print(f"| {batch} | {n} | {start} | {full} | {name} | {t_ref:.1f} | {t_new:.1f} "
                      f"| {t_ref / t_new:.2f}x |")
            for tile in tiles:
                t = timed(lambda tile=tile, case=case: case.attention(flow, tile), args.reps)
                print(f"| {batch} | {n} | {start} | {full} | attention {tile.block_m}x{tile.block_n} "
                      f"w{tile.warps} s{tile.stages} | | {t:.1f} | |")


if __name__ == "__main__":
    main()
