"""Triton kernels of the flow estimator (attention over the static K/V pool, norms, causal convs); numbers as
`reference.py`.

PERF: the torch path gathers every row's cached keys and values out of the pool (a copy of
rows × frames × 512 × 2 per attention block, 56 blocks × 10 Euler steps per chunk) and builds an
additive mask; this kernel reads each row's keys in place and derives the chunk mask from positions.
The causal conv kernel replaces cat + tail copy + cuDNN conv (+ layout conversions and the bias add)
+ norm/Mish/adds, about 7 launches, by one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch


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
        # PERF: keys below every live query's end are visible to all of them: those blocks need no mask
        # (the final pass: all but the last block); the scores are kept in log2 units (exp2, the scale
        # and log2(e) folded into one multiply).
        n_free = (tl.min(tl.where(live, q_end, n_keys), axis=0) // BLOCK_N) * BLOCK_N
        qk_scale = scale * 1.4426950408889634
        for start in range(0, n_free, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k = tl.load(k_ptr + base + offs_n[None, :] * pool_frame_stride + offs_d[:, None])
            s = tl.dot(q, k) * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            v = tl.load(v_ptr + base + offs_n[:, None] * pool_frame_stride + offs_d[None, :])
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        for start in range(n_free, n_keys, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            in_range = offs_n < n_keys
            k = tl.load(k_ptr + base + offs_n[None, :] * pool_frame_stride + offs_d[:, None],
                        mask=in_range[None, :], other=0.0)
            s = tl.dot(q, k) * qk_scale
            s = tl.where(offs_n[None, :] < q_end[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
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
    def norm_gemm_kernel(x_ptr, sx_r, sx_t, sx_c, res_ptr, lnw_ptr, lnb_ptr, eps, w_ptr, bias_ptr, out_ptr,
                         sum_ptr, pk_ptr, pv_ptr, rows_ptr, pos_ptr, pool_row_stride, pool_frame_stride, M, N,
                         num_t, DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RES: tl.constexpr,
                         HAS_BIAS: tl.constexpr, GELU: tl.constexpr, QKV: tl.constexpr, INNER: tl.constexpr,
                         PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # prologue: s = x + res (rounded), a = LayerNorm(s) over the whole row (DIM fits one tile)
        pid_n = tl.program_id(1)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < M
        d_ok = offs_d < DIM
        ok = m_ok[:, None] & d_ok[None, :]
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        # PERF: the weight tile first: it depends on nothing before it, so its load is in flight while the
        # rows load and the norm is computed (the two latencies overlap instead of adding up)
        w = tl.load(w_ptr + offs_n[None, :] * DIM + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        r = offs_m // num_t
        t = offs_m - r * num_t
        x = tl.load(x_ptr + (r * sx_r + t * sx_t)[:, None] + offs_d[None, :] * sx_c, mask=ok, other=0.0)
        dt = x.dtype
        if HAS_RES:
            res = tl.load(res_ptr + offs_m[:, None] * DIM + offs_d[None, :], mask=ok, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(dt)  # PARITY: the residual add is rounded
        if pid_n == 0:
            tl.store(sum_ptr + offs_m[:, None] * DIM + offs_d[None, :], x, mask=ok)
        xf = x.to(tl.float32)
        mean = tl.sum(xf, axis=1) / DIM
        diff = tl.where(ok, xf - mean[:, None], 0.0)
        inv = tl.rsqrt(tl.sum(diff * diff, axis=1) / DIM + eps)
        lw = tl.load(lnw_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        lb = tl.load(lnb_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        a = (diff * inv[:, None] * lw[None, :] + lb[None, :]).to(dt)  # PARITY: the norm's output is rounded
        # GEMM: a [BLOCK_M, DIM] @ W[n0:n0+BLOCK_N, :]^T
        acc = tl.dot(a, w, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = acc.to(dt)
        if GELU:
            yf = y.to(tl.float32)  # PARITY: GELU (exact, erf) of the rounded linear output
            y = (0.5 * yf * (1.0 + tl.erf(yf * 0.7071067811865476))).to(dt)
        if QKV:  # columns [0, INNER): queries to out; [INNER, 2·INNER) keys, then values: into the pool
            region = n0 // INNER  # BLOCK_N divides INNER, so a tile lies in one region
            col = offs_n - region * INNER
            if region == 0:
                tl.store(out_ptr + offs_m[:, None] * INNER + col[None, :], y, mask=m_ok[:, None])
            else:
                frame = tl.load(pos_ptr + offs_m, mask=m_ok, other=0)
                pool_row = tl.load(rows_ptr + r, mask=m_ok, other=0).to(tl.int64)
                dst = (pool_row * pool_row_stride + frame * pool_frame_stride)[:, None] + col[None, :]
                if region == 1:
                    tl.store(pk_ptr + dst, y, mask=m_ok[:, None])
                else:
                    tl.store(pv_ptr + dst, y, mask=m_ok[:, None])
        else:
            tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], y, mask=m_ok[:, None] & n_ok[None, :])


    @triton.jit
    def causal_conv_kernel(x_ptr, s_ptr, wt_ptr, b_ptr, nw_ptr, nb_ptr, add_ptr, res_ptr, out_ptr, tail_ptr,
                           n_in, n_out, num_t, eps, sx_r, sx_c, sx_t, ss_r, ss_c, ss_t,
                           sa_r, sa_c, sr_r, sr_c, sr_t, st_r, st_c, st_t,
                           HAS_NORM: tl.constexpr, MISH: tl.constexpr, HAS_ADD: tl.constexpr, HAS_RES: tl.constexpr,
                           PRECISION: tl.constexpr, BLOCK_CO: tl.constexpr, BLOCK_CI: tl.constexpr,
                           BLOCK_T: tl.constexpr, PHASE: tl.constexpr):
        # One program: BLOCK_T frames of row r × every output channel (the channel LayerNorm stays in the
        # program). Implicit GEMM [frames, 3·Cin] x [3·Cin, Cout] over the weights stored [3, Cin, Cout]
        # (coalesced along Cout), one tap and BLOCK_CI input channels a step.
        # PHASE 0 does it all. When there are too few such programs to spread the weight reads over the
        # GPU, PHASE 1 computes conv + bias for BLOCK_CO of the channels (program_id 2) and PHASE 2, with
        # x = PHASE 1's output [R, Cout, T], applies the per-frame epilogue (norm, Mish, add, res).
        r = tl.program_id(0)
        tile = tl.program_id(1)
        co_block = tl.program_id(2)
        offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_o = co_block * BLOCK_CO + tl.arange(0, BLOCK_CO)
        offs_i = tl.arange(0, BLOCK_CI)
        live_t = offs_t < num_t
        live_o = offs_o < n_out
        x_row = x_ptr + r.to(tl.int64) * sx_r
        s_row = s_ptr + r.to(tl.int64) * ss_r  # already at the conv's first state channel
        dt = out_ptr.dtype.element_ty
        if PHASE == 2:
            h = tl.load(x_row + offs_o[None, :] * num_t + offs_t[:, None], mask=live_t[:, None] & live_o[None, :],
                        other=0.0).to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_T, BLOCK_CO), tl.float32)
            for c0 in range(0, n_in, BLOCK_CI):
                ci = c0 + offs_i
                live_i = ci < n_in
                for k in tl.static_range(3):
                    f = offs_t + (k - 2)  # the input frame tap k reads; f < 0: tail slot f + 2
                    in_x = ((f >= 0) & live_t)[:, None] & live_i[None, :]
                    in_s = ((f < 0) & live_t)[:, None] & live_i[None, :]
                    xv = tl.load(x_row + f[:, None] * sx_t + ci[None, :] * sx_c, mask=in_x, other=0.0)
                    sv = tl.load(s_row + (f + 2)[:, None] * ss_t + ci[None, :] * ss_c, mask=in_s, other=0.0)
                    w = tl.load(wt_ptr + (k * n_in + ci)[:, None] * n_out + offs_o[None, :],
                                mask=live_i[:, None] & live_o[None, :], other=0.0)
                    acc = tl.dot(tl.where(in_s, sv, xv), w, acc, input_precision=PRECISION)
            b = tl.load(b_ptr + offs_o, mask=live_o, other=0.0).to(tl.float32)
            # PARITY: cuDNN returns the conv rounded and torch adds the bias after it, rounded again; each
            # later step is rounded as its torch op's output (padded channels stay exactly 0 throughout).
            h = (acc.to(dt).to(tl.float32) + b[None, :]).to(dt).to(tl.float32)
        if HAS_NORM:
            mean = tl.sum(h, axis=1) / n_out
            diff = tl.where(live_o[None, :], h - mean[:, None], 0.0)
            inv = tl.rsqrt(tl.sum(diff * diff, axis=1) / n_out + eps)
            nw = tl.load(nw_ptr + offs_o, mask=live_o, other=0.0).to(tl.float32)
            nb = tl.load(nb_ptr + offs_o, mask=live_o, other=0.0).to(tl.float32)
            h = (diff * inv[:, None] * nw[None, :] + nb[None, :]).to(dt).to(tl.float32)
        if MISH:
            # mish(h) = h · tanh(softplus(h)) = h · p / (p + 2) with p = e^h (2 + e^h) (no 1 - 1 cancellation
            # for very negative h); softplus(h) = h past 20, as torch
            e = tl.exp(tl.minimum(h, 20.0))
            p = e * (2.0 + e)
            h = tl.where(h > 20.0, h, h * p / (p + 2.0)).to(dt).to(tl.float32)
        if HAS_ADD:
            a = tl.load(add_ptr + r * sa_r + offs_o * sa_c, mask=live_o, other=0.0).to(tl.float32)
            h = (h + a[None, :]).to(dt).to(tl.float32)
        mask = live_t[:, None] & live_o[None, :]
        if HAS_RES:
            h += tl.load(res_ptr + r.to(tl.int64) * sr_r + offs_o[None, :] * sr_c + offs_t[:, None] * sr_t,
                         mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + (r.to(tl.int64) * n_out + offs_o[None, :]) * num_t + offs_t[:, None], h.to(dt), mask=mask)
        # The new tail, the last 2 frames of [old tail, x], goes to a buffer nobody reads during this launch
        # (see causal_conv); the program of the last frame tile (and first channel block) writes it.
        if PHASE != 2:  # noqa: SIM102 - a compile-time branch around a run-time one
            if (tile == (num_t - 1) // BLOCK_T) & (co_block == 0):
                j = tl.arange(0, 2)
                f = num_t - 2 + j
                t_row = tail_ptr + r.to(tl.int64) * st_r
                for c0 in range(0, n_in, BLOCK_CI):
                    ci = c0 + offs_i
                    live_i = ci < n_in
                    xv = tl.load(x_row + ci[:, None] * sx_c + f[None, :] * sx_t,
                                 mask=live_i[:, None] & (f >= 0)[None, :], other=0.0)
                    sv = tl.load(s_row + ci[:, None] * ss_c + (f + 2)[None, :] * ss_t,
                                 mask=live_i[:, None] & (f < 0)[None, :], other=0.0)
                    tl.store(t_row + ci[:, None] * st_c + j[None, :] * st_t, tl.where((f < 0)[None, :], sv, xv),
                             mask=live_i[:, None])


    @triton.jit
    def project_cfg_euler_kernel(h_ptr, w_ptr, b_ptr, x_ptr, x_out_ptr, rows_out_ptr, n_in, num_t, dt, dt_ptr,
                                 cfg_c, cfg_u, sh_r, sh_c, sh_t, N_OUT: tl.constexpr, BLOCK_O: tl.constexpr,
                                 BLOCK_CI: tl.constexpr, BLOCK_T: tl.constexpr, PRECISION: tl.constexpr,
                                 DT_FROM_PTR: tl.constexpr):
        # One program: BLOCK_T frames of one request's CFG pair (rows 2p, 2p + 1 of h). DT_FROM_PTR: the
        # step size is read from the device (a graph that serves every Euler step), else it is `dt`.
        pair = tl.program_id(0)
        if DT_FROM_PTR:
            dt = tl.load(dt_ptr)
        offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_o = tl.arange(0, BLOCK_O)
        offs_i = tl.arange(0, BLOCK_CI)
        live_t = offs_t < num_t
        live_o = offs_o < N_OUT
        h_cond = h_ptr + (2 * pair).to(tl.int64) * sh_r
        h_uncond = h_cond + sh_r
        acc_c = tl.zeros((BLOCK_T, BLOCK_O), tl.float32)
        acc_u = tl.zeros((BLOCK_T, BLOCK_O), tl.float32)
        for c0 in range(0, n_in, BLOCK_CI):
            ci = c0 + offs_i
            live_i = ci < n_in
            w = tl.load(w_ptr + offs_o[None, :] * n_in + ci[:, None], mask=live_i[:, None] & live_o[None, :],
                        other=0.0)
            at = offs_t[:, None] * sh_t + ci[None, :] * sh_c
            m = live_t[:, None] & live_i[None, :]
            acc_c = tl.dot(tl.load(h_cond + at, mask=m, other=0.0), w, acc_c, input_precision=PRECISION)
            acc_u = tl.dot(tl.load(h_uncond + at, mask=m, other=0.0), w, acc_u, input_precision=PRECISION)
        dt_ = rows_out_ptr.dtype.element_ty
        b = tl.load(b_ptr + offs_o, mask=live_o, other=0.0).to(tl.float32)
        # PARITY: the projection rounded, + bias rounded (as the 1x1 conv), then the CFG mix and the Euler
        # update in float32 in cfm.euler_step's order
        v_c = (acc_c.to(dt_).to(tl.float32) + b[None, :]).to(dt_).to(tl.float32)
        v_u = (acc_u.to(dt_).to(tl.float32) + b[None, :]).to(dt_).to(tl.float32)
        mask = live_t[:, None] & live_o[None, :]
        at_x = (pair.to(tl.int64) * N_OUT + offs_o[None, :]) * num_t + offs_t[:, None]
        x = tl.load(x_ptr + at_x, mask=mask, other=0.0)
        x_new = x + dt * (cfg_c * v_c - cfg_u * v_u)
        tl.store(x_out_ptr + at_x, x_new, mask=mask)
        at_rows = ((2 * pair).to(tl.int64) * N_OUT + offs_o[None, :]) * num_t + offs_t[:, None]
        tl.store(rows_out_ptr + at_rows, x_new.to(dt_), mask=mask)
        tl.store(rows_out_ptr + at_rows + N_OUT * num_t, x_new.to(dt_), mask=mask)

    return SimpleNamespace(pooled_attention_kernel=pooled_attention_kernel, add_layer_norm_kernel=add_layer_norm_kernel,
                           channel_norm_mish_kernel=channel_norm_mish_kernel, pool_write_kernel=pool_write_kernel,
                           norm_gemm_kernel=norm_gemm_kernel, causal_conv_kernel=causal_conv_kernel,
                           project_cfg_euler_kernel=project_cfg_euler_kernel,
                           next_power_of_2=triton.next_power_of_2)


def pooled_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, rows: torch.Tensor,
                     q_pos: torch.Tensor, key_limit: torch.Tensor, chunk: int, attn_len: int,
                     num_heads: int, tile: Tile | None = None) -> torch.Tensor:
    """Same contract as `reference.pooled_attention`; keys past key_limit / the chunk end are never read.
    `attn_len` bounds nothing here (the limits do); it is kept so both versions take the same call.
    Tile: block_m queries per program, block_n keys per inner step (default: ATTENTION_TILES)."""
    batch, num_q, inner = q.shape
    head_dim = inner // num_heads
    assert q.stride(2) == 1 and pool_k.stride(2) == 1 and pool_k.stride() == pool_v.stride()
    t = tile if tile is not None else ATTENTION_TILES[(chunk > 0, batch * num_q <= SMALL_ROWS)]
    out = torch.empty(batch, num_q, inner, device=q.device, dtype=q.dtype)
    grid = (batch, num_heads, -(-num_q // t.block_m))
    _kernels().pooled_attention_kernel[grid](
        q, pool_k, pool_v, out, rows, q_pos.contiguous(), key_limit, num_q, q.stride(0), q.stride(1),
        pool_k.stride(0), pool_k.stride(1), head_dim ** -0.5, CHUNK=chunk, HEAD_DIM=head_dim, INNER=inner,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.warps, num_stages=t.stages)
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
    """Same contract as `reference.channel_norm_mish`; x [R, C, T] contiguous. The estimator now runs
    this inside `causal_conv`; kept as the measured baseline of benchmarks/kernel_tiles.py."""
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
    """Launch shape of a GEMM kernel: rows/columns per program, warps, pipeline stages."""

    block_m: int
    block_n: int
    warps: int = 4
    stages: int = 3
    co_blocks: int = 1  # conv only: output-channel blocks (> 1: conv and epilogue as two launches)


SMALL_ROWS, LARGE_ROWS = 512, 8192  # row-count classes of the tile tables: 0 up to SMALL, 1 up to LARGE, 2 above


def row_class(rows: int) -> int:
    """0: one or two streams' chunk, 1: 16 streams' chunks, 2: official final passes of several streams."""
    return 0 if rows <= SMALL_ROWS else 1 if rows <= LARGE_ROWS else 2


# (kind, row class) -> tile. Picked on the H100 with benchmarks/kernel_tiles.py (docs/benchmarks.md);
# kinds: "qkv" (pool-write epilogue), "gelu". The estimator runs the prologue GEMMs only at row class 0
# (above it cuBLAS and a separate norm win: 101 vs 143 µs at 26,624 rows); classes 1 and 2 serve tests
# and sweeps.
TILES: dict[tuple[str, int], Tile] = {
    ("qkv", 0): Tile(32, 128, 4, 2), ("qkv", 1): Tile(64, 128, 4, 2), ("qkv", 2): Tile(64, 128, 8, 2),
    ("gelu", 0): Tile(32, 64, 8, 2), ("gelu", 1): Tile(64, 128, 4, 2), ("gelu", 2): Tile(64, 128, 8, 2),
    # conv: block_m frames, block_n input channels a step, output channels in co_blocks launches.
    # 26,624 rows (class 2): 56.1 µs (16×64: 109, cuDNN + epilogue 102.7)
    ("conv", 0): Tile(16, 32, 8, 2, 4), ("conv", 1): Tile(16, 64, 8, 2), ("conv", 2): Tile(64, 32, 4, 2),
}

# The channel split was measured at 256 output channels (four blocks of 64); narrower blocks were not, so
# the default tiles never split below this width (explicit tiles do, for tests and sweeps).
_MIN_CO_BLOCK = 64

# (chunk-masked, at most 512 query rows) -> attention tile; chunk-masked: a streamed chunk (False: the
# official final pass, full attention over the whole utterance). Picked on the H100 with
# benchmarks/attention_tiles.py (docs/benchmarks.md; µs per call at 0d95793).
ATTENTION_TILES: dict[tuple[bool, bool], Tile] = {
    (True, True): Tile(16, 64, 4, 3),  # one stream's chunk: 6.9 µs (64×64: 6.8)
    (True, False): Tile(128, 32, 8, 3),  # 16 streams' chunks: 14.0 µs (64×32: 14.4)
    (False, True): Tile(64, 64, 4, 3),  # a very short final pass (not measured)
    (False, False): Tile(128, 64, 8, 3),  # final passes, 1 / 16 streams: 14.8 / 167 µs (128×32: 16.6 / 182)
}


def _launch_norm_gemm(x: torch.Tensor, residual: torch.Tensor | None, norm: tuple[torch.Tensor, torch.Tensor, float],
                      weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, *, gelu: bool,
                      pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None, kind: str,
                      tile: Tile | None) -> torch.Tensor:
    kern = _kernels()
    rows, num_t, dim = x.shape
    m = rows * num_t
    n = weight.shape[0]
    t = tile if tile is not None else TILES[(kind, row_class(m))]
    if pool is not None:
        while (n // 3) % t.block_n:  # a q/k/v tile must lie in one region (small test models)
            t = Tile(t.block_m, t.block_n // 2, t.warps, t.stages)
    total = torch.empty(rows, num_t, dim, device=x.device, dtype=x.dtype)
    assert weight.is_contiguous() and (residual is None or residual.is_contiguous())
    pk, pv, prow, ppos = pool if pool is not None else (out, out, out, out)
    inner = n // 3 if pool is not None else 1
    assert pool is None or (inner % t.block_n == 0 and pk.stride() == pv.stride() and pk.stride(2) == 1)
    kern.norm_gemm_kernel[(-(-m // t.block_m), -(-n // t.block_n))](
        x, x.stride(0), x.stride(1), x.stride(2), residual if residual is not None else x, norm[0], norm[1],
        norm[2], weight, bias if bias is not None else weight, out, total, pk, pv, prow, ppos,
        pk.stride(0) if pool is not None else 0, pk.stride(1) if pool is not None else 0, m, n, num_t, DIM=dim,
        BLOCK_D=kern.next_power_of_2(dim), HAS_RES=residual is not None, HAS_BIAS=bias is not None, GELU=gelu,
        QKV=pool is not None, INNER=inner, PRECISION=_precision(x), BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        num_warps=t.warps, num_stages=t.stages)
    return total


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: tuple[torch.Tensor, torch.Tensor, float],
                weight: torch.Tensor, bias: torch.Tensor | None, *, gelu: bool = False, tile: Tile | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.norm_linear`; x [R, T, dim] any strides, residual contiguous."""
    rows, num_t, _ = x.shape
    out = torch.empty(rows, num_t, weight.shape[0], device=x.device, dtype=x.dtype)
    total = _launch_norm_gemm(x, residual, norm, weight, bias, out, gelu=gelu, pool=None,
                              kind="gelu", tile=tile)
    return out, total


def norm_qkv_pool_write(x: torch.Tensor, residual: torch.Tensor | None, norm: tuple[torch.Tensor, torch.Tensor, float],
                        qkv_weight: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, rows: torch.Tensor,
                        write_pos: torch.Tensor, tile: Tile | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.norm_qkv_pool_write`: k and v go straight from the GEMM into the pool."""
    batch, num_t, _ = x.shape
    q = torch.empty(batch, num_t, qkv_weight.shape[0] // 3, device=x.device, dtype=x.dtype)
    total = _launch_norm_gemm(x, residual, norm, qkv_weight, None, q, gelu=False,
                              pool=(pool_k, pool_v, rows, write_pos.contiguous()), kind="qkv", tile=tile)
    return q, total


def _taps_first(weight: torch.Tensor) -> torch.Tensor:
    """The conv weight [Cout, Cin, 3] stored [3, Cin, Cout] (the kernel's coalesced order), kept on the
    weight itself: made on the first call (the engine's comes before any graph capture) and again only
    if the weight moves. Weights are not modified in place after loading."""
    cached = getattr(weight, "_cosystream_taps_first", None)
    if cached is None or cached[0] != weight.data_ptr():
        cached = (weight.data_ptr(), weight.detach().permute(2, 1, 0).contiguous())
        weight._cosystream_taps_first = cached  # type: ignore[attr-defined]
    return cached[1]


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, offset: int, weight: torch.Tensor, bias: torch.Tensor,
                norm_weight: torch.Tensor | None = None, norm_bias: torch.Tensor | None = None, eps: float = 1e-5,
                mish: bool = False, add: torch.Tensor | None = None, res: torch.Tensor | None = None,
                tail_out: torch.Tensor | None = None, tile: Tile | None = None) -> torch.Tensor:
    """Same contract as `reference.causal_conv`; x, add and res any strides; returns [R, Cout, T] contiguous.
    `tile` (block_m = frames, block_n = input channels per step) overrides the launch shape (benchmarks).

    The tail: programs of the first frame tile read the old tail while the last tile's program writes the
    new one, so writing it in place would race. The kernel writes it into tail_out (the caller's buffer for
    every conv of a step, copied back once: no launch per conv) or, without one, into a small buffer that
    one copy after the kernel puts in conv_state.
    """
    kern = _kernels()
    rows, n_in, num_t = x.shape
    n_out = weight.shape[0]
    assert num_t >= 1 and tuple(weight.shape[1:]) == (n_in, 3) and conv_state.shape[2] == 2
    assert tail_out is None or (tail_out.shape == conv_state.shape and tail_out is not conv_state)
    state = conv_state[:, offset:offset + n_in]
    tail = torch.empty_like(state) if tail_out is None else tail_out[:, offset:offset + n_in]
    out = torch.empty(rows, n_out, num_t, device=x.device, dtype=x.dtype)
    t = tile if tile is not None else TILES[("conv", row_class(rows * num_t))]
    block_t, block_ci, warps, stages = t.block_m, t.block_n, t.warps, t.stages
    weight_t = _taps_first(weight)
    norm = norm_weight is not None
    a = out if add is None else add
    rs = out if res is None else res
    epilogue = dict(HAS_NORM=norm, MISH=mish, HAS_ADD=add is not None, HAS_RES=res is not None)
    co_blocks = t.co_blocks if n_out % t.co_blocks == 0 else 1
    if tile is None and n_out // co_blocks < _MIN_CO_BLOCK:
        co_blocks = 1
    # PERF: few frame tiles (one stream's chunk: 14 programs, each reading the whole weight) leave most
    # SMs idle; splitting the output channels spreads the weight reads, the epilogue runs after.
    split = co_blocks > 1
    conv_out = torch.empty_like(out) if split and any(epilogue.values()) else out
    grid = (rows, -(-num_t // block_t))

    def launch(phase: int, x_in: torch.Tensor, dst: torch.Tensor, blocks: int, flags: dict) -> None:
        kern.causal_conv_kernel[grid + (blocks,)](
            x_in, state, weight_t, bias, norm_weight if norm else out, norm_bias if norm else out, a, rs, dst, tail,
            n_in, n_out, num_t, eps, *x_in.stride(), *state.stride(), a.stride(0), a.stride(1),
            rs.stride(0), rs.stride(1), rs.stride(-1), *tail.stride(), **flags, PRECISION=_precision(x),
            BLOCK_CO=kern.next_power_of_2(n_out // blocks), BLOCK_CI=block_ci, BLOCK_T=block_t, PHASE=phase,
            num_warps=warps, num_stages=stages)

    if not split:
        launch(0, x, out, 1, epilogue)
    else:
        launch(1, x, conv_out, co_blocks, {k: False for k in epilogue})
        if conv_out is not out:
            launch(2, conv_out, out, 1, epilogue)
    if tail_out is None:
        state.copy_(tail)
    return out


def project_cfg_euler(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor,
                      dt: float | torch.Tensor, cfg_rate: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.project_cfg_euler`; h [2B, Cin, T] any strides, x [B, Cout, T] float32
    contiguous, dt a float or a one-element float32 tensor on x's device (read when the kernel runs).
    PERF: one launch for the final 1x1 conv, the CFG mix, the Euler update and the next step's input rows
    (a cuDNN conv with its two layout transforms and ~8 element-wise kernels before)."""
    kern = _kernels()
    rows, n_in, num_t = h.shape
    n_out = weight.shape[0]
    assert rows == 2 * x.shape[0] and x.is_contiguous() and x.dtype == torch.float32
    w = weight.reshape(n_out, n_in)
    assert w.is_contiguous()
    x_new = torch.empty_like(x)
    next_rows = torch.empty(rows, n_out, num_t, device=h.device, dtype=h.dtype)
    block_t = 16
    on_device = isinstance(dt, torch.Tensor)
    assert not on_device or (dt.numel() == 1 and dt.dtype == torch.float32 and dt.device == x.device)
    kern.project_cfg_euler_kernel[(x.shape[0], -(-num_t // block_t))](
        h, w, bias, x, x_new, next_rows, n_in, num_t, 0.0 if on_device else float(dt), dt if on_device else x,
        1.0 + cfg_rate, float(cfg_rate), h.stride(0), h.stride(1), h.stride(2), N_OUT=n_out,
        BLOCK_O=kern.next_power_of_2(n_out), BLOCK_CI=64, BLOCK_T=block_t, PRECISION=_precision(h),
        DT_FROM_PTR=on_device, num_warps=4)
    return x_new, next_rows
