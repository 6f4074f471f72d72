"""Fault handling on the engine thread: what a failed request is told, and what is cleaned up after it.

A fault (an exception in a batched stage, NaN/inf in a model output, the device running out of memory)
fails the requests it touched and no other: the engine frees their slots, zeroes the slot state a NaN may
have reached (stale NaN keys or values poison attention even where it is masked, since 0 * NaN = NaN), and
on CUDA hands the allocator's cached blocks back after an out-of-memory (docs/reliability.md).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from cosystream.errors import CosyStreamError, SynthesisFailed

log = logging.getLogger("cosystream.engine")

NON_FINITE_TOKEN = -1  # an LM row's output token when its logits held NaN or inf


def to_request_error(error: BaseException) -> CosyStreamError:
    """The error a request that was part of a failed step receives (its message names the cause)."""
    if isinstance(error, CosyStreamError):
        return error
    if isinstance(error, torch.OutOfMemoryError):
        return SynthesisFailed("synthesis failed: the device ran out of memory on a batch holding this request; "
                               "retry later", code="out_of_memory")
    return SynthesisFailed(f"synthesis failed: {error!r}", code="engine_fault")


def non_finite(stage: str) -> SynthesisFailed:
    return SynthesisFailed(f"synthesis failed: the {stage} produced NaN or infinite values for this request",
                           code="non_finite_output")


def aborted() -> SynthesisFailed:
    """What a request's reader gets when the request was aborted by someone else (e.g. a timeout)."""
    return SynthesisFailed("synthesis aborted: the request was cancelled in the engine", code="aborted")


def mark_non_finite(logp: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """token [B] with NON_FINITE_TOKEN in the rows whose log-probabilities logp [B, V] are not all finite.

    Computed on the device beside sampling, so the host learns it from the token copy it makes anyway.
    """
    return torch.where(torch.isfinite(logp).all(dim=-1), token, torch.full_like(token, NON_FINITE_TOKEN))


def is_finite_audio(pcm: np.ndarray) -> bool:
    return bool(np.isfinite(pcm).all())


def scrub_lm_slot(lm_runner: Any, slot: int) -> None:
    """Zero a failed stream's KV-cache row so NaN it wrote cannot reach the slot's next owner."""
    lm_runner.cache.k[:, slot].zero_()
    lm_runner.cache.v[:, slot].zero_()


def scrub_flow_slot(token2wav: Any, state: Any) -> None:
    """Zero a failed stream's flow-pool rows (keys/values and conv tails of both CFG rows), if it still holds
    a slot (one given back, e.g. when its final pass began, may be another stream's by now)."""
    pool, flow = getattr(token2wav, "pool", None), getattr(state, "flow", None)
    slot = getattr(flow, "slot", None)
    if pool is None or slot is None or getattr(flow, "closed", False) or not getattr(flow, "in_slot", True):
        return
    rows = slice(2 * slot, 2 * slot + 2)
    pool.kv[:, :, :, rows].zero_()
    pool.conv[:, rows].zero_()


def release_device_memory(error: BaseException, device: torch.device) -> None:
    """After a CUDA out-of-memory, return cached blocks so the next batch starts from a clean allocator."""
    if isinstance(error, torch.OutOfMemoryError) and device.type == "cuda":
        torch.cuda.empty_cache()
        log.warning("out of memory: cache emptied, %d bytes still allocated", torch.cuda.memory_allocated(device))
