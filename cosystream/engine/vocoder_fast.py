"""HiFT's Snake activations as one fused op each, applied from outside (`models.hift` stays plain PyTorch).

The module's statement, x + 1/(α + ε) · sin(xα)², is seven launches; `cosystream.kernels.vocoder.snake` is
one, rounding every intermediate as the statement rounds it (`cosystream.kernels.reference.snake` is the
same op as torch statements). `accelerate` replaces each Snake's `forward` on the instance, in gpt-fast's
manner; `restore` puts the module's own back.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import nn

from cosystream.models.hift import SNAKE_EPS, Snake


def accelerate(hift: nn.Module, ops: ModuleType) -> None:
    """Run every Snake of `hift` through `ops.snake`."""
    for module in hift.modules():
        if isinstance(module, Snake):
            module.forward = functools.partial(_snake, module, ops)  # type: ignore[method-assign]


def restore(hift: nn.Module) -> None:
    """Every Snake's own statement again (a no-op where `accelerate` did not run)."""
    for module in hift.modules():
        if isinstance(module, Snake):
            module.__dict__.pop("forward", None)


def _snake(module: Snake, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
    return ops.snake(x, module.alpha, SNAKE_EPS)
