"""Triton kernels of the LM decode step; same signatures and numbers as `reference.py`.

PERF: the unfused step is ~30 kernels per layer (RMSNorm casts, RoPE's cat/neg/mul/add, index_put,
SDPA with a materialised mask, SiLU and mul); this is 8 per layer: norm, qkv GEMM, attention split
over the keys (with RoPE and the cache write), its combine, o GEMM, norm, gate/up GEMM, and the down
GEMM (with silu·up).

The kernels (`_decode_jit.py`) are imported on first use (`_kernels()`), so importing this module needs no
Triton and the interpreter (TRITON_INTERPRET=1) can run them on the CPU for tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from cosystream.kernels import pdl_launch, prefetch
from cosystream.kernels.prefetch import prefetching  # noqa: F401  (the decode ops' interface)

_KEYS_PER_BLOCK = 64  # keys loaded per inner step of the attention kernel
_MAX_SPLITS = 16  # attention programs per (row, kv head); their partial softmaxes are combined after


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton

    from cosystream.kernels import _decode_jit

    kernels = {name: getattr(_decode_jit, name) for name in dir(_decode_jit) if name.endswith("_kernel")}
    return SimpleNamespace(**kernels, next_power_of_2=triton.next_power_of_2)


def _precision(x: torch.Tensor) -> str:
    # float32 models get float32 products (tf32 would be a silent precision drop); bf16/fp16 ignore it
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _parts(x: torch.Tensor) -> int:
    """Split-K partial count of a linear's output: 0 for a plain [rows, n] tensor."""
    return x.shape[0] if x.dim() == 3 else 0


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [rows, n], or a `linear` output given as float32 partials [S, rows, n] (summed here)."""
    k = _kernels()
    parts = _parts(x)
    rows, n_cols = x.shape[-2:]
    dtype = weight.dtype if parts else x.dtype
    out = torch.empty(rows, n_cols, device=x.device, dtype=dtype)
    res_out = torch.empty_like(out) if residual is not None else x
    if residual is None and parts:
        raise ValueError("add_rms_norm: partial sums need a residual stream to land in")
    k.add_rms_norm_kernel[(rows,)](x, x if residual is None else residual, weight, out, res_out, n_cols,
                                   rows * n_cols, eps, HAS_RES=residual is not None, PARTS=parts,
                                   BLOCK=k.next_power_of_2(n_cols), **pdl_launch(x, early=True))
    return out, res_out


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache_k: torch.Tensor, cache_v: torch.Tensor, num_heads: int, num_kv_heads: int,
                  slots: torch.Tensor | None = None, all_heads: bool = False) -> torch.Tensor:
    """qkv: [B, (H + 2·KV)·D], or a `linear` output given as float32 partials [S, B, ...] (summed here);
    row b's k/v go to cache row slots[b] (b without slots). Contract as `reference.rope_write_kv`."""
    k = _kernels()
    parts = _parts(qkv)
    batch = qkv.shape[-2]
    head_dim = cache_k.shape[-1]
    out_heads = num_heads + 2 * num_kv_heads if all_heads else num_heads
    q = torch.empty(batch, out_heads, head_dim, device=qkv.device, dtype=cache_k.dtype)
    k.rope_write_kv_kernel[(batch, num_heads + num_kv_heads)](
        qkv, positions, positions if slots is None else slots, cos, sin, q, cache_k, cache_v, cache_k.stride(0),
        cache_k.stride(1), qkv[0].numel() if parts else 0, NUM_HEADS=num_heads, NUM_KV=num_kv_heads,
        HEAD_DIM=head_dim, PARTS=parts, HAS_SLOTS=slots is not None, ALL_HEADS=all_heads, **pdl_launch(qkv))
    return q


def decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, positions: torch.Tensor,
                     attn_len: int) -> torch.Tensor:
    """Split-K decode attention: each program covers `keys_per_split` keys of one (row, kv head); the
    split count is fixed by `attn_len` (a static bucket), so the launch shape suits CUDA graphs, while
    each program reads only keys below its row's own length."""
    return _attention(q, None, cache_k, cache_v, positions, attn_len)


def rope_attention_linear(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          cache_k: torch.Tensor, cache_v: torch.Tensor, num_heads: int, num_kv_heads: int,
                          attn_len: int, weight: torch.Tensor, tile: LinearTile | None = None) -> torch.Tensor:
    """The decode step's attention block: linear(decode_attention(rope_write_kv(...)), weight) for rows
    [0, B) of the cache. PERF: the attention programs rotate their queries and the new key themselves
    and store the new key/value: no RoPE kernel. qkv as `rope_write_kv`'s; output as `linear`'s."""
    if (num_heads + 2 * num_kv_heads) * cache_k.shape[-1] != qkv.shape[-1] or cache_k.shape[1] != num_kv_heads:
        raise ValueError(f"rope_attention_linear: qkv of width {qkv.shape[-1]} does not hold {num_heads} query "
                         f"and 2 × {num_kv_heads} key/value heads of {cache_k.shape[-1]}")
    attn = _attention(qkv, (cos, sin), cache_k, cache_v, positions, attn_len)
    return linear(attn, weight, tile=tile)


def _attention(q: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, cache_k: torch.Tensor,
               cache_v: torch.Tensor, positions: torch.Tensor, attn_len: int) -> torch.Tensor:
    """Split attention, then its combine: [B, H·D]. rope None: q [B, H, D] rotated queries, every key in the
    cache; else q is the q/k/v projection (see rope_attention_linear) and the new keys/values are stored."""
    k = _kernels()
    kv_heads, head_dim = cache_k.shape[1], cache_k.shape[-1]
    batch = q.shape[-2] if rope is not None else q.shape[0]
    num_heads = q.shape[-1] // head_dim - 2 * kv_heads if rope is not None else q.shape[1]
    groups = num_heads // kv_heads
    block_m = max(16, k.next_power_of_2(groups))  # tl.dot needs at least 16 rows
    keys_per_split = max(_KEYS_PER_BLOCK, -(-attn_len // _MAX_SPLITS))
    keys_per_split = -(-keys_per_split // _KEYS_PER_BLOCK) * _KEYS_PER_BLOCK
    splits = -(-attn_len // keys_per_split)
    o_part = torch.empty(batch, kv_heads, splits, block_m, head_dim, device=q.device, dtype=torch.float32)
    ml_part = torch.empty(batch, kv_heads, splits, block_m, 2, device=q.device, dtype=torch.float32)
    parts = _parts(q) if rope is not None else 0
    cos, sin = rope if rope is not None else (positions, positions)  # unused without RoPE
    k.attention_split_kernel[(batch, kv_heads, splits)](
        q, cache_k, cache_v, positions, cos, sin, o_part, ml_part, cache_k.stride(0), cache_k.stride(1),
        q[0].numel() if parts else 0, keys_per_split, splits, head_dim ** -0.5, GROUPS=groups, NUM_KV=kv_heads,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=_KEYS_PER_BLOCK, ROPE=rope is not None, PARTS=parts,
        PRECISION=_precision(cache_k), **pdl_launch(q, early=rope is not None))
    out = torch.empty(batch, num_heads * head_dim, device=q.device, dtype=cache_k.dtype)
    k.attention_combine_kernel[(batch, num_heads)](
        o_part, ml_part, out, splits, GROUPS=groups, NUM_KV=kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m,
        SPLITS=k.next_power_of_2(splits), **pdl_launch(q))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    k = _kernels()
    rows, width = gate_up.shape
    n_cols = width // 2
    out = torch.empty(rows, n_cols, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    k.silu_mul_kernel[(rows, -(-n_cols // block))](gate_up, out, n_cols, BLOCK=block)
    return out


# Rows up to which `linear` streams the weight itself; above, cuBLAS's GEMM tiles win (and the step is
# no longer bound by reading the weight once).
MAX_LINEAR_ROWS = 32


@dataclass(frozen=True)
class LinearTile:
    block_n: int  # output features per program
    block_k: int  # inputs per inner step
    splits: int  # programs along the input dimension (float32 partials when > 1)
    warps: int
    stages: int


def linear_tile(rows: int, n_out: int, n_in: int) -> LinearTile:
    """Launch shape for a weight-streaming linear: enough programs to keep every SM's loads in flight."""
    return _LINEAR_TILES.get((n_out, n_in, _rows_bucket(rows))) or _default_tile(n_out, n_in)


def _rows_bucket(rows: int) -> int:
    return 1 if rows <= 4 else 16 if rows <= 16 else 32


def _default_tile(n_out: int, n_in: int) -> LinearTile:
    # the measured winners' pattern: 64 outputs a program, input split until there are ~128+ programs
    splits = 1
    while -(-n_out // 64) * splits < 128 and n_in // (splits * 2) >= 64:
        splits *= 2
    return LinearTile(64, 64, splits, 4, 3)


# (n_out, n_in, rows bucket) -> tile, measured on the H100 (benchmarks/linear_tiles.py, retired in f313fec:
# `git show f313fec^:benchmarks/linear_tiles.py`; µs per call in a
# graph of 24 calls on distinct weights, against cuBLAS): CosyVoice2-0.5B's q/k/v, o, gate/up, down, head.
_LINEAR_TILES: dict[tuple[int, int, int], LinearTile] = {
    (1152, 896, 1): LinearTile(64, 128, 4, 4, 3),  # q/k/v: 3.32 µs (cuBLAS 4.43)
    (896, 896, 1): LinearTile(64, 64, 8, 4, 4),  # o: 2.61 (4.27)
    (9728, 896, 1): LinearTile(128, 128, 1, 4, 4),  # gate/up (whole, for the down's prologue): 8.31 (8.61)
    (896, 4864, 1): LinearTile(64, 128, 8, 8, 3),  # down: 7.29 (10.98 with the SiLU·up kernel)
    (6564, 896, 1): LinearTile(64, 128, 1, 4, 4),  # head (never split): 6.65 (8.66)
    (1152, 896, 16): LinearTile(64, 64, 8, 4, 3),  # 3.36 (4.70)
    (896, 896, 16): LinearTile(64, 64, 8, 4, 3),  # 2.71 (4.17)
    (9728, 896, 16): LinearTile(128, 128, 1, 8, 4),  # 8.48 (8.77)
    (896, 4864, 16): LinearTile(64, 128, 8, 4, 3),  # 7.17 (12.63)
    (6564, 896, 16): LinearTile(64, 128, 1, 4, 4),  # 6.67 (13.22)
    (1152, 896, 32): LinearTile(64, 64, 8, 4, 4),  # 3.55 (4.82)
    (896, 896, 32): LinearTile(64, 64, 8, 4, 3),  # 2.79 (4.34)
    (9728, 896, 32): LinearTile(128, 128, 1, 8, 4),  # 8.65 (8.89)
    (896, 4864, 32): LinearTile(64, 128, 8, 8, 3),  # 9.10 (13.02)
    (6564, 896, 32): LinearTile(64, 128, 1, 4, 4),  # 6.95 (11.76)
}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, partials: bool = True,
           tile: LinearTile | None = None) -> torch.Tensor:
    """x [rows, n_in] @ weight[n_out, n_in]^T (+ bias). PERF: for up to MAX_LINEAR_ROWS rows the weight is
    streamed once by many programs; with splits > 1 the result comes back as float32 partial sums
    [splits, rows, n_out] that `add_rms_norm` and `rope_write_kv` add up (their sum, rounded once, is
    the output: no reduce kernel, no atomics); partials=False asks for the plain [rows, n_out] output."""
    return _linear(x, weight, bias, silu=False, tile=tile, partials=partials)


def silu_linear(gate_up: torch.Tensor, weight: torch.Tensor, tile: LinearTile | None = None) -> torch.Tensor:
    """linear(silu(gate) · up, weight) for gate_up = [gate | up] ([rows, 2·n_in], whole: the gate/up
    linear runs with partials=False): the activation is computed while the weight streams (no kernel of
    its own); output as `linear`'s."""
    return _linear(gate_up, weight, None, silu=True, tile=tile, partials=True)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool,
            tile: LinearTile | None, partials: bool) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError("linear: the input must be a whole [rows, n_in] tensor, not partial sums")
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("linear: the input's rows and the weight must be contiguous")
    rows = x.shape[0]
    n_out, n_in = weight.shape
    if rows > MAX_LINEAR_ROWS:
        return torch.nn.functional.linear(silu_mul(x) if silu else x, weight, bias)
    k = _kernels()
    prefetch.before(weight)
    tile = tile or linear_tile(rows, n_out, n_in)
    k_per_split = -(-n_in // ((tile.splits if partials else 1) * tile.block_k)) * tile.block_k
    splits = -(-n_in // k_per_split)
    shape = (splits, rows, n_out) if splits > 1 else (rows, n_out)
    out = torch.empty(shape, device=x.device, dtype=torch.float32 if splits > 1 else weight.dtype)
    grid = (-(-n_out // tile.block_n), splits)
    k.linear_kernel[grid](x, weight, weight if bias is None else bias, out, rows, n_out, n_in, x.stride(0),
                          k_per_split, rows * n_out, SILU=silu,
                          HAS_BIAS=bias is not None, PARTIAL=splits > 1,
                          PRECISION=_precision(weight), BLOCK_N=tile.block_n,
                          BLOCK_K=tile.block_k, BLOCK_M=max(16, k.next_power_of_2(rows)),
                          num_warps=tile.warps, num_stages=tile.stages, **pdl_launch(x))
    return out
