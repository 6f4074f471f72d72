"""What every CUDA-graph user in the package shares, below the layers that capture graphs (the engine's runners
and the frontend's CAM++ network): one capture at a time in the process, the batch buckets graphs are keyed by,
and a capture stream of one's own (engine/graphs.py says why each subsystem captures on its own stream)."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

CAPTURE_LOCK = threading.RLock()  # one graph capture at a time in the process (engine thread, worker, frontend)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def bucket(n: int, buckets: Sequence[int] = BATCH_BUCKETS) -> int:
    """Smallest bucket >= n (n itself beyond the largest bucket)."""
    return next((b for b in buckets if b >= n), n)


def capture_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A stream of its own to capture one subsystem's graphs on (None on the CPU)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream | None) -> Iterator[None]:
    """`torch.cuda.graph` as every subsystem captures (errors checked in the capturing thread only: the engine's
    other threads may call CUDA meanwhile), with Python's cyclic garbage collector held off until the capture
    ends. torch does not collect before a capture, and a collection inside it can free a CUDA graph left in a
    reference cycle, whose teardown a running capture refuses: the capture would fail ("operation not permitted
    when stream is capturing (function reset)")."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            yield
    finally:
        if enabled:
            gc.enable()
