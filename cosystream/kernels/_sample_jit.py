"""The Triton source of `cosystream.kernels.sample` (imported on first use: it needs Triton at import,
and Triton resolves the helpers a kernel calls from module globals)."""

import triton
import triton.language as tl

from cosystream.kernels._launch_jit import follow_previous


@triton.jit
def mix32(x):
    # The 32-bit finaliser of models.sampling._mix32, in wrapping uint32 arithmetic.
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x68E31DA5
    return x ^ (x >> 16)


@triton.jit
def gumbel(row_key, cols):
    # bits = mix32(mix32(h ^ col) + col) with the sum taken in 33 bits, as the int64 reference does:
    # its carry reaches bit 16 through the first shift.
    a = mix32(row_key ^ cols)
    lo = a + cols
    carry = (lo < a).to(tl.uint32)
    x = lo ^ ((lo >> 16) | (carry << 16))
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x68E31DA5
    bits = x ^ (x >> 16)
    u = ((bits >> 8).to(tl.float32) + 0.5) / 16777216.0
    return -tl.log(-tl.log(u))


@triton.jit
def sample_record_kernel(logits_ptr, logits_stride, seeds_ptr, steps_ptr, min_len_ptr, top_p_ptr, top_k_ptr,
                         threshold_ptr, window_ptr, history_ptr, forced_ptr, greedy_ptr, ban_ptr, active_ptr,
                         tokens_ptr, positions_ptr, out_ptr, rows_ptr, vocab, eos, max_position, non_finite_token,
                         stream1, stream2, HIST: tl.constexpr, MAX_K: tl.constexpr,
                         BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, HAS_ROWS: tl.constexpr,
                         EARLY: tl.constexpr, PDL: tl.constexpr):
    # The row's state is written only by this kernel (of an earlier step) or before the step: with EARLY
    # it is loaded before the wait for the head (PDL), so those loads overlap the head's GEMM.
    # HAS_ROWS: program b samples logits row b into state row rows[b] (< 0: a padding row, nothing written).
    prog = tl.program_id(0)
    if HAS_ROWS:
        if PDL and EARLY:
            follow_previous()  # rows and the state they point to may come from the kernels just before
        row = tl.load(rows_ptr + prog)
        live = row >= 0
        row = tl.maximum(row, 0)
    else:
        row = prog
        live = prog >= 0
    cols = tl.arange(0, BLOCK_V)
    valid = cols < vocab
    if PDL and not EARLY:
        follow_previous()
    step = tl.load(steps_ptr + row)
    below_min = step < tl.load(min_len_ptr + row)
    ban = below_min & (tl.load(ban_ptr + row) != 0)
    seed32 = tl.load(seeds_ptr + row).to(tl.uint32)  # low 32 bits, as seeds & 0xFFFFFFFF
    top_p = tl.load(top_p_ptr + row)
    top_k = tl.minimum(tl.load(top_k_ptr + row), MAX_K)
    hcols = tl.arange(0, BLOCK_H)
    hist = tl.load(history_ptr + row * HIST + hcols, mask=hcols < HIST, other=-1)
    in_window = (hcols < HIST) & (hcols >= HIST - tl.load(window_ptr + row))
    threshold = tl.load(threshold_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    forced = tl.load(forced_ptr + row)
    active = (tl.load(active_ptr + row) != 0) & live
    pos = tl.load(positions_ptr + row)
    if PDL and EARLY and not HAS_ROWS:
        follow_previous()
    x = tl.load(logits_ptr + prog * logits_stride + cols, mask=valid, other=0.0).to(tl.float32)
    finite = (x == x) & (tl.abs(x) < float("inf"))
    bad = tl.sum(tl.where(valid & ~finite, 1, 0), axis=0) > 0
    # a row with NaN/inf is reported through `out` and fails its request; sampling it from the finite
    # entries keeps the loop below well-defined
    x = tl.where(valid, tl.where(finite, x, 0.0), float("-inf"))
    mx = tl.max(x, axis=0)
    logp = x - mx - tl.log(tl.sum(tl.exp(x - mx), axis=0))

    stop_class = (below_min & (cols == eos)) | (ban & (cols > eos))
    scores = tl.where(stop_class, float("-inf"), logp)
    sm = tl.max(scores, axis=0)
    e = tl.exp(scores - sm)
    probs = e / tl.sum(e, axis=0)

    h = mix32(mix32(seed32) ^ step.to(tl.uint32))
    key1 = mix32(h ^ stream1.to(tl.uint32))
    # nucleus: candidates in descending probability; a candidate is kept while the mass before it
    # is < top_p and fewer than top_k are kept; Gumbel-max over the kept ones (noise by rank)
    remaining = tl.where(valid, probs, -1.0)
    mass = tl.sum(tl.zeros([BLOCK_H], tl.float32), axis=0)
    rank = tl.sum(tl.zeros([BLOCK_H], tl.int32), axis=0)
    best_key = mass + float("-inf")
    drawn = rank
    while (mass < top_p) & (rank < top_k):
        p, idx = tl.max(remaining, axis=0, return_indices=True)
        score = tl.log(p) + gumbel(key1, rank.to(tl.uint32))
        better = score > best_key
        best_key = tl.where(better, score, best_key)
        drawn = tl.where(better, idx, drawn)
        mass += p
        rank += 1
        remaining = tl.where(cols == idx, -1.0, remaining)

    # RAS: redraw from the whole distribution without the drawn token when it repeats too often
    repeats = tl.sum(tl.where(in_window & (hist == drawn), 1.0, 0.0), axis=0)
    token = drawn.to(tl.int64)
    if repeats >= threshold:
        key2 = mix32(h ^ stream2.to(tl.uint32))
        g2 = gumbel(key2, cols.to(tl.uint32))
        excluded = tl.where(cols == drawn, float("-inf"), scores) + g2
        token = tl.argmax(excluded, axis=0).to(tl.int64)
    if greedy:
        token = tl.argmax(scores, axis=0).to(tl.int64)
    if forced >= 0:
        token = forced

    tl.store(out_ptr + row, tl.where(bad, non_finite_token, token), mask=live)
    if active:
        tl.store(tokens_ptr + row, token)
        tl.store(steps_ptr + row, step + 1)
        shifted = tl.load(history_ptr + row * HIST + hcols + 1, mask=hcols < HIST - 1, other=0)
        rolled = tl.where(hcols == HIST - 1, token, shifted)
        tl.store(history_ptr + row * HIST + hcols, rolled, mask=hcols < HIST)
        tl.store(positions_ptr + row, tl.minimum(pos + 1, max_position))
