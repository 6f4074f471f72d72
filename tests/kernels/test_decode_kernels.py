"""The Triton decode kernels compute what their torch statements in kernels/reference.py compute."""

from __future__ import annotations

import pytest
import torch

from cosystream.kernels import decode, reference

H, KV, D = 14, 2, 64  # the 0.5B model's attention heads


@pytest.fixture
def dtype(device: str) -> torch.dtype:
    # Triton's CPU interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest), so on the CPU
    # the kernels are checked in float32, where the interpreter is exact.
    return torch.bfloat16 if device == "cuda" else torch.float32


def _tol(dtype: torch.dtype) -> float:
    return 4e-3 if dtype == torch.bfloat16 else 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(device: str, dtype: torch.dtype, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 896, generator=g).to(device, dtype)
    r = torch.randn(5, 896, generator=g).to(device, dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(896, generator=g)).to(device, dtype)
    out, res = decode.add_rms_norm(x, r, w, 1e-6)
    want_out, want_res = reference.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(res, want_res)  # the residual add is rounded exactly like torch's bf16 add
    assert _rel(out, want_out) < _tol(dtype)  # one rounding of a float32 sum taken in another order


def test_silu_mul(device: str, dtype: torch.dtype) -> None:
    x = torch.randn(3, 2 * 4864, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    assert _rel(decode.silu_mul(x), reference.silu_mul(x)) < _tol(dtype)


def _cache(device: str, dtype: torch.dtype, slots: int = 4, max_len: int = 300, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, KV, max_len, D, generator=g).to(device, dtype)
    v = torch.randn(slots, KV, max_len, D, generator=g).to(device, dtype)
    return k, v


def test_rope_write_kv(device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    batch, max_len = 3, 300
    qkv = torch.randn(batch, (H + 2 * KV) * D, generator=g).to(device, dtype)
    positions = torch.tensor([0, 17, 299], device=device)
    angles = torch.arange(max_len).float().unsqueeze(1) * 1e4 ** (-torch.arange(D // 2) / (D // 2))
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    k1, v1 = _cache(device, dtype, max_len=max_len)
    k2, v2 = k1.clone(), v1.clone()
    q = decode.rope_write_kv(qkv, positions, cos, sin, k1, v1, H, KV)
    want_q = reference.rope_write_kv(qkv, positions, cos, sin, k2, v2, H, KV)
    assert _rel(q, want_q) < _tol(dtype)
    assert _rel(k1, k2) < _tol(dtype) and torch.equal(v1, v2)  # k rotated, v copied, nothing else touched
    rows = torch.arange(batch, device=device)
    assert _rel(k1[rows, :, positions], k2[rows, :, positions]) < _tol(dtype)


@pytest.mark.parametrize("attn_len", [64, 256, 1024])
def test_decode_attention(device: str, dtype: torch.dtype, attn_len: int) -> None:
    g = torch.Generator().manual_seed(attn_len)
    batch = 3
    k, v = _cache(device, dtype, max_len=attn_len + 64, seed=attn_len)
    q = torch.randn(batch, H, D, generator=g).to(device, dtype)
    positions = torch.tensor([0, attn_len // 3, attn_len - 1], device=device)
    out = decode.decode_attention(q, k, v, positions, attn_len)
    want = reference.decode_attention(q.double(), k.double(), v.double(), positions, attn_len)
    assert out.shape == (batch, H * D)
    assert _rel(out, want) < (1e-2 if dtype == torch.bfloat16 else 1e-5)  # bf16: probabilities rounded


def test_decode_attention_ignores_keys_past_each_row(device: str, dtype: torch.dtype) -> None:
    # keys beyond a row's position must not matter: poison them and expect the same answer
    k, v = _cache(device, dtype, max_len=256)
    q = torch.randn(2, H, D, generator=torch.Generator().manual_seed(9)).to(device, dtype)
    positions = torch.tensor([10, 100], device=device)
    first = decode.decode_attention(q, k, v, positions, 256)
    k[0, :, 11:], v[0, :, 11:], k[1, :, 101:], v[1, :, 101:] = 1e4, 1e4, -1e4, 1e4
    assert torch.equal(decode.decode_attention(q, k, v, positions, 256), first)
