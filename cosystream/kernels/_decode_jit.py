"""The Triton source of `cosystream.kernels.decode` (imported on first use: it needs Triton at import, and
Triton resolves the helpers a kernel calls from module globals). Each kernel's `PDL` flag: see _launch_jit."""

import triton
import triton.language as tl

from cosystream.kernels._launch_jit import follow_previous


@triton.jit
def add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, part_stride, eps,
                        HAS_RES: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr, EARLY: tl.constexpr,
                        PDL: tl.constexpr):
    # EARLY: the norm's weight (never written by a kernel) is loaded before the wait (PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if EARLY:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        follow_previous()
    if not EARLY:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # x may be a linear's split-K partial sums [PARTS, rows, n]: their sum is its output
    x = sum_parts(x_ptr, row * n_cols + cols, mask, part_stride, PARTS, out_ptr.dtype.element_ty)
    if HAS_RES:
        r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)  # PARITY: bf16 add
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv).to(out_ptr.dtype.element_ty).to(tl.float32)  # PARITY: cast before the weight
    tl.store(out_ptr + row * n_cols + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_write_kv_kernel(qkv_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, q_out_ptr, k_ptr, v_ptr,
                         slot_stride, head_stride, part_stride, NUM_HEADS: tl.constexpr,
                         NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, PARTS: tl.constexpr,
                         HAS_SLOTS: tl.constexpr, ALL_HEADS: tl.constexpr, PDL: tl.constexpr):
    # ALL_HEADS: q_out holds every head of the row (q and k rotated, v as is), not the queries alone
    if PDL:
        follow_previous()
    row = tl.program_id(0)
    head = tl.program_id(1)  # [0, H): a query head; [H, H+KV): a key head (and its value head)
    offs_d = tl.arange(0, HEAD_DIM)
    all_d = offs_d < HEAD_DIM
    pos = tl.load(pos_ptr + row)
    partner, sign, cos, sin = rope_terms(cos_ptr, sin_ptr, pos, HEAD_DIM)
    base = row * (NUM_HEADS + 2 * NUM_KV) * HEAD_DIM + head * HEAD_DIM
    dtype = q_out_ptr.dtype.element_ty
    out = rotate(qkv_ptr, base + offs_d, base + partner, all_d, cos, sin, sign, part_stride, PARTS, dtype)
    out_heads = NUM_HEADS + 2 * NUM_KV if ALL_HEADS else NUM_HEADS
    if head < NUM_HEADS:
        tl.store(q_out_ptr + (row * out_heads + head) * HEAD_DIM + offs_d, out)
    else:
        kv = head - NUM_HEADS
        slot = tl.load(slot_ptr + row).to(tl.int64) if HAS_SLOTS else row  # its cache row
        cache_off = slot * slot_stride + kv * head_stride + pos * HEAD_DIM
        tl.store(k_ptr + cache_off + offs_d, out)
        # the value head sits NUM_KV heads after its key head
        v = sum_parts(qkv_ptr, base + NUM_KV * HEAD_DIM + offs_d, all_d, part_stride, PARTS, dtype)
        tl.store(v_ptr + cache_off + offs_d, v.to(v_ptr.dtype.element_ty))
        if ALL_HEADS:
            tl.store(q_out_ptr + (row * out_heads + head) * HEAD_DIM + offs_d, out)
            tl.store(q_out_ptr + (row * out_heads + head + NUM_KV) * HEAD_DIM + offs_d, v)


@triton.jit
def attention_split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, o_part_ptr, ml_part_ptr, slot_stride,
                           head_stride, part_stride, keys_per_split, num_splits, scale, GROUPS: tl.constexpr,
                           NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, ROPE: tl.constexpr, PARTS: tl.constexpr,
                           PRECISION: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    # ROPE: q_ptr is the q/k/v projection ([B, (H + 2·KV)·D], or float32 split-K partials [PARTS, B, ...]):
    # this program rotates its queries itself, and the program whose keys hold the row's position also
    # rotates the new key, stores it and the new value in the cache and attends to them from registers.
    # Else q_ptr holds rotated queries [B, H, D] and the cache holds every key already.
    # EARLY (with ROPE only): the first block of cached keys/values, the position and the RoPE terms
    # are loaded before waiting for the kernel before (PDL): none of them is written inside the step
    # before this kernel (earlier positions were stored by earlier steps; positions move after the step).
    row = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    if PDL and not EARLY:
        follow_previous()
    pos = tl.load(pos_ptr + row)
    head0 = kv * GROUPS
    m_ok = offs_m < GROUPS
    dtype = k_ptr.dtype.element_ty
    width = (NUM_KV * GROUPS + 2 * NUM_KV) * HEAD_DIM
    start = split * keys_per_split
    if ROPE:
        stop = tl.minimum(start + keys_per_split, pos)  # the new key comes from registers
        partner, sign, cos, sin = rope_terms(cos_ptr, sin_ptr, pos, HEAD_DIM)
    else:
        stop = tl.minimum(start + keys_per_split, pos + 1)
    cache = row * slot_stride + kv * head_stride
    k_first, v_first, valid_first = load_keys(k_ptr, v_ptr, cache, start, stop, offs_d, HEAD_DIM, BLOCK_N)
    if PDL and EARLY:
        follow_previous()
    if ROPE:
        q_at = row * width + (head0 + offs_m[:, None]) * HEAD_DIM
        q = rotate(q_ptr, q_at + offs_d[None, :], q_at + partner[None, :], m_ok[:, None], cos[None, :],
                   sin[None, :], sign[None, :], part_stride, PARTS, dtype)
    else:
        q = tl.load(q_ptr + (row * NUM_KV * GROUPS + head0 + offs_m[:, None]) * HEAD_DIM + offs_d[None, :],
                    mask=m_ok[:, None], other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    m_i, l_i, acc = attend(q, k_first, v_first, valid_first, m_i, l_i, acc, scale, PRECISION)
    for block in range(start + BLOCK_N, stop, BLOCK_N):
        k, v, valid = load_keys(k_ptr, v_ptr, cache, block, stop, offs_d, HEAD_DIM, BLOCK_N)
        m_i, l_i, acc = attend(q, k, v, valid, m_i, l_i, acc, scale, PRECISION)
    if ROPE:
        # does this split hold the new key? (on a vector: the interpreter refuses scalar masks)
        pos_d = tl.zeros((HEAD_DIM,), tl.int64) + pos
        mine_d = (pos_d >= start) & (pos_d < start + keys_per_split)
        mine = tl.max(mine_d.to(tl.int32), axis=0) > 0
        k_at = row * width + (NUM_KV * GROUPS + kv) * HEAD_DIM
        all_d = offs_d < HEAD_DIM
        k_new = rotate(q_ptr, k_at + offs_d, k_at + partner, all_d, cos, sin, sign, part_stride, PARTS, dtype)
        v_new = sum_parts(q_ptr, k_at + NUM_KV * HEAD_DIM + offs_d, all_d, part_stride, PARTS, dtype).to(dtype)
        at = cache + pos * HEAD_DIM + offs_d
        tl.store(k_ptr + at, k_new, mask=mine_d)
        tl.store(v_ptr + at, v_new, mask=mine_d)
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
        s_new = tl.where(mine, s_new, float("-inf"))
        m_new = tl.maximum(m_i, s_new)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # an empty split stays empty (no NaN)
        p_new = tl.exp(s_new - m_ref)
        alpha = tl.exp(m_i - m_ref)
        acc = acc * alpha[:, None] + p_new.to(dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
        l_i = l_i * alpha + p_new
        m_i = m_new
    # partials [B, KV, splits, BLOCK_M, D]; an empty split leaves m = -inf, l = 0
    part = ((row * NUM_KV + kv) * num_splits + split) * BLOCK_M
    tl.store(o_part_ptr + (part + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], acc)
    tl.store(ml_part_ptr + (part + offs_m) * 2, m_i)
    tl.store(ml_part_ptr + (part + offs_m) * 2 + 1, l_i)


@triton.jit
def load_keys(k_ptr, v_ptr, cache, block, stop, offs_d, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Cached keys (transposed, [D, BLOCK_N]) and values ([BLOCK_N, D]) at positions [block, block + BLOCK_N)
    below stop, and which of them are valid; positions at or past stop read as zeros."""
    offs_n = block + tl.arange(0, BLOCK_N)
    valid = offs_n < stop
    k = tl.load(k_ptr + cache + offs_n[None, :] * HEAD_DIM + offs_d[:, None], mask=valid[None, :], other=0.0)
    v = tl.load(v_ptr + cache + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=valid[:, None], other=0.0)
    return k, v, valid


@triton.jit
def attend(q, k, v, valid, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
    """One block of keys into the running softmax (m_i, l_i, acc). A block with no valid key leaves the state
    as it was (m_ref keeps exp() off -inf - -inf)."""
    s = tl.dot(q, k, input_precision=PRECISION) * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_ref[:, None])
    alpha = tl.exp(m_i - m_ref)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, l_i, acc


@triton.jit
def rope_terms(cos_ptr, sin_ptr, pos, HEAD_DIM: tl.constexpr):
    """Rotate-half RoPE at `pos` over a whole head [HEAD_DIM]: rotate_half(x)[d] = sign[d] · x[partner[d]]
    (-x[d + half] below half, x[d - half] above), and cos / sin repeated over both halves."""
    half = HEAD_DIM // 2
    offs_d = tl.arange(0, HEAD_DIM)
    partner = (offs_d + half) % HEAD_DIM
    sign = tl.where(offs_d < half, -1.0, 1.0)
    cos = tl.load(cos_ptr + pos * half + offs_d % half)
    sin = tl.load(sin_ptr + pos * half + offs_d % half)
    return partner, sign, cos, sin


@triton.jit
def rotate(ptr, offs, partner, mask, c, s, sign, part_stride, PARTS: tl.constexpr, dtype: tl.constexpr):
    """Rotate-half RoPE of a linear's output at offs: x·cos + rotate_half(x)·sin, rounded to dtype, where
    rotate_half(x) = sign · x[partner] (see rope_terms)."""
    x = sum_parts(ptr, offs, mask, part_stride, PARTS, dtype)
    xr = sum_parts(ptr, partner, mask, part_stride, PARTS, dtype)
    return (x * c + sign * xr * s).to(dtype)


@triton.jit
def sum_parts(ptr, offs, mask, part_stride, PARTS: tl.constexpr, dtype: tl.constexpr):
    """A linear's output at offs as float32: one tensor (PARTS = 0), or the sum of its float32 split-K
    partials, rounded once to the linear's dtype (PARITY)."""
    if PARTS == 0:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    acc = tl.load(ptr + offs, mask=mask, other=0.0)
    for p in tl.static_range(1, PARTS):
        acc += tl.load(ptr + p * part_stride + offs, mask=mask, other=0.0)
    return acc.to(dtype).to(tl.float32)


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


@triton.jit
def prefetch_share(ptr, nbytes, LANES: tl.constexpr):
    # This program's share of the bytes [ptr, ptr + nbytes) into L2: one bulk prefetch per lane, nothing
    # held and nothing to wait for (the copy engine finishes it after the program exits).
    lane = tl.arange(0, LANES)
    programs = tl.num_programs(0)
    chunk = tl.cdiv(tl.cdiv(nbytes, programs * LANES), 16) * 16  # bulk prefetches move 16-byte multiples
    start = (tl.program_id(0) * LANES + lane).to(tl.int64) * chunk
    size = tl.minimum(tl.maximum(nbytes - start, 0), chunk).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr.to(tl.int64) + start, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_l2_kernel(p0, n0, p1, n1, p2, n2, p3, n3, LANES: tl.constexpr):
    # up to four tensors (cosystream.kernels.prefetch); an unused slot has 0 bytes
    prefetch_share(p0, n0, LANES)
    prefetch_share(p1, n1, LANES)
    prefetch_share(p2, n2, LANES)
    prefetch_share(p3, n3, LANES)
