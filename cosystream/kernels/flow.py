"""Triton kernel of the flow estimator's attention over the static K/V pool; numbers as `reference.py`.

PERF: the torch path gathers every row's cached keys and values out of the pool (a copy of
rows × frames × 512 × 2 per attention block, 56 blocks × 10 Euler steps per chunk) and builds an
additive mask; this kernel reads each row's keys in place and derives the chunk mask from positions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
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

    @triton.jit
    def add_layer_norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, sum_ptr, num_t, sx_r, sx_t, sx_c,
                              n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr):
        r = tl.program_id(0)
        offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK)
        mask = (offs_t[:, None] < num_t) & (cols[None, :] < n_cols)
        x = tl.load(x_ptr + r * sx_r + offs_t[:, None] * sx_t + cols[None, :] * sx_c, mask=mask, other=0.0)
        row = (r * num_t + offs_t[:, None]) * n_cols + cols[None, :]
        if HAS_RES:
            res = tl.load(res_ptr + row, mask=mask, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty)  # PARITY: rounded add
        tl.store(sum_ptr + row, x, mask=mask)
        xf = x.to(tl.float32)
        mean = tl.sum(xf, axis=1) / n_cols
        diff = tl.where(mask, xf - mean[:, None], 0.0)
        inv = tl.rsqrt(tl.sum(diff * diff, axis=1) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        tl.store(out_ptr + row, (diff * inv[:, None] * w[None, :] + b[None, :]).to(out_ptr.dtype.element_ty),
                 mask=mask)

    @triton.jit
    def channel_norm_mish_kernel(x_ptr, w_ptr, b_ptr, add_ptr, out_ptr, n_ch, num_t, eps,
                                 HAS_ADD: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
        r = tl.program_id(0)
        offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_c = tl.arange(0, BLOCK_C)
        mask = (offs_c[:, None] < n_ch) & (offs_t[None, :] < num_t)
        ptrs = r * n_ch * num_t + offs_c[:, None] * num_t + offs_t[None, :]
        x = tl.load(x_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / n_ch
        diff = tl.where(mask, x - mean[None, :], 0.0)
        inv = tl.rsqrt(tl.sum(diff * diff, axis=0) / n_ch + eps)
        w = tl.load(w_ptr + offs_c, mask=offs_c < n_ch, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs_c, mask=offs_c < n_ch, other=0.0).to(tl.float32)
        h = (diff * inv[None, :] * w[:, None] + b[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
        # mish(h) = h · tanh(softplus(h)); tanh(log(1 + e^h)) = (n - 1) / (n + 1) with n = (1 + e^h)^2
        e = tl.exp(tl.minimum(h, 20.0))
        n = (1.0 + e) * (1.0 + e)
        y = tl.where(h > 20.0, h, h * (n - 1.0) / (n + 1.0))
        if HAS_ADD:
            a = tl.load(add_ptr + r * n_ch + offs_c, mask=offs_c < n_ch, other=0.0).to(tl.float32)
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32) + a[:, None]  # PARITY: mish rounded, then add
        tl.store(out_ptr + ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def pool_write_kernel(k_ptr, v_ptr, pk_ptr, pv_ptr, rows_ptr, pos_ptr, num_c, s_r, s_c, pool_row_stride,
                          pool_frame_stride, INNER: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1)
        offs = tl.arange(0, INNER)
        frame = tl.load(pos_ptr + r * num_c + c)
        dst = tl.load(rows_ptr + r).to(tl.int64) * pool_row_stride + frame * pool_frame_stride
        src = r * s_r + c * s_c
        tl.store(pk_ptr + dst + offs, tl.load(k_ptr + src + offs))
        tl.store(pv_ptr + dst + offs, tl.load(v_ptr + src + offs))

    @triton.jit
    def linear_kernel(a_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, sum_ptr, nw_ptr, nb_ptr, M, N, K, eps,
                      HAS_BIAS: tl.constexpr, GELU: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr,
                      PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            a = tl.load(a_ptr + offs_m[:, None] * K + k0 + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_ptr + offs_n[None, :] * K + k0 + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None],
                        other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        dt = out_ptr.dtype.element_ty
        y = acc.to(dt).to(tl.float32)  # PARITY: the linear's output is rounded before anything else
        if GELU:
            y = (0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))).to(dt).to(tl.float32)
        if HAS_RES:
            res = tl.load(res_ptr + offs_m[:, None] * N + offs_n[None, :], mask=m_ok[:, None] & n_ok[None, :],
                          other=0.0)
            y = (y + res.to(tl.float32)).to(dt).to(tl.float32)  # PARITY: the residual add is rounded
        ptrs = offs_m[:, None] * N + offs_n[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        if NORM:  # one program holds whole rows (BLOCK_N >= N): LayerNorm over them in the epilogue
            tl.store(sum_ptr + ptrs, y.to(dt), mask=ok)
            mean = tl.sum(tl.where(ok, y, 0.0), axis=1) / N
            diff = tl.where(ok, y - mean[:, None], 0.0)
            inv = tl.rsqrt(tl.sum(diff * diff, axis=1) / N + eps)
            nw = tl.load(nw_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            nb = tl.load(nb_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            y = diff * inv[:, None] * nw[None, :] + nb[None, :]
        tl.store(out_ptr + ptrs, y.to(dt), mask=ok)

    @triton.jit
    def qkv_pool_write_kernel(a_ptr, w_ptr, q_ptr, pk_ptr, pv_ptr, rows_ptr, pos_ptr, M, K, frames_per_row,
                              pool_row_stride, pool_frame_stride, INNER: tl.constexpr, PRECISION: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n0 = tl.program_id(1) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            a = tl.load(a_ptr + offs_m[:, None] * K + k0 + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_ptr + offs_n[None, :] * K + k0 + offs_k[:, None], mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        y = acc.to(q_ptr.dtype.element_ty)
        region = n0 // INNER  # 0: queries, 1: keys, 2: values (BLOCK_N divides INNER)
        col = offs_n - region * INNER
        if region == 0:
            tl.store(q_ptr + offs_m[:, None] * INNER + col[None, :], y, mask=m_ok[:, None])
        else:
            r = offs_m // frames_per_row
            frame = tl.load(pos_ptr + offs_m, mask=m_ok, other=0)
            pool_row = tl.load(rows_ptr + r, mask=m_ok, other=0).to(tl.int64)
            dst = (pool_row * pool_row_stride + frame * pool_frame_stride)[:, None] + col[None, :]
            if region == 1:
                tl.store(pk_ptr + dst, y, mask=m_ok[:, None])
            else:
                tl.store(pv_ptr + dst, y, mask=m_ok[:, None])

    return SimpleNamespace(pooled_attention_kernel=pooled_attention_kernel, add_layer_norm_kernel=add_layer_norm_kernel,
                           channel_norm_mish_kernel=channel_norm_mish_kernel, pool_write_kernel=pool_write_kernel,
                           linear_kernel=linear_kernel, qkv_pool_write_kernel=qkv_pool_write_kernel,
                           next_power_of_2=triton.next_power_of_2)


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


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.add_layer_norm` for x [R, T, C] (any strides) and residual contiguous."""
    k = _kernels()
    rows, num_t, n_cols = x.shape
    out = torch.empty(rows, num_t, n_cols, device=x.device, dtype=x.dtype)
    total = torch.empty_like(out)
    block_t = 16
    k.add_layer_norm_kernel[(rows, -(-num_t // block_t))](
        x, out if residual is None else residual, weight, bias, out, total, num_t, x.stride(0), x.stride(1),
        x.stride(2), n_cols, eps, HAS_RES=residual is not None, BLOCK=k.next_power_of_2(n_cols), BLOCK_T=block_t)
    return out, total


def channel_norm_mish(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                      add: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `reference.channel_norm_mish`; x [R, C, T] contiguous."""
    k = _kernels()
    x = x.contiguous()
    rows, n_ch, num_t = x.shape
    out = torch.empty_like(x)
    block_t = 16
    k.channel_norm_mish_kernel[(rows, -(-num_t // block_t))](
        x, weight, bias, out if add is None else add.contiguous(), out, n_ch, num_t, eps, HAS_ADD=add is not None,
        BLOCK_C=k.next_power_of_2(n_ch), BLOCK_T=block_t)
    return out


def pool_write(k: torch.Tensor, v: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, rows: torch.Tensor,
               write_pos: torch.Tensor) -> None:
    """Same contract as `reference.pool_write`; k and v [R, C, inner] share strides, unit last stride."""
    kern = _kernels()
    batch, num_c, inner = k.shape
    assert k.stride() == v.stride() and k.stride(2) == 1 and pool_k.stride() == pool_v.stride()
    kern.pool_write_kernel[(batch, num_c)](k, v, pool_k, pool_v, rows, write_pos.contiguous(), num_c, k.stride(0),
                                           k.stride(1), pool_k.stride(0), pool_k.stride(1), INNER=inner)


def _precision(x: torch.Tensor) -> str:
    # float32 models get float32 products (tf32 would be a silent precision drop); bf16/fp16 ignore it
    return "ieee" if x.dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class Tile:
    """Launch shape of a GEMM kernel: rows/columns/depth per program, warps, pipeline stages."""

    block_m: int
    block_n: int  # ignored with a LayerNorm epilogue (a program holds whole rows)
    block_k: int = 64
    warps: int = 4
    stages: int = 3


# (kind, small M) -> tile; small M = at most 512 rows (one or two streams' chunk). Picked on the H100
# with benchmarks/kernel_tiles.py; kinds: "norm" (LayerNorm epilogue), "plain", "qkv" (pool write).
TILES: dict[tuple[str, bool], Tile] = {
    ("norm", True): Tile(32, 0), ("norm", False): Tile(32, 0),
    ("plain", True): Tile(64, 128), ("plain", False): Tile(64, 128),
    ("qkv", True): Tile(64, 64), ("qkv", False): Tile(64, 64),
}


def _tile(kind: str, m: int, tile: Tile | None) -> Tile:
    return tile if tile is not None else TILES[(kind, m <= 512)]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, gelu: bool = False,
           residual: torch.Tensor | None = None, norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
           tile: Tile | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.linear`; x [..., K] contiguous, residual contiguous like the output."""
    kern = _kernels()
    assert x.is_contiguous() and weight.is_contiguous()
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    total = torch.empty_like(out) if norm is not None else out
    t = _tile("norm" if norm is not None else "plain", m, tile)
    block_n = kern.next_power_of_2(n) if norm is not None else t.block_n  # LayerNorm: whole rows
    nw, nb, eps = norm if norm is not None else (out, out, 0.0)
    grid = (-(-m // t.block_m), -(-n // block_n))
    kern.linear_kernel[grid](
        x2, weight, bias if bias is not None else out, residual if residual is not None else out, out, total, nw,
        nb, m, n, k, eps, HAS_BIAS=bias is not None, GELU=gelu, HAS_RES=residual is not None,
        NORM=norm is not None, PRECISION=_precision(x), BLOCK_M=t.block_m, BLOCK_N=block_n, BLOCK_K=t.block_k,
        num_warps=t.warps, num_stages=t.stages)
    shape = (*x.shape[:-1], n)
    if norm is not None:
        return out.view(shape), total.view(shape)
    return out.view(shape)


def qkv_pool_write(x: torch.Tensor, qkv_weight: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                   rows: torch.Tensor, write_pos: torch.Tensor, tile: Tile | None = None) -> torch.Tensor:
    """Same contract as `reference.qkv_pool_write`: the q/k/v GEMM writes k and v straight into the pool."""
    kern = _kernels()
    batch, num_c, dim = x.shape
    inner = qkv_weight.shape[0] // 3
    m = batch * num_c
    t = _tile("qkv", m, tile)
    assert x.is_contiguous() and qkv_weight.is_contiguous() and inner % t.block_n == 0
    assert pool_k.stride() == pool_v.stride() and pool_k.stride(2) == 1
    q = torch.empty(batch, num_c, inner, device=x.device, dtype=x.dtype)
    kern.qkv_pool_write_kernel[(-(-m // t.block_m), 3 * inner // t.block_n)](
        x, qkv_weight, q, pool_k, pool_v, rows, write_pos.contiguous(), m, dim, num_c, pool_k.stride(0),
        pool_k.stride(1), INNER=inner, PRECISION=_precision(x), BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, num_warps=t.warps, num_stages=t.stages)
    return q
