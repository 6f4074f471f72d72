"""Fused GPU kernels (Triton) for the hot paths, each beside a plain-torch statement of the same op.

`reference.py` holds the torch versions: they run on the CPU (CI, laptops) and are what the Triton
versions are tested against. `decode.py` holds the Triton kernels of the LM decode step, `flow.py`
those of the flow estimator, `sample.py` the sampler. Triton is imported lazily, only when a kernel is
first used on a CUDA device, so the package imports without it.
"""

from __future__ import annotations

import functools
import importlib.util

import torch


def triton_usable(device: torch.device | str) -> bool:
    """True when Triton kernels can run on `device` (a CUDA device with Triton installed)."""
    return torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None


def pdl_launch(x: torch.Tensor, early: bool | None = None) -> dict:
    """The `PDL` constexpr and launch options of a kernel working on x's device: programmatic dependent
    launch (`_launch_jit`) wherever the GPU and Triton support it, so the kernel's launch and start-up
    overlap the kernel before it and it waits on the device for that kernel's results. For a kernel with an
    `EARLY` constexpr (early: whether its early loads are safe here) that too: with PDL, a kernel loads what
    no kernel of the step writes before it (cached keys/values, positions and RoPE terms, norm weights, the
    sampler's row state) ahead of that wait, overlapping the kernel before it."""
    pdl = x.is_cuda and _pdl_capable(x.get_device())  # get_device: the CUDA index, never None
    options: dict = {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
    if early is not None:
        options["EARLY"] = bool(early and pdl)
    return options


@functools.cache
def _pdl_capable(device_index: int) -> bool:
    """Hopper or newer, and a Triton with grid dependency control."""
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    from cosystream.kernels._launch_jit import HAS_GDC

    return HAS_GDC
