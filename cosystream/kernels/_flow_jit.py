"""The Triton source of `cosystream.kernels.flow` (imported on first use: it needs Triton at import, and
Triton resolves the helpers a kernel calls from module globals). Each kernel's `PDL` flag: see _launch_jit."""

import triton
import triton.language as tl

from cosystream.kernels._launch_jit import follow_previous


@triton.jit
def pooled_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, rows_ptr, qpos_ptr, limit_ptr, num_q,
                            q_row_stride, q_frame_stride, pool_row_stride, pool_frame_stride, scale,
                            CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr, INNER: tl.constexpr,
                            PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            PDL: tl.constexpr):
    if PDL:
        follow_previous()
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
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        v = tl.load(v_ptr + base + offs_n[:, None] * pool_frame_stride + offs_d[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    for start in range(n_free, n_keys, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_range = offs_n < n_keys
        k = tl.load(k_ptr + base + offs_n[None, :] * pool_frame_stride + offs_d[:, None],
                    mask=in_range[None, :], other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        s = tl.where(offs_n[None, :] < q_end[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        v = tl.load(v_ptr + base + offs_n[:, None] * pool_frame_stride + offs_d[None, :],
                    mask=in_range[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    dst = o_ptr + (r * num_q + offs_m[:, None]) * INNER + head * HEAD_DIM + offs_d[None, :]
    tl.store(dst, out.to(o_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit
def add_layer_norm_kernel(x_ptr, res_ptr, gate_ptr, w_ptr, b_ptr, out_ptr, sum_ptr, num_t, sx_r, sx_t, sx_c,
                          n_cols, eps, HAS_RES: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr,
                          BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        follow_previous()
    r = tl.program_id(0)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK)
    mask = (offs_t[:, None] < num_t) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + r * sx_r + offs_t[:, None] * sx_t + cols[None, :] * sx_c, mask=mask, other=0.0)
    row = (r * num_t + offs_t[:, None]) * n_cols + cols[None, :]
    if HAS_RES:
        res = tl.load(res_ptr + row, mask=mask, other=0.0)
        if HAS_GATE:  # PARITY: addcmul, the gated add rounded once
            g = tl.load(gate_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            x = (res.to(tl.float32) + g[None, :] * x.to(tl.float32)).to(out_ptr.dtype.element_ty)
        else:
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
                             HAS_ADD: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        follow_previous()
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
                      pool_frame_stride, INNER: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        follow_previous()
    r = tl.program_id(0)
    c = tl.program_id(1)
    offs = tl.arange(0, INNER)
    frame = tl.load(pos_ptr + r * num_c + c)
    dst = tl.load(rows_ptr + r).to(tl.int64) * pool_row_stride + frame * pool_frame_stride
    src = r * s_r + c * s_c
    tl.store(pk_ptr + dst + offs, tl.load(k_ptr + src + offs))
    tl.store(pv_ptr + dst + offs, tl.load(v_ptr + src + offs))


@triton.jit
def rotary_pool_write_kernel(qkv_ptr, cos_ptr, sin_ptr, pk_ptr, pv_ptr, rows_ptr, pos_ptr, num_c, s_r, s_c,
                             pool_row_stride, pool_frame_stride, INNER: tl.constexpr, BLOCK: tl.constexpr,
                             ROT: tl.constexpr, HALF: tl.constexpr, WRITE: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        follow_previous()
    r = tl.program_id(0)
    c = tl.program_id(1)
    src = qkv_ptr + r * s_r + c * s_c
    # the interleaved pairs (2i, 2i + 1) of the first ROT channels of q and k:
    # out[2i] = x[2i]·cos[2i] + x[2i+1]·sin[2i], out[2i+1] = x[2i+1]·cos[2i+1] + x[2i]·sin[2i+1] (sin signed)
    half = tl.arange(0, HALF)
    pair_ok = half < ROT // 2
    even = 2 * half
    angles = (r * num_c + c) * ROT
    cos_e = tl.load(cos_ptr + angles + even, mask=pair_ok, other=0.0).to(tl.float32)
    cos_o = tl.load(cos_ptr + angles + even + 1, mask=pair_ok, other=0.0).to(tl.float32)
    sin_e = tl.load(sin_ptr + angles + even, mask=pair_ok, other=0.0).to(tl.float32)
    sin_o = tl.load(sin_ptr + angles + even + 1, mask=pair_ok, other=0.0).to(tl.float32)
    dt = qkv_ptr.dtype.element_ty
    q_e = tl.load(src + even, mask=pair_ok, other=0.0).to(tl.float32)
    q_o = tl.load(src + even + 1, mask=pair_ok, other=0.0).to(tl.float32)
    k_e = tl.load(src + INNER + even, mask=pair_ok, other=0.0).to(tl.float32)
    k_o = tl.load(src + INNER + even + 1, mask=pair_ok, other=0.0).to(tl.float32)
    # PARITY: rotated in float32, rounded once to the model's dtype
    rq_e, rq_o = (q_e * cos_e + q_o * sin_e).to(dt), (q_o * cos_o + q_e * sin_o).to(dt)
    rk_e, rk_o = (k_e * cos_e + k_o * sin_e).to(dt), (k_o * cos_o + k_e * sin_o).to(dt)
    tl.store(src + even, rq_e, mask=pair_ok)
    tl.store(src + even + 1, rq_o, mask=pair_ok)
    tl.store(src + INNER + even, rk_e, mask=pair_ok)
    tl.store(src + INNER + even + 1, rk_o, mask=pair_ok)
    if WRITE:
        offs = tl.arange(0, BLOCK)
        ok = offs < INNER
        k = tl.load(src + INNER + offs, mask=ok & (offs >= ROT), other=0.0)
        v = tl.load(src + 2 * INNER + offs, mask=ok, other=0.0)
        frame = tl.load(pos_ptr + r * num_c + c)
        dst = tl.load(rows_ptr + r).to(tl.int64) * pool_row_stride + frame * pool_frame_stride
        # the key's rotated channels from registers, the rest as loaded (channels this program does not store)
        tl.store(pk_ptr + dst + even, rk_e, mask=pair_ok)
        tl.store(pk_ptr + dst + even + 1, rk_o, mask=pair_ok)
        tl.store(pk_ptr + dst + offs, k, mask=ok & (offs >= ROT))
        tl.store(pv_ptr + dst + offs, v, mask=ok)


@triton.jit
def norm_gemm_kernel(x_ptr, sx_r, sx_t, sx_c, res_ptr, lnw_ptr, lnb_ptr, eps, w_ptr, bias_ptr, out_ptr,
                     sum_ptr, pk_ptr, pv_ptr, rows_ptr, pos_ptr, pool_row_stride, pool_frame_stride, M, N,
                     num_t, DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RES: tl.constexpr,
                     HAS_BIAS: tl.constexpr, GELU: tl.constexpr, QKV: tl.constexpr, INNER: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        follow_previous()
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
                       BLOCK_T: tl.constexpr, PHASE: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        follow_previous()
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
                             DT_FROM_PTR: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        follow_previous()
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


@triton.jit
def linear_residual_kernel(x_ptr, sx_r, sx_t, sx_k, w_ptr, b_ptr, res_ptr, out_ptr, M, N, K, num_t,
                           HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, PRECISION: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # out [M, N] (row m = frame t of row r: m = r·num_t + t) = x @ W^T + bias, rounded; with HAS_RES
    # then + res [M, N], rounded again (as the module path's linear and residual add)
    if PDL:
        follow_previous()
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    r = offs_m // num_t
    t = offs_m - r * num_t
    x_rows = x_ptr + (r.to(tl.int64) * sx_r + t * sx_t)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        a = tl.load(x_rows[:, None] + kk[None, :] * sx_k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * K + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dt = out_ptr.dtype.element_ty
    y = acc.to(dt)
    mask = m_ok[:, None] & n_ok[None, :]
    at = offs_m[:, None] * N + offs_n[None, :]
    if HAS_RES:
        y = (y.to(tl.float32) + tl.load(res_ptr + at, mask=mask, other=0.0).to(tl.float32)).to(dt)
    tl.store(out_ptr + at, y, mask=mask)


@triton.jit
def grouped_conv_mish_kernel(x_ptr, w_ptr, b_ptr, res_ptr, out_ptr, num_t, n_ch, sx_r, sx_c, sx_t, so_r, so_c,
                             so_t, GROUP: tl.constexpr, TAPS: tl.constexpr, BLOCK_G: tl.constexpr,
                             BLOCK_T: tl.constexpr, HAS_RES: tl.constexpr, PRECISION: tl.constexpr,
                             PDL: tl.constexpr):
    if PDL:
        follow_previous()
    r = tl.program_id(0)
    g = tl.program_id(1)
    offs_t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_g = tl.arange(0, BLOCK_G)  # a group's channels, padded to a tensor-core width
    g_ok = offs_g < GROUP
    t_ok = offs_t < num_t
    ch = g * GROUP + offs_g
    x_base = x_ptr + r * sx_r + ch[:, None] * sx_c
    acc = tl.zeros((BLOCK_G, BLOCK_T), tl.float32)
    # out[co, t] = Σ_k W_k[co, ci] · x[ci, t + k]: one [G, G] @ [G, BLOCK_T] product per tap (weight taps-first)
    for k in range(TAPS):
        xk = tl.load(x_base + (offs_t[None, :] + k) * sx_t, mask=g_ok[:, None] & t_ok[None, :], other=0.0)
        wk = tl.load(w_ptr + (k * n_ch + ch[:, None]) * GROUP + offs_g[None, :],
                     mask=g_ok[:, None] & g_ok[None, :], other=0.0)
        acc += tl.dot(wk, xk, input_precision=PRECISION)
    dt = out_ptr.dtype.element_ty
    bias = tl.load(b_ptr + ch, mask=g_ok, other=0.0).to(tl.float32)
    # PARITY: cuDNN returns the conv rounded and torch adds the bias after it, rounded again; Mish rounded
    h = (acc.to(dt).to(tl.float32) + bias[:, None]).to(dt).to(tl.float32)
    e = tl.exp(tl.minimum(h, 20.0))
    n = (1.0 + e) * (1.0 + e)
    y = tl.where(h > 20.0, h, h * (n - 1.0) / (n + 1.0))
    dst = r * so_r + ch[:, None] * so_c + offs_t[None, :] * so_t
    ok = g_ok[:, None] & t_ok[None, :]
    if HAS_RES:  # PARITY: residual + Mish's rounded output, rounded
        y = y.to(dt).to(tl.float32) + tl.load(res_ptr + dst, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + dst, y.to(dt), mask=ok)
