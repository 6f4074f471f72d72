"""Fused GPU kernels (Triton) for the hot paths, each beside a plain-torch statement of the same op.

`reference.py` holds the torch versions: they run on the CPU (CI, laptops) and are what the Triton
versions are tested against. `decode.py` holds the Triton kernels of the LM decode step. Triton is
imported lazily, only when a kernel is first used on a CUDA device, so the package imports without it.
"""

from __future__ import annotations

import importlib.util

import torch


def triton_usable(device: torch.device | str) -> bool:
    """True when Triton kernels can run on `device` (a CUDA device with Triton installed)."""
    return torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None
