"""Build a module's structure without drawing its initial weights (they are replaced by the checkpoint's).

Under `torch.device("meta")` torch still runs every `reset_parameters`; on meta tensors the random fills go
through torch's Python decompositions, whose first use imports torch._dynamo and, through it, Triton. A CPU-only
process would load a GPU compiler for nothing (seconds of import, and libtriton's nanobind leak report at
exit). With the `torch.nn.init` fills made no-ops while the module is built, neither is imported.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_FILLS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
          "trunc_normal_", "zeros_", "ones_", "constant_", "orthogonal_")


def _keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


@contextmanager
def weights_left_uninitialized() -> Iterator[None]:
    """Within: the `torch.nn.init` fills return their tensor untouched (single-threaded model building only)."""
    saved = {name: getattr(torch.nn.init, name) for name in _FILLS if hasattr(torch.nn.init, name)}
    try:
        for name in saved:
            setattr(torch.nn.init, name, _keep)
        yield
    finally:
        for name, fill in saved.items():
            setattr(torch.nn.init, name, fill)
