"""The Snake kernel computes what its torch statement (kernels/reference.py, the official operation order)
computes, and HiFT with it computes what HiFT with the statement computes."""

from __future__ import annotations

import pytest
import torch

from cosystream.engine import vocoder_fast
from cosystream.kernels import reference, vocoder
from cosystream.models.hift import Snake


@pytest.fixture
def dtype(device: str) -> torch.dtype:
    # bf16 on the GPU only: the CPU interpreter does not round to bf16 as the GPU does (test_decode_kernels.py)
    return torch.bfloat16 if device == "cuda" else torch.float32


@pytest.mark.parametrize("num_t", [1, 700, 2100])  # one partial block; several blocks per row
def test_snake(device: str, dtype: torch.dtype, num_t: int) -> None:
    g = torch.Generator().manual_seed(num_t)
    x = (torch.randn(3, 5, num_t, generator=g) * 4).to(device, dtype)  # arguments past ±π: sin's periods
    alpha = (torch.rand(5, generator=g) * 2 + 0.05).to(device, dtype)
    alpha[1] = 0.0  # an untrained channel: the ε keeps it finite (x + sin²(0)/ε = x)
    got = vocoder.snake(x, alpha, 1e-9)
    want = reference.snake(x, alpha, 1e-9)
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(got[:, 1], x[:, 1])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    else:  # every intermediate rounded as torch rounds it: a sin one bf16 step apart moves the sum by
        # about one step of its larger term (x or the sin² term, which can nearly cancel)
        terms = x.float().abs() + (want.float() - x.float()).abs()
        assert ((got.float() - want.float()).abs() <= terms * 2 ** -7 + 1e-6).all()
        assert (got == want).float().mean() > 0.95


def test_snake_of_a_strided_input_and_empty(device: str) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 40, 6, generator=g).to(device).transpose(1, 2)  # [2, 6, 40] not contiguous
    alpha = torch.rand(6, generator=g).to(device) + 0.5
    torch.testing.assert_close(vocoder.snake(x, alpha, 1e-9), reference.snake(x, alpha, 1e-9))
    assert vocoder.snake(x[:, :, :0], alpha, 1e-9).shape == (2, 6, 0)


def test_snake_module_uses_its_kernels(device: str) -> None:
    module = Snake(4).to(device)
    with torch.no_grad():
        module.alpha.copy_(torch.tensor([0.5, 1.0, 2.0, 3.0]))
    x = torch.randn(2, 4, 50, generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        plain = module(x)
        vocoder_fast.accelerate(module, vocoder)
        fused = module(x)
    torch.testing.assert_close(fused, plain, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(plain, reference.snake(x, module.alpha, 1e-9), atol=0, rtol=0)
