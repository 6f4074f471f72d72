"""copy_words: the same bits as torch's copy_, as words where the layouts allow, element by element where not."""

import pytest
import torch

from cosystream.engine.pool_copy import _as_words, copy_words


def _pool() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(3, 4, 2, 10, 12, 16, generator=gen).to(torch.bfloat16)


def test_a_slot_and_a_cache_are_copied_as_words_both_ways():
    pool = _pool()
    cache = torch.randn(3, 4, 2, 2, 6, 16).to(torch.bfloat16)
    slot = pool[:, :, :, 4:6, :6]
    assert _as_words(slot) and _as_words(cache)
    before = pool.clone()
    copy_words(slot, cache)
    assert torch.equal(pool[:, :, :, 4:6, :6], cache)
    untouched = torch.ones_like(pool, dtype=torch.bool)
    untouched[:, :, :, 4:6, :6] = False
    assert torch.equal(pool[untouched], before[untouched])
    out = torch.empty_like(cache)
    copy_words(out[1], pool[1, :, :, 2:4, :6])
    assert torch.equal(out[1], pool[1, :, :, 2:4, :6])


@pytest.mark.parametrize("view", [lambda t: t[..., 1:5], lambda t: t[..., ::2], lambda t: t.transpose(-1, -2)])
def test_layouts_that_are_not_whole_words_are_copied_element_by_element(view):
    src = view(_pool())
    assert not _as_words(src)
    dst = torch.zeros_like(src)
    copy_words(dst, src)
    assert torch.equal(dst, src)


def test_float32_and_odd_widths():
    src = torch.randn(4, 6, 8)
    dst = torch.empty(4, 6, 8)
    copy_words(dst, src)
    assert torch.equal(dst, src) and _as_words(src)
    odd = torch.randn(4, 3).to(torch.float16)
    assert not _as_words(odd)
    copy_words(dst_odd := torch.empty_like(odd), odd)
    assert torch.equal(dst_odd, odd)


def test_different_shapes_or_dtypes_are_refused():
    with pytest.raises(ValueError, match="copy_words"):
        copy_words(torch.empty(2, 4), torch.empty(4, 4))
    with pytest.raises(ValueError, match="copy_words"):
        copy_words(torch.empty(2, 4), torch.empty(2, 4, dtype=torch.float64))
