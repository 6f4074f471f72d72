"""The pooled flow-attention kernel computes what its torch statement in kernels/reference.py computes."""

from __future__ import annotations

import pytest
import torch

from cosystream.kernels import flow, reference

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
