"""Triton kernel of the HiFT vocoder's Snake activation; numbers as `reference.snake`.

PERF: the module's statement, x + 1/(α + ε) · sin(xα)², is seven launches (the broadcast products take
torch's generic strided kernel), five of them reading and writing the whole activation; one HiFT call
runs 72 Snakes, a third of them on its widest tensors (64 channels × 120 samples a mel frame). This
kernel reads x once and writes the result once (HiFT of 16 first chunks on the H100: 15.9 → 10.3 ms of
kernel time, docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

_SNAKE_BLOCK = 1024  # samples per program (a row of one channel)


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def snake_kernel(x_ptr, alpha_ptr, out_ptr, n_ch, n_t, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # batch · channels + channel
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = offs < n_t
        base = row.to(tl.int64) * n_t
        x = tl.load(x_ptr + base + offs, mask=live, other=0.0)
        dt = x.dtype
        a = tl.load(alpha_ptr + row % n_ch).to(tl.float32)
        # PARITY: every intermediate rounded as the torch statement rounds it (x·α, sin, the square,
        # α + ε, its reciprocal, the product, the sum)
        xa = (x.to(tl.float32) * a).to(dt).to(tl.float32)
        s = tl.sin(xa).to(dt).to(tl.float32)
        sq = (s * s).to(dt).to(tl.float32)
        # IEEE division as torch's reciprocal (Triton's `/` on fp32 is the approximate div.full)
        inv = tl.math.div_rn(1.0, (a + eps).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        y = (inv * sq).to(dt).to(tl.float32)
        tl.store(out_ptr + base + offs, (x.to(tl.float32) + y).to(dt), mask=live)

    return SimpleNamespace(snake_kernel=snake_kernel)


def snake(x: torch.Tensor, alpha: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `reference.snake`: x [B, C, T] (made contiguous), alpha [C]; returns a new tensor."""
    x = x.contiguous()
    batch, n_ch, n_t = x.shape
    out = torch.empty_like(x)
    if x.numel():
        _kernels().snake_kernel[(batch * n_ch, -(-n_t // _SNAKE_BLOCK))](
            x, alpha.contiguous(), out, n_ch, n_t, eps, BLOCK=_SNAKE_BLOCK,
            # PARITY: no fused multiply-add: the product is rounded to the activation's dtype before the sum,
            # as torch computes it (with fusion one bf16 result in eleven differed by a step on the H100)
            enable_fp_fusion=False)
    return out
