"""Fused GPU kernels (Triton) for the hot paths, each beside a plain-torch statement of the same op.

`reference.py` holds the torch versions: they run on the CPU (CI, laptops) and are what the Triton
versions are tested against. `decode.py` holds the Triton kernels of the LM decode step, `flow.py`
those of the flow estimator, `sample.py` the sampler. Triton is imported lazily, only when a kernel is
first used on a CUDA device, so the package imports without it.
"""

from __future__ import annotations

import importlib.util

import torch


def triton_usable(device: torch.device | str) -> bool:
    """True when Triton kernels can run on `device` (a CUDA device with Triton installed)."""
    return torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None


# PERF: programmatic dependent launch (`_launch_jit`; Hopper or newer and a Triton with grid dependency
# control) per kernel family. Read at launch, so at CUDA-graph capture. Measured on the H100:
# "decode" (the LM step; benchmarks/decode_launch.py): a batch-1 step 0.91 -> 0.81 ms, batch 16 1.00 -> 0.90;
# "flow" (the estimator; profile_stages.py --flow-pdl): off until it measures as a gain at both 1 and 16 streams.
PDL = {"decode": True, "flow": False}


def pdl_launch(x: torch.Tensor, family: str) -> dict:
    """The `PDL` constexpr and launch option of a kernel of `family` (a key of PDL) working on x's device."""
    if not (PDL[family] and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9):
        return {"PDL": False}
    from cosystream.kernels._launch_jit import HAS_GDC

    return {"PDL": True, "launch_pdl": True} if HAS_GDC else {"PDL": False}
