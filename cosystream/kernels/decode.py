"""Triton kernels of the LM decode step; same signatures and numbers as `reference.py`.

PERF: the unfused step is ~30 kernels per layer (RMSNorm casts, RoPE's cat/neg/mul/add, index_put,
SDPA with a materialised mask, SiLU and mul); this is 9 per layer: norm, qkv GEMM, rope+cache write,
attention (split over the keys, then a combine), o GEMM, norm, gate/up GEMM, silu·up, down GEMM.

The kernels are defined on first use (`_kernels()`), so importing this module needs no Triton and
the interpreter (TRITON_INTERPRET=1) can run them on the CPU for tests.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

_KEYS_PER_BLOCK = 64  # keys loaded per inner step of the attention kernel
_MAX_SPLITS = 16  # attention programs per (row, kv head); their partial softmaxes are combined after


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                            HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
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
    def rope_write_kv_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_out_ptr, k_ptr, v_ptr,
                             slot_stride, head_stride, NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr,
                             HEAD_DIM: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)  # [0, H): a query head; [H, H+KV): a key head (and its value head)
        half = HEAD_DIM // 2
        offs = tl.arange(0, HEAD_DIM // 2)
        pos = tl.load(pos_ptr + row)
        c = tl.load(cos_ptr + pos * half + offs)
        s = tl.load(sin_ptr + pos * half + offs)
        base = qkv_ptr + row * (NUM_HEADS + 2 * NUM_KV) * HEAD_DIM + head * HEAD_DIM
        x1 = tl.load(base + offs).to(tl.float32)
        x2 = tl.load(base + half + offs).to(tl.float32)
        o1 = (x1 * c - x2 * s).to(q_out_ptr.dtype.element_ty)
        o2 = (x2 * c + x1 * s).to(q_out_ptr.dtype.element_ty)
        if head < NUM_HEADS:
            dst = q_out_ptr + (row * NUM_HEADS + head) * HEAD_DIM
            tl.store(dst + offs, o1)
            tl.store(dst + half + offs, o2)
        else:
            kv = head - NUM_HEADS
            cache_off = row * slot_stride + kv * head_stride + pos * HEAD_DIM
            tl.store(k_ptr + cache_off + offs, o1)
            tl.store(k_ptr + cache_off + half + offs, o2)
            v_src = base + NUM_KV * HEAD_DIM  # the value head sits NUM_KV heads after its key head
            full = tl.arange(0, HEAD_DIM)
            tl.store(v_ptr + cache_off + full, tl.load(v_src + full))

    @triton.jit
    def attention_split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_part_ptr, ml_part_ptr, slot_stride, head_stride,
                               keys_per_split, num_splits, scale, GROUPS: tl.constexpr, NUM_KV: tl.constexpr,
                               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
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
            s = tl.dot(q, k) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + cache + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
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
                                 SPLITS: tl.constexpr):
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

    return SimpleNamespace(**{k: v for k, v in locals().items() if k.endswith("_kernel")},
                           next_power_of_2=triton.next_power_of_2)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    k = _kernels()
    rows, n_cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    k.add_rms_norm_kernel[(rows,)](x, x if residual is None else residual, weight, out, res_out, n_cols, eps,
                                   HAS_RES=residual is not None, BLOCK=k.next_power_of_2(n_cols))
    return out, res_out


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache_k: torch.Tensor, cache_v: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    k = _kernels()
    batch = qkv.shape[0]
    head_dim = cache_k.shape[-1]
    q = torch.empty(batch, num_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    k.rope_write_kv_kernel[(batch, num_heads + num_kv_heads)](
        qkv, positions, cos, sin, q, cache_k, cache_v, cache_k.stride(0), cache_k.stride(1),
        NUM_HEADS=num_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim)
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
        BLOCK_N=_KEYS_PER_BLOCK)
    out = torch.empty(batch, num_heads * head_dim, device=q.device, dtype=q.dtype)
    k.attention_combine_kernel[(batch, num_heads)](
        o_part, ml_part, out, splits, GROUPS=groups, NUM_KV=kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m,
        SPLITS=k.next_power_of_2(splits))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    k = _kernels()
    rows, width = gate_up.shape
    n_cols = width // 2
    out = torch.empty(rows, n_cols, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    k.silu_mul_kernel[(rows, -(-n_cols // block))](gate_up, out, n_cols, BLOCK=block)
    return out
