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

from cosystream.kernels import pdl_launch


def _pdl(x: torch.Tensor, rows: int) -> dict:
    """Launch options of a kernel over `rows` rows: programmatic dependent launch (`pdl_launch`) on the chunk
    path of one or two streams (row class 0, at most SMALL_ROWS rows). There every GEMM is one of these
    kernels, so the step is an unbroken chain in which each launch overlaps the kernel before it; bigger
    batches and the official final passes launch plainly, as PDL there changes nothing beyond run-to-run
    noise (docs/benchmarks.md)."""
    return pdl_launch(x) if rows <= SMALL_ROWS else {"PDL": False}


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton

    from cosystream.kernels import _flow_jit

    kernels = {name: getattr(_flow_jit, name) for name in dir(_flow_jit) if name.endswith("_kernel")}
    return SimpleNamespace(**kernels, next_power_of_2=triton.next_power_of_2)


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
        PRECISION=_precision(q), BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.warps, num_stages=t.stages,
        **_pdl(q, batch * num_q))
    return out


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float, gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.add_layer_norm` for x [R, T, C] (any strides), residual contiguous and
    gate [C] contiguous."""
    k = _kernels()
    rows, num_t, n_cols = x.shape
    assert gate is None or (residual is not None and gate.is_contiguous() and gate.numel() == n_cols)
    out = torch.empty(rows, num_t, n_cols, device=x.device, dtype=x.dtype)
    total = torch.empty_like(out)
    # PERF: about 4096 values a program, the tile of the U-Net's 256 channels (16 frames); the DiT's 1024
    # channels take 4 frames a program, so each thread holds as many values as there
    block_t = max(1, min(16, 4096 // k.next_power_of_2(n_cols)))
    k.add_layer_norm_kernel[(rows, -(-num_t // block_t))](
        x, out if residual is None else residual, out if gate is None else gate, weight, bias, out, total, num_t,
        x.stride(0), x.stride(1), x.stride(2), n_cols, eps, HAS_RES=residual is not None, HAS_GATE=gate is not None,
        BLOCK=k.next_power_of_2(n_cols), BLOCK_T=block_t, **_pdl(x, rows * num_t))
    return out, total


def channel_norm_mish(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                      add: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `reference.channel_norm_mish`; x [R, C, T] contiguous. The estimator runs this
    inside `causal_conv`; this separate kernel is the unfused baseline the conv tiles were measured against
    (`git show f313fec^:benchmarks/kernel_tiles.py`, a script retired in f313fec)."""
    k = _kernels()
    x = x.contiguous()
    rows, n_ch, num_t = x.shape
    out = torch.empty_like(x)
    block_t = 16
    k.channel_norm_mish_kernel[(rows, -(-num_t // block_t))](
        x, weight, bias, out if add is None else add.contiguous(), out, n_ch, num_t, eps, HAS_ADD=add is not None,
        BLOCK_C=k.next_power_of_2(n_ch), BLOCK_T=block_t, **_pdl(x, rows * num_t))
    return out


def pool_write(k: torch.Tensor, v: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, rows: torch.Tensor,
               write_pos: torch.Tensor) -> None:
    """Same contract as `reference.pool_write`; k and v [R, C, inner] share strides, unit last stride."""
    kern = _kernels()
    batch, num_c, inner = k.shape
    assert k.stride() == v.stride() and k.stride(2) == 1 and pool_k.stride() == pool_v.stride()
    kern.pool_write_kernel[(batch, num_c)](k, v, pool_k, pool_v, rows, write_pos.contiguous(), num_c, k.stride(0),
                                           k.stride(1), pool_k.stride(0), pool_k.stride(1), INNER=inner,
                                           **_pdl(k, batch * num_c))


def partial_rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """Same contract as `reference.partial_rotary`; qkv [R, C, 3·inner] with a unit last stride, cos / sin
    [R, C, rot] contiguous. PERF: one launch for the rotary of q and k (the torch statements: a cast, a
    flip, a multiply, an addcmul and a copy back) and the pool write (an indexed scatter)."""
    kern = _kernels()
    batch, num_c, width = qkv.shape
    inner, rot = width // 3, cos.shape[-1]
    assert qkv.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous() and cos.shape == (batch, num_c, rot)
    assert rot % 2 == 0 and rot <= inner
    pool_k, pool_v, rows, write_pos = pool if pool is not None else (qkv, qkv, qkv, qkv)
    assert pool is None or (pool_k.stride() == pool_v.stride() and pool_k.stride(2) == 1)
    kern.rotary_pool_write_kernel[(batch, num_c)](
        qkv, cos, sin, pool_k, pool_v, rows, write_pos.contiguous(), num_c, qkv.stride(0), qkv.stride(1),
        pool_k.stride(0) if pool is not None else 0, pool_k.stride(1) if pool is not None else 0, INNER=inner,
        BLOCK=kern.next_power_of_2(inner), ROT=rot, HALF=kern.next_power_of_2(rot // 2), WRITE=pool is not None,
        **_pdl(qkv, batch * num_c))


def grouped_conv_mish(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `reference.grouped_conv_mish`; x [R, C, T_in] any strides, residual [R, T, C]
    contiguous. PERF: cuDNN runs the DiT's grouped conv (16 groups, 31 taps) as one kernel per group plus
    layout transforms, and Mish and the residual add as more launches; here one launch."""
    kern = _kernels()
    rows, n_ch, t_in = x.shape
    group, taps = weight.shape[1], weight.shape[2]
    num_t = t_in - taps + 1
    assert weight.shape[0] == n_ch and n_ch % group == 0 and num_t >= 1
    if residual is None:
        out = torch.empty(rows, n_ch, num_t, device=x.device, dtype=x.dtype)
        so = out.stride()
    else:
        assert residual.shape == (rows, num_t, n_ch) and residual.is_contiguous()
        out = torch.empty_like(residual)
        so = (out.stride(0), out.stride(2), out.stride(1))  # written as [R, C, T] through [R, T, C] strides
    # frames a program: more of them share each weight tap read (16 groups × 31 taps of [64, 64]) where
    # there are enough programs to fill the GPU anyway
    block_t, warps = {0: (32, 4), 1: (64, 4), 2: (128, 8)}[row_class(rows * num_t)]
    grid = (rows, n_ch // group, -(-num_t // block_t))
    kern.grouped_conv_mish_kernel[grid](
        x, _taps_outer(weight), bias, out if residual is None else residual, out, num_t, n_ch, *x.stride(), *so,
        GROUP=group, TAPS=taps, BLOCK_G=max(16, kern.next_power_of_2(group)), BLOCK_T=block_t,
        HAS_RES=residual is not None, PRECISION=_precision(x), num_warps=warps, **_pdl(x, rows * num_t))
    return out


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


# (kind, row class) -> tile. Picked on the H100 with benchmarks/kernel_tiles.py (retired in f313fec:
# `git show f313fec^:benchmarks/kernel_tiles.py`);
# kinds: "qkv" (pool-write epilogue), "gelu". The estimator runs the prologue GEMMs only at row class 0
# (above it cuBLAS and a separate norm win: 101 vs 143 µs at 26,624 rows); classes 1 and 2 serve tests
# and sweeps.
TILES: dict[tuple[str, int], Tile] = {
    ("qkv", 0): Tile(32, 128, 4, 2), ("qkv", 1): Tile(64, 128, 4, 2), ("qkv", 2): Tile(64, 128, 8, 2),
    ("gelu", 0): Tile(32, 64, 8, 2), ("gelu", 1): Tile(64, 128, 4, 2), ("gelu", 2): Tile(64, 128, 8, 2),
    # conv: block_m frames, block_n input channels a step, output channels in co_blocks launches.
    # 26,624 rows (class 2): 56.1 µs (16×64: 109, cuDNN + epilogue 102.7)
    ("conv", 0): Tile(16, 32, 8, 2, 4), ("conv", 1): Tile(16, 64, 8, 2), ("conv", 2): Tile(64, 32, 4, 2),
    # linear_residual (the estimator runs it at row class 0 only). 120 / 200 rows, µs (cuBLAS, + add): output
    # projection 2.9 / 3.0 (3.2 / 3.3), second feed-forward + residual 4.2 / 4.4 (4.9 / 5.2), the 1x1 residual
    # conv 3.2 / 3.1 (7.4 / 7.5, a strided input); classes 1 and 2 unmeasured
    ("linear", 0): Tile(16, 32, 4, 3), ("linear", 1): Tile(64, 32, 8, 3), ("linear", 2): Tile(128, 64, 8, 3),
}
LINEAR_BLOCK_K = 64  # inputs per inner step of linear_residual

# A wave of new voices' prompt pass (many rows of a whole prompt's frames) has enough 32-frame tiles to fill the
# GPU, and each program reads the conv's weight for twice the frames of a 16-frame tile; chunks (shorter rows)
# keep the 16-frame tiles, whose extra programs there are what fills the SMs. Picked on the H200 with
# benchmarks/flow_tiles.py at 32 rows x 250 frames (the pass of 15-16 voices) and 32 x 50 (16 streams' chunks).
WIDE_CONV_TILE = Tile(32, 32, 8, 3)
WIDE_CONV_MIN_FRAMES = 200  # frames a row
WIDE_CONV_MIN_PROGRAMS = 192  # rows x 32-frame tiles


def conv_tile(rows: int, num_t: int) -> Tile:
    """The causal conv's default launch shape for `rows` rows of `num_t` frames."""
    klass = row_class(rows * num_t)
    wide = WIDE_CONV_TILE
    if (klass == 1 and num_t >= WIDE_CONV_MIN_FRAMES
            and rows * -(-num_t // wide.block_m) >= WIDE_CONV_MIN_PROGRAMS):
        return wide
    return TILES[("conv", klass)]


# The channel split was measured at 256 output channels (four blocks of 64); narrower blocks were not, so
# the default tiles never split below this width (explicit tiles do, for tests and sweeps).
_MIN_CO_BLOCK = 64

# (chunk-masked, at most 512 query rows) -> attention tile; chunk-masked: a streamed chunk (False: the
# official final pass, full attention over the whole utterance). Picked on the H100 with
# benchmarks/attention_tiles.py (µs per call; retired in f313fec: `git show f313fec^:benchmarks/attention_tiles.py`).
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
        num_warps=t.warps, num_stages=t.stages, **_pdl(x, m))
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


def linear_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    tile: Tile | None = None) -> torch.Tensor:
    """Same contract as `reference.linear_residual`: x [R, T, K] any strides, weight [N, K] contiguous,
    residual [R, T, N] contiguous; returns [R, T, N] contiguous. PERF: on the chunk path it keeps the
    step's chain of kernels all Triton, so that each launch overlaps the kernel before it (`_pdl`); the
    residual add rides in its epilogue (no add kernel after a group of transformer blocks)."""
    kern = _kernels()
    rows, num_t, k_in = x.shape
    n_out = weight.shape[0]
    assert weight.shape == (n_out, k_in) and weight.is_contiguous()
    assert residual is None or (residual.shape == (rows, num_t, n_out) and residual.is_contiguous())
    if out is None:
        out = torch.empty(rows, num_t, n_out, device=x.device, dtype=x.dtype)
    assert out.shape == (rows, num_t, n_out) and out.is_contiguous() and out.dtype == x.dtype
    m = rows * num_t
    t = tile if tile is not None else TILES[("linear", row_class(m))]
    kern.linear_residual_kernel[(-(-m // t.block_m), -(-n_out // t.block_n))](
        x, x.stride(0), x.stride(1), x.stride(2), weight, bias if bias is not None else weight,
        residual if residual is not None else out, out, m, n_out, k_in, num_t, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, PRECISION=_precision(x), BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        BLOCK_K=LINEAR_BLOCK_K, num_warps=t.warps, num_stages=t.stages, **_pdl(x, m))
    return out


def _taps_first(weight: torch.Tensor) -> torch.Tensor:
    """The conv weight [Cout, Cin, 3] stored [3, Cin, Cout] (the kernel's coalesced order), kept on the
    weight itself: made on the first call (the engine's comes before any graph capture) and again only
    if the weight moves. Weights are not modified in place after loading."""
    cached = getattr(weight, "_cosystream_taps_first", None)
    if cached is None or cached[0] != weight.data_ptr():
        cached = (weight.data_ptr(), weight.detach().permute(2, 1, 0).contiguous())
        weight._cosystream_taps_first = cached  # type: ignore[attr-defined]
    return cached[1]


def _taps_outer(weight: torch.Tensor) -> torch.Tensor:
    """A grouped conv weight [Cout, Cin / groups, K] stored [K, Cout, Cin / groups] (one [Cout, Cin / groups]
    matrix per tap), kept on the weight as `_taps_first` keeps its own."""
    cached = getattr(weight, "_cosystream_taps_outer", None)
    if cached is None or cached[0] != weight.data_ptr():
        cached = (weight.data_ptr(), weight.detach().permute(2, 0, 1).contiguous())
        weight._cosystream_taps_outer = cached  # type: ignore[attr-defined]
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
    t = tile if tile is not None else conv_tile(rows, num_t)
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
            num_warps=warps, num_stages=stages, **_pdl(x, rows * num_t))

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
    (the module statements: a cuDNN conv with its two layout transforms and ~8 element-wise kernels)."""
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
        DT_FROM_PTR=on_device, num_warps=4, **_pdl(h, rows * num_t))
    return x_new, next_rows
