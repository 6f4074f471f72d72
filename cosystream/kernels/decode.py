"""Triton kernels of the LM decode step; same signatures and numbers as `reference.py`.

PERF: the unfused step is ~30 kernels per layer (RMSNorm casts, RoPE's cat/neg/mul/add, index_put,
SDPA with a materialised mask, SiLU and mul); this is 9 per layer: norm, qkv GEMM, rope+cache write,
attention (split over the keys, then a combine), o GEMM, norm, gate/up GEMM, silu·up, down GEMM.

The kernels are defined on first use (`_kernels()`), so importing this module needs no Triton and
the interpreter (TRITON_INTERPRET=1) can run them on the CPU for tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from cosystream.kernels import pdl_launch

_KEYS_PER_BLOCK = 64  # keys loaded per inner step of the attention kernel
_MAX_SPLITS = 16  # attention programs per (row, kv head); their partial softmaxes are combined after


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    from cosystream.kernels._launch_jit import follow_previous  # under `if PDL:` (see _launch_jit)

    @triton.jit
    def add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, part_stride, eps,
                            HAS_RES: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            follow_previous()
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        if PARTS > 0:  # x is a linear's split-K partial sums [PARTS, rows, n]: their sum is its output
            acc = tl.zeros((BLOCK,), tl.float32)
            for p in tl.static_range(PARTS):  # unrolled: the loads go out together
                acc += tl.load(x_ptr + p * part_stride + row * n_cols + cols, mask=mask, other=0.0)
            x = acc.to(out_ptr.dtype.element_ty)  # PARITY: the linear's output is rounded once
        else:
            x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)  # PARITY: bf16 add
            tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        normed = (xf * inv).to(out_ptr.dtype.element_ty).to(tl.float32)  # PARITY: cast before the weight
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rope_write_kv_kernel(qkv_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, q_out_ptr, k_ptr, v_ptr,
                             slot_stride, head_stride, part_stride, NUM_HEADS: tl.constexpr,
                             NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, PARTS: tl.constexpr,
                             PARTS_BLOCK: tl.constexpr, HAS_SLOTS: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            follow_previous()
        row = tl.program_id(0)
        head = tl.program_id(1)  # [0, H): a query head; [H, H+KV): a key head (and its value head)
        half = HEAD_DIM // 2
        offs = tl.arange(0, HEAD_DIM // 2)
        pos = tl.load(pos_ptr + row)
        c = tl.load(cos_ptr + pos * half + offs)
        s = tl.load(sin_ptr + pos * half + offs)
        base = row * (NUM_HEADS + 2 * NUM_KV) * HEAD_DIM + head * HEAD_DIM
        # qkv may be split-K partial sums [PARTS, ...] (PARTS = 0: one plain tensor): rows of one load, summed
        part_offs = tl.arange(0, PARTS_BLOCK)[:, None] * part_stride
        part_ok = tl.arange(0, PARTS_BLOCK)[:, None] < max(PARTS, 1)
        x1 = tl.sum(tl.load(qkv_ptr + part_offs + (base + offs)[None, :], mask=part_ok, other=0.0).to(tl.float32), 0)
        x2 = tl.sum(tl.load(qkv_ptr + part_offs + (base + half + offs)[None, :], mask=part_ok, other=0.0
                            ).to(tl.float32), 0)
        if PARTS > 0:  # PARITY: the linear's output is rounded once
            x1 = x1.to(q_out_ptr.dtype.element_ty).to(tl.float32)
            x2 = x2.to(q_out_ptr.dtype.element_ty).to(tl.float32)
        o1 = (x1 * c - x2 * s).to(q_out_ptr.dtype.element_ty)
        o2 = (x2 * c + x1 * s).to(q_out_ptr.dtype.element_ty)
        if head < NUM_HEADS:
            dst = q_out_ptr + (row * NUM_HEADS + head) * HEAD_DIM
            tl.store(dst + offs, o1)
            tl.store(dst + half + offs, o2)
        else:
            kv = head - NUM_HEADS
            slot = tl.load(slot_ptr + row).to(tl.int64) if HAS_SLOTS else row  # its cache row
            cache_off = slot * slot_stride + kv * head_stride + pos * HEAD_DIM
            tl.store(k_ptr + cache_off + offs, o1)
            tl.store(k_ptr + cache_off + half + offs, o2)
            v_src = base + NUM_KV * HEAD_DIM  # the value head sits NUM_KV heads after its key head
            full = tl.arange(0, HEAD_DIM)
            v = tl.sum(tl.load(qkv_ptr + part_offs + (v_src + full)[None, :], mask=part_ok, other=0.0
                               ).to(tl.float32), 0)
            tl.store(v_ptr + cache_off + full, v.to(v_ptr.dtype.element_ty))

    @triton.jit
    def attention_split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_part_ptr, ml_part_ptr, slot_stride, head_stride,
                               keys_per_split, num_splits, scale, GROUPS: tl.constexpr, NUM_KV: tl.constexpr,
                               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               PRECISION: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            follow_previous()
        row = tl.program_id(0)
        kv = tl.program_id(1)
        split = tl.program_id(2)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        n_keys = tl.load(pos_ptr + row) + 1
        head0 = kv * GROUPS
        q = tl.load(q_ptr + (row * NUM_KV * GROUPS + head0 + offs_m[:, None]) * HEAD_DIM + offs_d[None, :],
                    mask=offs_m[:, None] < GROUPS, other=0.0)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        start = split * keys_per_split
        stop = tl.minimum(start + keys_per_split, n_keys)
        cache = row * slot_stride + kv * head_stride
        for block in range(start, stop, BLOCK_N):
            offs_n = block + tl.arange(0, BLOCK_N)
            valid = offs_n < stop
            k = tl.load(k_ptr + cache + offs_n[None, :] * HEAD_DIM + offs_d[:, None], mask=valid[None, :], other=0.0)
            s = tl.dot(q, k, input_precision=PRECISION) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + cache + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        # partials [B, KV, splits, BLOCK_M, D]; an empty split leaves m = -inf, l = 0
        part = ((row * NUM_KV + kv) * num_splits + split) * BLOCK_M
        tl.store(o_part_ptr + (part + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], acc)
        tl.store(ml_part_ptr + (part + offs_m) * 2, m_i)
        tl.store(ml_part_ptr + (part + offs_m) * 2 + 1, l_i)

    @triton.jit
    def attention_combine_kernel(o_part_ptr, ml_part_ptr, out_ptr, num_splits, GROUPS: tl.constexpr,
                                 NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                                 SPLITS: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            follow_previous()
        row = tl.program_id(0)
        head = tl.program_id(1)
        kv = head // GROUPS
        g = head % GROUPS
        offs_s = tl.arange(0, SPLITS)
        offs_d = tl.arange(0, HEAD_DIM)
        live = offs_s < num_splits
        part = ((row * NUM_KV + kv) * num_splits + offs_s) * BLOCK_M + g
        m = tl.load(ml_part_ptr + part * 2, mask=live, other=float("-inf"))
        l_part = tl.load(ml_part_ptr + part * 2 + 1, mask=live, other=0.0)
        m_max = tl.max(m, axis=0)
        w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)
        o = tl.load(o_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=live[:, None], other=0.0)
        out = tl.sum(o * w[:, None], axis=0) / tl.sum(l_part * w, axis=0)
        tl.store(out_ptr + (row * NUM_KV * GROUPS + head) * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def silu_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # PARITY: bf16 silu
        tl.store(out_ptr + row * n_cols + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, rows, n_out, n_in, x_stride, k_per_split, part_stride,
                      SILU: tl.constexpr, HAS_BIAS: tl.constexpr,
                      PARTIAL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
        # Weight-streaming GEMM for a few rows: out^T [BLOCK_N, rows] = W tile @ x^T, so the weight's
        # output features fill the MMA's wide side and the rows (padded to 16) its narrow one.
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        if PDL:
            follow_previous()
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        n_ok = offs_n < n_out
        m_ok = offs_m < rows
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        k_start = split * k_per_split
        for kk in range(0, k_per_split, BLOCK_K):
            offs_k = k_start + kk + tl.arange(0, BLOCK_K)
            k_ok = offs_k < n_in
            w = tl.load(w_ptr + offs_n[:, None] * n_in + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)
            x_mask = m_ok[None, :] & k_ok[:, None]
            x_offs = offs_m[None, :] * x_stride + offs_k[:, None]
            if SILU:  # x = [gate | up] of width 2·n_in: the input is silu(gate)·up, rounded as torch does
                gate = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0).to(tl.float32)
                up = tl.load(x_ptr + n_in + x_offs, mask=x_mask, other=0.0).to(tl.float32)
                act = (gate / (1.0 + tl.exp(-gate))).to(w.dtype).to(tl.float32)
                xt = (act * up).to(w.dtype)
            else:
                xt = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0)
            acc = tl.dot(w, xt, acc, input_precision=PRECISION)
        if HAS_BIAS:  # added once, by the first split
            bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            acc += tl.where(split == 0, bias, 0.0)[:, None]
        out_offs = offs_m[None, :] * n_out + offs_n[:, None]
        out_mask = n_ok[:, None] & m_ok[None, :]
        if PARTIAL:  # float32 partial sums [splits, rows, n_out]; the consumer adds them (no atomics: deterministic)
            tl.store(out_ptr + split * part_stride + out_offs, acc, mask=out_mask)
        else:
            tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)

    return SimpleNamespace(**{k: v for k, v in locals().items() if k.endswith("_kernel")},
                           next_power_of_2=triton.next_power_of_2)


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
                                   BLOCK=k.next_power_of_2(n_cols), **pdl_launch(x))
    return out, res_out


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache_k: torch.Tensor, cache_v: torch.Tensor, num_heads: int, num_kv_heads: int,
                  slots: torch.Tensor | None = None) -> torch.Tensor:
    """qkv: [B, (H + 2·KV)·D], or a `linear` output given as float32 partials [S, B, ...] (summed here);
    row b's k/v go to cache row slots[b] (b without slots)."""
    k = _kernels()
    parts = _parts(qkv)
    batch = qkv.shape[-2]
    head_dim = cache_k.shape[-1]
    q = torch.empty(batch, num_heads, head_dim, device=qkv.device, dtype=cache_k.dtype)
    k.rope_write_kv_kernel[(batch, num_heads + num_kv_heads)](
        qkv, positions, positions if slots is None else slots, cos, sin, q, cache_k, cache_v, cache_k.stride(0),
        cache_k.stride(1), qkv[0].numel() if parts else 0, NUM_HEADS=num_heads, NUM_KV=num_kv_heads,
        HEAD_DIM=head_dim, PARTS=parts, PARTS_BLOCK=k.next_power_of_2(max(parts, 1)), HAS_SLOTS=slots is not None,
        **pdl_launch(qkv))
    return q


def decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, positions: torch.Tensor,
                     attn_len: int) -> torch.Tensor:
    """Split-K decode attention: each program covers `keys_per_split` keys of one (row, kv head); the
    split count is fixed by `attn_len` (a static bucket), so the launch shape suits CUDA graphs, while
    each program reads only keys below its row's own length."""
    k = _kernels()
    batch, num_heads, head_dim = q.shape
    kv_heads = cache_k.shape[1]
    groups = num_heads // kv_heads
    block_m = max(16, k.next_power_of_2(groups))  # tl.dot needs at least 16 rows
    keys_per_split = max(_KEYS_PER_BLOCK, -(-attn_len // _MAX_SPLITS))
    keys_per_split = -(-keys_per_split // _KEYS_PER_BLOCK) * _KEYS_PER_BLOCK
    splits = -(-attn_len // keys_per_split)
    o_part = torch.empty(batch, kv_heads, splits, block_m, head_dim, device=q.device, dtype=torch.float32)
    ml_part = torch.empty(batch, kv_heads, splits, block_m, 2, device=q.device, dtype=torch.float32)
    k.attention_split_kernel[(batch, kv_heads, splits)](
        q, cache_k, cache_v, positions, o_part, ml_part, cache_k.stride(0), cache_k.stride(1), keys_per_split,
        splits, head_dim ** -0.5, GROUPS=groups, NUM_KV=kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m,
        BLOCK_N=_KEYS_PER_BLOCK, PRECISION=_precision(q), **pdl_launch(q))
    out = torch.empty(batch, num_heads * head_dim, device=q.device, dtype=q.dtype)
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


# (n_out, n_in, rows bucket) -> tile, measured on the H100 (benchmarks/linear_tiles.py; µs per call in a
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
