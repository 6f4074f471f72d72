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


# PERF: launch the LM decode step's kernels with programmatic dependent launch (`_launch_jit`; Hopper or
# newer and a Triton with grid dependency control). Read at launch, so at CUDA-graph capture. Measured on
# the H100 (benchmarks/decode_launch.py): a batch-1 step 0.91 -> 0.81 ms, batch 16 1.00 -> 0.90 ms. The
# flow estimator's kernels gained nothing from it (they alternate with cuBLAS GEMMs, which PDL cannot
# overlap; docs/benchmarks.md), so they launch plainly.
PDL = True


def pdl_launch(x: torch.Tensor) -> dict:
    """The `PDL` constexpr and launch option of a decode kernel working on x's device."""
    if PDL and x.is_cuda and _pdl_capable(x.get_device()):  # get_device: the CUDA index, never None
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@functools.cache
def _pdl_capable(device_index: int) -> bool:
    """Hopper or newer, and a Triton with grid dependency control."""
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    from cosystream.kernels._launch_jit import HAS_GDC

    return HAS_GDC
