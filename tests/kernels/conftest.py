"""Kernel tests run the Triton kernels on the GPU when there is one, else in Triton's CPU interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # read when a kernel is first defined (cosystream.kernels.decode defines them lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="Triton is a dev dependency: pip install -e '.[dev]'")


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
