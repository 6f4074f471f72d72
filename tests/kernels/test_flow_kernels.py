"""The pooled flow-attention kernel computes what its torch statement in kernels/reference.py computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cosystream.kernels import flow, reference
from cosystream.kernels.flow import Tile

HEADS, INNER = 8, 512  # the CosyVoice2 estimator's attention


@pytest.fixture
def dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32  # see test_decode_kernels.py


def _inputs(device: str, dtype: torch.dtype, seed: int, rows: int = 4, num_q: int = 70, pool_rows: int = 6,
            max_frames: int = 400):
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, pool_rows, max_frames, INNER, generator=g).to(device, dtype)
    # q is a strided slice of a fused q/k/v projection, as in the estimator
    qkv = torch.randn(rows, num_q, 3 * INNER, generator=g).to(device, dtype)
    return pool[0], pool[1], qkv[..., :INNER]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("chunk", [25, 0])
def test_pooled_attention(device: str, dtype: torch.dtype, chunk: int) -> None:
    pool_k, pool_v, q = _inputs(device, dtype, seed=chunk)
    rows = torch.tensor([5, 0, 3, 3], device=device)
    starts = torch.tensor([0, 13, 200, 310], device=device)
    q_pos = starts.unsqueeze(1) + torch.arange(q.shape[1], device=device)
    limit = q_pos[:, -1] + 1 if chunk else torch.tensor([70, 50, 256, 380], device=device)
    out = flow.pooled_attention(q, pool_k, pool_v, rows, q_pos, limit, chunk, 384, HEADS)
    want = reference.pooled_attention(q.double(), pool_k.double(), pool_v.double(), rows, q_pos, limit, chunk,
                                      384, HEADS)
    assert out.shape == q.shape
    assert _rel(out, want) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("tile", [Tile(16, 32, 2, 3), Tile(128, 64, 8, 3)])
def test_pooled_attention_with_other_launch_tiles(device: str, dtype: torch.dtype, tile: Tile) -> None:
    """Query blocks that straddle rows' ends and key blocks that straddle the chunk and limit edges."""
    pool_k, pool_v, q = _inputs(device, dtype, seed=3)
    rows = torch.tensor([5, 0, 3, 3], device=device)
    q_pos = torch.tensor([0, 13, 200, 310], device=device).unsqueeze(1) + torch.arange(q.shape[1], device=device)
    for chunk, limit in [(25, q_pos[:, -1] + 1), (0, torch.tensor([70, 50, 256, 380], device=device))]:
        out = flow.pooled_attention(q, pool_k, pool_v, rows, q_pos, limit, chunk, 384, HEADS, tile=tile)
        want = reference.pooled_attention(q.double(), pool_k.double(), pool_v.double(), rows, q_pos, limit, chunk,
                                          384, HEADS)
        assert _rel(out, want) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_pooled_attention_reads_nothing_past_the_limits(device: str, dtype: torch.dtype) -> None:
    pool_k, pool_v, q = _inputs(device, dtype, seed=7)
    rows = torch.tensor([1, 2, 4, 0], device=device)
    q_pos = torch.tensor([0, 40, 100, 300], device=device).unsqueeze(1) + torch.arange(q.shape[1], device=device)
    limit = q_pos[:, -1] + 1
    first = flow.pooled_attention(q, pool_k, pool_v, rows, q_pos, limit, 25, 384, HEADS)
    for r, end in zip(rows.tolist(), limit.tolist(), strict=True):
        pool_k[r, end:], pool_v[r, end:] = 1e4, -1e4  # frames no query may see
    pool_k[5], pool_v[5] = 1e4, 1e4  # a pool row nobody reads
    assert torch.equal(flow.pooled_attention(q, pool_k, pool_v, rows, q_pos, limit, 25, 384, HEADS), first)


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_layer_norm_on_a_transposed_view(device: str, dtype: torch.dtype, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 256, 37, generator=g).to(device, dtype).transpose(1, 2)  # [R, T, C] view, as in the U-Net
    res = torch.randn(3, 37, 256, generator=g).to(device, dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(256, generator=g)).to(device, dtype)
    b = (0.1 * torch.randn(256, generator=g)).to(device, dtype)
    out, total = flow.add_layer_norm(x, res, w, b, 1e-5)
    want_out, want_total = reference.add_layer_norm(x, res, w, b, 1e-5)
    assert torch.equal(total, want_total)
    assert _rel(out, want_out) < (4e-3 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("with_add", [False, True])
def test_channel_norm_mish(device: str, dtype: torch.dtype, with_add: bool) -> None:
    g = torch.Generator().manual_seed(12)
    x = (3 * torch.randn(2, 256, 45, generator=g)).to(device, dtype)
    x[0, :, 3] = 40.0  # a constant frame: normalised to 0 (exercises the variance guard)
    w = (1 + 0.5 * torch.randn(256, generator=g)).to(device, dtype)
    b = torch.randn(256, generator=g).to(device, dtype) * 8  # large values reach the softplus threshold
    add = torch.randn(2, 256, generator=g).to(device, dtype) if with_add else None
    out = flow.channel_norm_mish(x, w, b, 1e-5, add)
    want = reference.channel_norm_mish(x, w, b, 1e-5, add)
    assert out.shape == x.shape
    assert _rel(out, want) < (8e-3 if dtype == torch.bfloat16 else 1e-5)


def test_pool_write(device: str, dtype: torch.dtype) -> None:
    pool_k, pool_v, _ = _inputs(device, dtype, seed=13)
    qkv = torch.randn(3, 5, 3 * INNER, generator=torch.Generator().manual_seed(14)).to(device, dtype)
    k, v = qkv[..., INNER:2 * INNER], qkv[..., 2 * INNER:]
    rows = torch.tensor([4, 0, 2], device=device)
    pos = torch.tensor([10, 0, 395], device=device).unsqueeze(1) + torch.arange(5, device=device)
    pos[2] = torch.tensor([395, 396, 397, 398, 399], device=device)
    want_k, want_v = pool_k.clone(), pool_v.clone()
    reference.pool_write(k, v, want_k, want_v, rows, pos)
    flow.pool_write(k, v, pool_k, pool_v, rows, pos)
    assert torch.equal(pool_k, want_k) and torch.equal(pool_v, want_v)


def _norm_inputs(device: str, dtype: torch.dtype, seed: int, rows: int = 3, num_t: int = 45, dim: int = 256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, num_t, generator=g).to(device, dtype).transpose(1, 2)  # the U-Net's [R, T, C] view
    res = torch.randn(rows, num_t, dim, generator=g).to(device, dtype)
    scale = (1 + 0.1 * torch.randn(dim, generator=g)).to(device, dtype)
    norm = (scale, torch.randn(dim, generator=g).to(device, dtype), 1e-5)
    return g, x, res, norm


@pytest.mark.parametrize(("with_residual", "gelu", "with_bias"), [(False, True, True), (True, True, True),
                                                                  (True, False, False)])
def test_norm_linear(device: str, dtype: torch.dtype, with_residual: bool, gelu: bool, with_bias: bool) -> None:
    g, x, res, norm = _norm_inputs(device, dtype, 21)  # 135 rows: not a multiple of any tile
    w = (torch.randn(1024, 256, generator=g) / 16).to(device, dtype)
    b = torch.randn(1024, generator=g).to(device, dtype) if with_bias else None
    r = res if with_residual else None
    y, total = flow.norm_linear(x, r, norm, w, b, gelu=gelu)
    want_y, want_total = reference.norm_linear(x, r, norm, w, b, gelu=gelu)
    assert torch.equal(total, want_total)  # the residual stream is one rounded add, exactly
    assert _rel(y, want_y) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_qkv_pool_write(device: str, dtype: torch.dtype, with_residual: bool) -> None:
    g, x, res, norm = _norm_inputs(device, dtype, 22, num_t=37)
    w = (torch.randn(3 * INNER, 256, generator=g) / 16).to(device, dtype)
    pool = torch.randn(2, 5, 300, INNER, generator=g).to(device, dtype)
    want_pool = pool.clone()
    rows = torch.tensor([4, 0, 2], device=device)
    write_pos = torch.tensor([0, 100, 250], device=device).unsqueeze(1) + torch.arange(37, device=device)
    r = res if with_residual else None
    q, total = flow.norm_qkv_pool_write(x, r, norm, w, pool[0], pool[1], rows, write_pos)
    want_q, want_total = reference.norm_qkv_pool_write(x, r, norm, w, want_pool[0], want_pool[1], rows, write_pos)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.equal(total, want_total)
    assert _rel(q, want_q) < tol
    written = torch.zeros(5, 300, dtype=torch.bool, device=device)
    written[rows.unsqueeze(1), write_pos] = True
    assert _rel(pool[:, written], want_pool[:, written]) < tol
    assert torch.equal(pool[:, ~written], want_pool[:, ~written])  # nothing else in the pool moved


def _conv_case(device: str, dtype: torch.dtype, seed: int, num_t: int, n_in: int = 80, n_out: int = 48,
               rows: int = 3, strided: bool = True):
    """x (a transposed view when strided, as after the transformers), a state with several convs' tails;
    channel counts off the kernel's block sizes (masked lanes)."""
    g = torch.Generator().manual_seed(seed)
    if strided:
        x = torch.randn(rows, num_t, n_in, generator=g).to(device, dtype).transpose(1, 2)
    else:
        x = torch.randn(rows, n_in, num_t, generator=g).to(device, dtype)
    state = torch.randn(rows, n_in + 40, 2, generator=g).to(device, dtype)  # every row its own tail
    w = (torch.randn(n_out, n_in, 3, generator=g) / (3 * n_in) ** 0.5).to(device, dtype)
    b = (0.1 * torch.randn(n_out, generator=g)).to(device, dtype)
    norm = ((1 + 0.3 * torch.randn(n_out, generator=g)).to(device, dtype),
            (2 * torch.randn(n_out, generator=g)).to(device, dtype))  # large shifts: both Mish branches
    # add: a column slice of a wider GEMM output (the batched time embedding); res: a transposed view
    add = torch.randn(rows, 3 * n_out, generator=g).to(device, dtype)[:, n_out:2 * n_out]
    res = torch.randn(rows, num_t, n_out, generator=g).to(device, dtype).transpose(1, 2)
    return x, state, w, b, norm, add, res


@pytest.mark.parametrize("num_t", [1, 2, 45])  # 45: more than one frame tile
@pytest.mark.parametrize("epilogue", ["none", "norm_mish", "norm_mish_add", "norm_mish_add_res", "mish_res"])
def test_causal_conv(device: str, dtype: torch.dtype, num_t: int, epilogue: str) -> None:
    x, state, w, b, (nw, nb), add, res = _conv_case(device, dtype, seed=num_t, num_t=num_t)
    offset = 24  # this conv owns state channels [24, 104); the others must stay untouched
    kw = {"norm_weight": nw if "norm" in epilogue else None, "norm_bias": nb if "norm" in epilogue else None,
          "eps": 1e-5, "mish": "mish" in epilogue, "add": add if "add" in epilogue else None,
          "res": res if "res" in epilogue else None}
    want_state = state.clone()
    new_tail = torch.cat([state[:, offset:offset + x.shape[1]], x], dim=2)[:, :, -2:].clone()
    want = reference.causal_conv(x, want_state, offset, w, b, **kw)
    out = flow.causal_conv(x, state, offset, w, b, **kw)
    assert out.shape == want.shape and out.is_contiguous()
    assert torch.equal(state, want_state)  # the new tail bit for bit, other convs' channels untouched
    assert torch.equal(state[:, offset:offset + x.shape[1]], new_tail)
    assert _rel(out, want) < (8e-3 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("co_blocks", [2, 4])
@pytest.mark.parametrize("epilogue", ["none", "norm_mish_add_res", "mish_res"])
def test_causal_conv_split_over_output_channels(device: str, dtype: torch.dtype, co_blocks: int,
                                                epilogue: str) -> None:
    """Conv in channel blocks, then the per-frame epilogue as its own launch: the same numbers and tail."""
    x, state, w, b, (nw, nb), add, res = _conv_case(device, dtype, seed=30 + co_blocks, num_t=45)
    kw = {"norm_weight": nw if "norm" in epilogue else None, "norm_bias": nb if "norm" in epilogue else None,
          "eps": 1e-5, "mish": "mish" in epilogue, "add": add if "add" in epilogue else None,
          "res": res if "res" in epilogue else None}
    want_state = state.clone()
    want = reference.causal_conv(x, want_state, 24, w, b, **kw)
    tail_out = torch.full_like(state, float("nan"))
    out = flow.causal_conv(x, state, 24, w, b, **kw, tail_out=tail_out, tile=Tile(16, 32, 4, 2, co_blocks))
    assert torch.equal(tail_out[:, 24:104], want_state[:, 24:104])
    assert _rel(out, want) < (8e-3 if dtype == torch.bfloat16 else 1e-5)


def test_causal_conv_tail_uses_the_state_and_every_row_its_own() -> None:
    """The reference itself: the left context is the row's own tail (a conv with zeros there differs)."""
    x, state, w, b, _, _, _ = _conv_case("cpu", torch.float32, seed=5, num_t=4, strided=False)
    out = reference.causal_conv(x, state.clone(), 0, w, b)
    assert not torch.allclose(out[:, :, :2], reference.causal_conv(x, torch.zeros_like(state), 0, w, b)[:, :, :2])
    torch.testing.assert_close(out[:, :, 2:], F.conv1d(x, w, b))  # later frames see only x
    swapped = reference.causal_conv(x[[1, 0, 2]], state.clone(), 0, w, b)
    assert not torch.allclose(swapped[0, :, :2], out[1, :, :2])


@pytest.mark.parametrize("num_t", [1, 3])
def test_causal_conv_tail_out(device: str, dtype: torch.dtype, num_t: int) -> None:
    """With tail_out the state is only read; the new tail lands in tail_out at the same channels."""
    x, state, w, b, (nw, nb), _, _ = _conv_case(device, dtype, seed=20 + num_t, num_t=num_t)
    before = state.clone()
    tail_out = torch.full_like(state, float("nan"))
    want_state = state.clone()
    want = reference.causal_conv(x, want_state, 10, w, b, nw, nb, mish=True)
    out = flow.causal_conv(x, state, 10, w, b, nw, nb, mish=True, tail_out=tail_out)
    assert torch.equal(state, before)
    assert torch.equal(tail_out[:, 10:90], want_state[:, 10:90])
    assert tail_out[:, :10].isnan().all() and tail_out[:, 90:].isnan().all()
    assert _rel(out, want) < (8e-3 if dtype == torch.bfloat16 else 1e-5)


def test_pooled_attention_over_the_projections_own_keys(device: str, dtype: torch.dtype) -> None:
    """The final pass's attention (PooledKV.own_keys): q/k/v are views of one projection, each row its own pool
    row; row r sees its first key_limit[r] frames."""
    g = torch.Generator().manual_seed(23)
    rows, frames = 4, 96
    qkv = torch.randn(rows, frames, 3 * INNER, generator=g).to(device, dtype)
    q, k, v = qkv[..., :INNER], qkv[..., INNER:2 * INNER], qkv[..., 2 * INNER:]
    q_pos = torch.arange(frames, device=device).repeat(rows, 1)
    limit = torch.tensor([96, 50, 1, 64], device=device)
    own_rows = torch.arange(rows, device=device)
    got = flow.pooled_attention(q, k, v, own_rows, q_pos, limit, 0, frames, HEADS)
    keys = torch.arange(frames, device=device)
    bias = torch.zeros(rows, 1, 1, frames, device=device, dtype=dtype).masked_fill(
        (keys[None, :] >= limit[:, None]).view(rows, 1, 1, frames), float("-inf"))

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(rows, frames, HEADS, -1).transpose(1, 2)

    want = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=bias)
    assert got.shape == (rows, frames, INNER)
    assert _rel(got, want.transpose(1, 2).reshape(rows, frames, INNER)) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    # keys past a row's limit are never read: NaN there changes nothing
    qkv[1, 50:, INNER:] = float("nan")
    qkv[2, 1:, INNER:] = float("nan")
    again = flow.pooled_attention(q, k, v, own_rows, q_pos, limit, 0, frames, HEADS)
    assert torch.isfinite(again).all() and torch.equal(again, got)


@pytest.mark.parametrize("tile", [None, Tile(64, 32, 4, 2)])
def test_causal_conv_large_frame_tiles(device: str, dtype: torch.dtype, tile: Tile | None) -> None:
    """The final pass's launch shape (64-frame tiles; None: the default tile of a row count past LARGE_ROWS):
    frame tiles that straddle the end of a row, the tail from the last tile."""
    num_t = (flow.LARGE_ROWS // 2 + 37) if tile is None else 150
    assert tile is not None or flow.row_class(2 * num_t) == 2
    x, state, w, b, (nw, nb), add, res = _conv_case(device, dtype, seed=41, num_t=num_t, rows=2, n_out=64)
    kw = {"norm_weight": nw, "norm_bias": nb, "eps": 1e-5, "mish": True, "add": add, "res": res}
    want_state = state.clone()
    want = reference.causal_conv(x, want_state, 24, w, b, **kw)
    out = flow.causal_conv(x, state, 24, w, b, **kw, tile=tile)
    assert torch.equal(state, want_state)
    assert _rel(out, want) < (8e-3 if dtype == torch.bfloat16 else 1e-5)


def test_causal_conv_wide_tiles_of_a_prompt_pass(device: str, dtype: torch.dtype) -> None:
    """A wave of new voices' prompt pass (24 rows of 225 frames) takes the wide 32-frame tiles by default, the
    last one straddling each row's end: the same numbers and tail as the reference. 16 streams' chunks (32 rows
    of 50 frames) keep the 16-frame tiles."""
    rows, num_t = 24, 225
    assert flow.conv_tile(rows, num_t) == flow.WIDE_CONV_TILE and num_t % flow.WIDE_CONV_TILE.block_m
    assert flow.conv_tile(32, 50) == flow.TILES[("conv", 1)]
    x, state, w, b, (nw, nb), add, res = _conv_case(device, dtype, seed=47, num_t=num_t, rows=rows, n_in=40,
                                                     n_out=32)
    kw = {"norm_weight": nw, "norm_bias": nb, "eps": 1e-5, "mish": True, "add": add, "res": res}
    want_state = state.clone()
    want = reference.causal_conv(x, want_state, 24, w, b, **kw)
    out = flow.causal_conv(x, state, 24, w, b, **kw)
    assert torch.equal(state, want_state)
    assert _rel(out, want) < (8e-3 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("num_t", [1, 37])
def test_project_cfg_euler(device: str, dtype: torch.dtype, num_t: int) -> None:
    """The ODE's final 1x1 projection, CFG mix and Euler update in one kernel: the new state and the next
    estimator rows equal the module statements (cfm.euler_step, cfm.cfg_rows) on a strided hidden state."""
    g = torch.Generator().manual_seed(41)
    pairs = 3
    h = torch.randn(2 * pairs, num_t, 256, generator=g).to(device, dtype).transpose(1, 2)  # [2B, C, T] strided
    w = (torch.randn(80, 256, 1, generator=g) / 16).to(device, dtype)
    b = torch.randn(80, generator=g).to(device, dtype)
    x = torch.randn(pairs, 80, num_t, generator=g).to(device)
    x_new, rows = flow.project_cfg_euler(h, w, b, x, 0.0731, 0.7)
    want_x, want_rows = reference.project_cfg_euler(h, w, b, x, 0.0731, 0.7)
    assert rows.dtype == dtype and x_new.dtype == torch.float32 and rows.shape == (2 * pairs, 80, num_t)
    assert torch.equal(rows[0::2], rows[1::2])  # each request's state twice: conditional and unconditional rows
    tol = 2e-3 if dtype == torch.bfloat16 else 1e-6
    assert _rel(x_new - x, want_x - x) < tol  # the update itself, not only the state it is added to
    assert _rel(rows.float(), want_rows.float()) < tol


def test_project_cfg_euler_reads_its_step_from_the_device(device: str) -> None:
    """A final pass's one step graph serves every Euler step, so its step size comes from a device tensor
    (read when the kernel runs): the same numbers as that step size given as a float, and a changed tensor
    is a changed step."""
    g = torch.Generator().manual_seed(43)
    h = torch.randn(4, 256, 21, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(80, 256, 1, generator=g) / 16).to(device, torch.bfloat16)
    b = torch.randn(80, generator=g).to(device, torch.bfloat16)
    x = torch.randn(2, 80, 21, generator=g).to(device)
    dt = torch.tensor([0.0731], device=device)
    for ops in (flow, reference):
        got_x, got_rows = ops.project_cfg_euler(h, w, b, x, dt, 0.7)
        want_x, want_rows = ops.project_cfg_euler(h, w, b, x, 0.0731, 0.7)
        assert torch.equal(got_x, want_x) and torch.equal(got_rows, want_rows)
        dt.fill_(0.25)
        stepped = ops.project_cfg_euler(h, w, b, x, dt, 0.7)[0]
        assert torch.equal(stepped, ops.project_cfg_euler(h, w, b, x, 0.25, 0.7)[0])
        dt.fill_(0.0731)


@pytest.mark.parametrize(("layout", "k_in", "with_bias", "with_residual"), [
    ("frames", 512, True, False),  # the attention's output projection
    ("frames", 1024, True, True),  # the last feed-forward projection of a group, with the group's residual add
    ("channels", 320, True, False),  # a ResNet's 1x1 residual conv over [R, C, T] (the first ResNet's input)
    ("channels", 100, False, True),  # inputs not a multiple of the kernel's K step
])
def test_linear_residual(device: str, dtype: torch.dtype, layout: str, k_in: int, with_bias: bool,
                         with_residual: bool) -> None:
    g = torch.Generator().manual_seed(k_in)
    rows, num_t, n_out = 3, 45, 256  # 135 rows: not a multiple of any tile
    if layout == "frames":
        x = torch.randn(rows, num_t, k_in, generator=g).to(device, dtype)
    else:  # a transposed view: the frames' inputs are strided
        x = torch.randn(rows, k_in, num_t, generator=g).to(device, dtype).transpose(1, 2)
    w = (torch.randn(n_out, k_in, generator=g) / k_in ** 0.5).to(device, dtype)
    b = torch.randn(n_out, generator=g).to(device, dtype) if with_bias else None
    res = torch.randn(rows, num_t, n_out, generator=g).to(device, dtype) if with_residual else None
    out = flow.linear_residual(x, w, b, res)
    assert out.shape == (rows, num_t, n_out) and out.is_contiguous()
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    if res is not None:
        exact = exact + res.double()
    assert _rel(out, exact) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    want = reference.linear_residual(x, w, b, res)
    assert _rel(out, want) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("tile", [Tile(16, 16, 2, 2), Tile(64, 128, 8, 3)])
def test_linear_residual_with_other_launch_tiles(device: str, dtype: torch.dtype, tile: Tile) -> None:
    """Row and column tiles that straddle the ends (135 rows, 200 outputs)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 27, 192, generator=g).to(device, dtype)
    w = (torch.randn(200, 192, generator=g) / 14).to(device, dtype)
    b = torch.randn(200, generator=g).to(device, dtype)
    res = torch.randn(5, 27, 200, generator=g).to(device, dtype)
    out = flow.linear_residual(x, w, b, res, tile=tile)
    want = F.linear(x.double(), w.double(), b.double()) + res.double()
    assert _rel(out, want) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_linear_residual_into_a_given_tensor(device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 256, 9, generator=g).to(device, dtype).transpose(1, 2)
    w = (torch.randn(256, 256, generator=g) / 16).to(device, dtype)
    b = torch.randn(256, generator=g).to(device, dtype)
    for ops in (flow, reference):
        out = torch.full((2, 9, 256), float("nan"), device=device, dtype=dtype)
        assert ops.linear_residual(x, w, b, out=out) is out
        assert _rel(out, F.linear(x.double(), w.double(), b.double())) < (1e-2 if dtype == torch.bfloat16 else 1e-5)

