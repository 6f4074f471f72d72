"""Triton kernel of the flow estimator's attention over the static K/V pool; numbers as `reference.py`.

PERF: the torch path gathers every row's cached keys and values out of the pool (a copy of
rows × frames × 512 × 2 per attention block, 56 blocks × 10 Euler steps per chunk) and builds an
additive mask; this kernel reads each row's keys in place and derives the chunk mask from positions.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

_BLOCK_M = 64  # new frames per program
_BLOCK_N = 64  # keys per inner step


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def pooled_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, rows_ptr, qpos_ptr, limit_ptr, num_q,
                                q_row_stride, q_frame_stride, pool_row_stride, pool_frame_stride, scale,
                                CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr, INNER: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        r = tl.program_id(0)
        head = tl.program_id(1)
        offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        live = offs_m < num_q
        pool_row = tl.load(rows_ptr + r)
        limit = tl.load(limit_ptr + r)
        qpos = tl.load(qpos_ptr + r * num_q + offs_m, mask=live, other=0)
        if CHUNK > 0:
            q_end = tl.minimum((qpos // CHUNK + 1) * CHUNK, limit)
        else:
            q_end = tl.zeros_like(qpos) + limit
        q = tl.load(q_ptr + r * q_row_stride + offs_m[:, None] * q_frame_stride + head * HEAD_DIM + offs_d[None, :],
                    mask=live[:, None], other=0.0)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        base = pool_row.to(tl.int64) * pool_row_stride + head * HEAD_DIM
        n_keys = tl.max(q_end, axis=0)
        for start in range(0, n_keys, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            in_range = offs_n < n_keys
            k = tl.load(k_ptr + base + offs_n[None, :] * pool_frame_stride + offs_d[:, None],
                        mask=in_range[None, :], other=0.0)
            s = tl.dot(q, k) * scale
            s = tl.where(offs_n[None, :] < q_end[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + base + offs_n[:, None] * pool_frame_stride + offs_d[None, :],
                        mask=in_range[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        dst = o_ptr + (r * num_q + offs_m[:, None]) * INNER + head * HEAD_DIM + offs_d[None, :]
        tl.store(dst, out.to(o_ptr.dtype.element_ty), mask=live[:, None])

    return SimpleNamespace(pooled_attention_kernel=pooled_attention_kernel)


def pooled_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, rows: torch.Tensor,
                     q_pos: torch.Tensor, key_limit: torch.Tensor, chunk: int, attn_len: int,
                     num_heads: int) -> torch.Tensor:
    """Same contract as `reference.pooled_attention`; keys past key_limit / the chunk end are never read.
    `attn_len` bounds nothing here (the limits do); it is kept so both versions take the same call."""
    batch, num_q, inner = q.shape
    head_dim = inner // num_heads
    assert q.stride(2) == 1 and pool_k.stride(2) == 1 and pool_k.stride() == pool_v.stride()
    out = torch.empty(batch, num_q, inner, device=q.device, dtype=q.dtype)
    grid = (batch, num_heads, -(-num_q // _BLOCK_M))
    _kernels().pooled_attention_kernel[grid](
        q, pool_k, pool_v, out, rows, q_pos.contiguous(), key_limit, num_q, q.stride(0), q.stride(1),
        pool_k.stride(0), pool_k.stride(1), head_dim ** -0.5, CHUNK=chunk, HEAD_DIM=head_dim, INNER=inner,
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N)
    return out
