"""Copies between the flow pool and voices' caches, moved as 8-byte words.

A voice's prompt state is 0.57 GB of bf16 keys and values (a 6 s prompt on the 0.5B model: 10 Euler steps x 56
attention blocks x 2 x 2 CFG rows x 250 frames x 512), copied into a slot when a stream opens from the voice and
out of the slot, step by step, when a new voice's prompt pass writes its cache. PERF: torch copies such strided
views element by element (2 bytes a load) and, as the pool spans more than 2^31 elements, in several kernels;
the same bytes viewed as int64 words move 4 elements a load, in fewer kernels (benchmarks/pool_copies.py times
both). The bits copied are the same.
"""

from __future__ import annotations

import torch

WORD = torch.int64


def copy_words(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` for tensors of one dtype and shape, as int64 words where both layouts allow it (the last
    dimension contiguous, its bytes and every other stride and offset a whole number of words); else as is."""
    if dst.dtype != src.dtype or dst.shape != src.shape:
        raise ValueError(f"copy_words: {src.dtype} {tuple(src.shape)} into {dst.dtype} {tuple(dst.shape)}")
    if _as_words(dst) and _as_words(src):
        dst.view(WORD).copy_(src.view(WORD))
    else:
        dst.copy_(src)


def _as_words(t: torch.Tensor) -> bool:
    per_word = WORD.itemsize // t.element_size() if t.element_size() <= WORD.itemsize else 0
    if per_word == 0 or t.dim() == 0 or t.stride(-1) != 1 or t.shape[-1] % per_word:
        return False
    outer = zip(t.shape[:-1], t.stride()[:-1], strict=True)
    return t.storage_offset() % per_word == 0 and all(stride % per_word == 0 for size, stride in outer if size > 1)
