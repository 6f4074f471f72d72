"""The CosyVoice3 DiT's pooled ops (kernels/flow.py) compute what their torch statements (kernels/reference.py)
compute: the partial rotary + pool write, the gated residual + adaLN norm, and a whole batched pool chunk
(models/cosyvoice3/pool.py) run through the Triton ops against the same chunk through the torch ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cosystream.kernels import flow, reference
from cosystream.models.cosyvoice3.flow import CV3Flow
from cosystream.models.cosyvoice3.pool import FlowSlotPool, SlotChunk, pack_chunks
from cosystream.testing.random_model_cv3 import hparams_cv3


@pytest.fixture
def dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32  # see test_decode_kernels.py


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(("heads", "dim_head", "rot"), [(2, 32, 32), (4, 16, 8), (16, 64, 64)])  # tiny, odd, 0.5B
def test_partial_rotary_and_pool_write(device: str, dtype: torch.dtype, heads: int, dim_head: int, rot: int) -> None:
    """q and k rotated on their first `rot` channels in place, k and v stored at their pool rows and frames,
    every other pool entry untouched."""
    g = torch.Generator().manual_seed(31)
    inner, rows, frames = heads * dim_head, 4, 7
    qkv = torch.randn(rows, frames, 3 * inner, generator=g).to(device, dtype)
    angles = (torch.arange(frames)[:, None] * torch.rand(rot // 2, generator=g) * 3).repeat_interleave(2, dim=-1)
    cos = angles.cos().expand(rows, -1, -1).contiguous().to(device)
    sin = (angles.sin() * torch.tensor([-1.0, 1.0]).repeat(rot // 2)).expand(rows, -1, -1).contiguous().to(device)
    pool = torch.randn(2, 6, 40, inner, generator=g).to(device, dtype)
    pool_rows = torch.tensor([5, 0, 3, 2], device=device)
    writes = torch.tensor([0, 9, 20, 33], device=device)[:, None] + torch.arange(frames, device=device)
    want_qkv, want_pool = qkv.clone(), pool.clone()
    reference.partial_rotary(want_qkv, cos, sin, (want_pool[0], want_pool[1], pool_rows, writes))
    flow.partial_rotary(qkv, cos, sin, (pool[0], pool[1], pool_rows, writes))
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(qkv, want_qkv, **tol)
    torch.testing.assert_close(pool, want_pool, **tol)
    # what is not rotated is moved exactly: q's and k's other channels, v
    assert torch.equal(qkv[..., rot:inner], want_qkv[..., rot:inner])
    assert torch.equal(qkv[..., inner + rot:], want_qkv[..., inner + rot:])
    assert torch.equal(pool[:, :, :, rot:], want_pool[:, :, :, rot:])
    assert not torch.equal(want_qkv[..., :rot], qkv.new_zeros(1))  # the rotation did something
    # without a pool: the same rotation, nothing stored
    again, want_again = want_qkv.clone(), want_qkv.clone()
    reference.partial_rotary(want_again, cos, sin)
    flow.partial_rotary(again, cos, sin)
    torch.testing.assert_close(again, want_again, **tol)
    assert torch.equal(again[..., inner + rot:], want_qkv[..., inner + rot:])


def test_add_layer_norm_with_a_gate(device: str, dtype: torch.dtype) -> None:
    """adaLN-zero's gated residual h + gate·y, then the modulated norm (weight 1 + scale, bias shift)."""
    g = torch.Generator().manual_seed(32)
    y = torch.randn(3, 256, 37, generator=g).to(device, dtype).transpose(1, 2)  # a strided [R, T, C] view
    h = torch.randn(3, 37, 256, generator=g).to(device, dtype)
    gate = torch.randn(256, generator=g).to(device, dtype)
    w = (1 + 0.3 * torch.randn(256, generator=g)).to(device, dtype)
    b = torch.randn(256, generator=g).to(device, dtype)
    out, total = flow.add_layer_norm(y, h, w, b, 1e-6, gate=gate)
    want_out, want_total = reference.add_layer_norm(y, h, w, b, 1e-6, gate=gate)
    torch.testing.assert_close(total, want_total, **(dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16
                                                     else dict(rtol=1e-6, atol=1e-6)))
    assert _rel(out, want_out) < (4e-3 if dtype == torch.bfloat16 else 1e-5)
    with pytest.raises(ValueError, match="needs a residual"):
        reference.add_layer_norm(y, None, w, b, 1e-6, gate=gate)


def _pool_chunks(pool: FlowSlotPool, gen: torch.Generator, streaming: bool) -> list[SlotChunk]:
    """Block-causal: a stream with committed frames (random keys in its slot, as after earlier chunks) and
    one starting at frame 0; full passes: two from frame 0 over stale slots. Chunks of different lengths
    (padded in the batch); small, for Triton's CPU interpreter."""
    block = pool.dims.static_chunk_size
    chunks = []
    spans = [(2, block + 1, 9), (1, 0, 20)] if streaming else [(2, 0, 30), (1, 0, 9)]
    for slot, start, valid in spans:
        mu = torch.randn(1, pool.dims.mel_dim, valid, generator=gen).to(pool.device, pool.dtype)
        cond = torch.randn(1, pool.dims.mel_dim, valid, generator=gen).to(pool.device, pool.dtype)
        spks = torch.randn(1, pool.dims.mel_dim, generator=gen).to(pool.device, pool.dtype)
        chunks.append(SlotChunk(slot=slot, start=start, valid=valid, keep=(valid // block) * block,
                                first_new=start, mu=mu, cond=cond, spks=spks, streaming=streaming))
    return chunks


@pytest.mark.parametrize("streaming", [True, False])
def test_pool_chunk_through_the_triton_ops_equals_the_torch_ops(device: str, dtype: torch.dtype,
                                                                streaming: bool) -> None:
    """The tiny DiT's batched chunk (Euler steps, padding, committed keys, block-causal or full attention)
    with the pool's ops swapped: same keys/values written, same x1."""
    torch.manual_seed(0)
    # two Euler steps instead of the model's ten and conv groups of 32 channels instead of 4: the same ops,
    # a small part of the interpreter's time (test_grouped_conv_mish covers groups of 4)
    hp = hparams_cv3("tiny").flow
    hp = dataclasses.replace(hp, n_timesteps=2, dit=dataclasses.replace(hp.dit, conv_pos_groups=2))
    cv3 = CV3Flow(hp).to(device=device, dtype=dtype).eval()
    cv3.decoder.rand_noise = cv3.decoder.rand_noise.float()
    block = cv3.decoder.estimator.dims.static_chunk_size
    pool = FlowSlotPool(cv3, num_slots=3, max_frames=4 * block, ops=reference)
    gen = torch.Generator().manual_seed(33)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen))
    chunks = _pool_chunks(pool, gen, streaming)
    frames = -(-max(c.valid for c in chunks) // 16) * 16
    inputs = pack_chunks(pool, chunks, frames)
    key_frames = max(c.start + c.valid for c in chunks)
    outs, kvs = [], []
    with torch.no_grad():
        for ops in (reference, flow):
            pool.ops = ops
            kv = pool.kv.clone()
            outs.append(pool.chunk(*inputs, key_frames=key_frames, streaming=streaming))
            kvs.append(pool.kv.clone())
            pool.kv.copy_(kv)
    want, got = outs
    for i, c in enumerate(chunks):
        assert _rel(got[i, :, :c.valid], want[i, :, :c.valid]) < (2e-2 if dtype == torch.bfloat16 else 1e-5)
        rows = slice(2 * c.slot, 2 * c.slot + 2)
        written = slice(c.start, c.start + c.valid)  # this chunk's keys/values (the rest is as it was)
        assert _rel(kvs[1][:, :, :, rows, written], kvs[0][:, :, :, rows, written]) < \
            (2e-2 if dtype == torch.bfloat16 else 1e-5)
        assert torch.equal(kvs[1][:, :, :, rows, :c.start], kvs[0][:, :, :, rows, :c.start])


@pytest.mark.parametrize(("channels", "groups", "with_residual"), [(64, 16, False), (128, 2, True), (96, 3, True)])
def test_grouped_conv_mish(device: str, dtype: torch.dtype, channels: int, groups: int, with_residual: bool) -> None:
    """The DiT's conv position embedding: 31 taps, groups of 4 (padded to a tensor-core width), 64 and 32
    channels each, over a strided input (a cat of the tail and a transposed view, as in the pool)."""
    g = torch.Generator().manual_seed(34)
    frames, taps = 21, 31
    x = torch.randn(3, frames + taps - 1, channels, generator=g).to(device, dtype).transpose(1, 2)
    weight = (torch.randn(channels, channels // groups, taps, generator=g) / 8).to(device, dtype)
    bias = torch.randn(channels, generator=g).to(device, dtype)
    res = torch.randn(3, frames, channels, generator=g).to(device, dtype) if with_residual else None
    out = flow.grouped_conv_mish(x, weight, bias, res)
    want = reference.grouped_conv_mish(x, weight, bias, res)
    assert out.shape == want.shape == ((3, frames, channels) if with_residual else (3, channels, frames))
    assert _rel(out, want) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
