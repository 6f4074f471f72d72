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
# PERF (with PDL): a kernel loads what no kernel of the step writes before it ahead of its wait for the
# kernel before, so those loads (and the loads that depend on them) overlap that kernel: the decode
# attention its first block of cached keys/values (written by earlier steps), its position and RoPE terms;
# the norms their weight; the sampler its rows' state. Read when a step is traced. Measured on the H100
# (benchmarks/decode_launch.py, 53b2f5d, the attention's loads alone): batch-1 step 0.776 -> 0.737 ms,
# batch 16 0.840 -> 0.826. Loading the linears' first weight tile (or whole slab, with one-K-step tiles)
# before their wait was slower (0.807 / 0.769 at batch 1, 0.869 / 1.005 at 16): not kept.
EARLY_LOADS = True


def pdl_launch(x: torch.Tensor, early: bool | None = None) -> dict:
    """The `PDL` constexpr and launch option of a decode kernel working on x's device; for a kernel with
    an `EARLY` constexpr (early=True/False: whether its early loads are safe here), that too."""
    pdl = PDL and x.is_cuda and _pdl_capable(x.get_device())  # get_device: the CUDA index, never None
    options: dict = {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
    if early is not None:
        options["EARLY"] = bool(early and EARLY_LOADS and pdl)
    return options


@functools.cache
def _pdl_capable(device_index: int) -> bool:
    """Hopper or newer, and a Triton with grid dependency control."""
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    from cosystream.kernels._launch_jit import HAS_GDC

    return HAS_GDC
