"""Which device and dtype an engine runs on when the caller does not say, and a clear error for one that
this machine lacks (torch itself answers a CUDA request on a CPU-only build with a bare AssertionError)."""

from __future__ import annotations

from typing import Any

import torch

from cosystream.errors import CosyStreamError


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> str:
    return "bfloat16" if device.startswith("cuda") else "float32"


def check_device(device: str) -> None:
    """CosyStreamError naming what is missing when `device` cannot be used here."""
    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise CosyStreamError(f"device: {device!r} asked for, but torch {torch.__version__} ({build}) sees no CUDA "
                              "GPU; use device='cpu', or install a CUDA build of torch on a machine with a GPU")
    _, _, index = device.partition(":")
    if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        raise CosyStreamError(f"device: {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                              "cuda:0 to cuda:N-1")


def with_device_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Engine keywords with `device` (cuda when available, else cpu) and `dtype` (bfloat16 on cuda, float32 on
    cpu) filled in where absent, and the device checked."""
    device = kwargs.get("device") or default_device()
    check_device(device)
    return {**kwargs, "device": device, "dtype": kwargs.get("dtype") or default_dtype(device)}
