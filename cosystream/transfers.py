"""Host tensors onto the device without making the host wait for the device.

A plain host-to-device copy (`t.to("cuda")`, `torch.tensor(values, device="cuda")`) synchronises the host with
the current CUDA stream: the calling thread waits for everything queued on that stream before it, and gives up
the GIL meanwhile, which it then has to win back from the engine's other threads. `to_device` instead queues the
copy from pinned memory on the current stream (torch's caching host allocator keeps the pinned block until the
copy is done), so work queued after it on the same stream sees the data and the host goes on at once. The
way back, `to_host`, copies a batch's results in one go.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` (in `dtype`, converted on the host) on `device`; from the host to CUDA without a host sync. A host
    tensor is staged in a pinned copy of its own, so the caller may change it at once; one that is pinned already
    is read as it is, later, by the device: leave it alone until the stream has passed the copy."""
    device = torch.device(device)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype) if t.is_cpu else t.to(device, dtype)
    if device.type == "cuda" and t.is_cpu:
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def ints_to_device(values: Sequence[int], device: torch.device | str, dtype: torch.dtype = torch.long
                   ) -> torch.Tensor:
    """`torch.tensor(values, dtype, device=device)` without a host sync on CUDA."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_host(tensors: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> list[np.ndarray]:
    """Each tensor as a host array of its shape in `dtype`, all of them in one copy: the host waits for the
    device once, not once per tensor."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors]).cpu().numpy()
    arrays, start = [], 0
    for t in tensors:
        arrays.append(flat[start:start + t.numel()].reshape(tuple(t.shape)))
        start += t.numel()
    return arrays
