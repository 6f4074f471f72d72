"""Weights pulled into L2 ahead of the kernels that read them, on a branch beside the kernel chain.

PERF: the LM decode step is a chain of ~200 kernels, and its linears start by fetching their weights from
HBM. With every layer reading one layer's weights (L2-resident; `profile_stages.py --shared-weights`) a
batch-1 step takes 0.682 ms instead of 0.842 on the H100: that gap is what fetching from HBM costs the
chain. Here a small kernel on a second stream asks the copy engine to bring the next weights into L2
(`cp.async.bulk.prefetch.L2`, nothing waits for it) while the chain works on the weights before them. The
side stream forks from the chain before each linear and joins it at the end of the step, so in a CUDA graph
the prefetches are parallel nodes off the critical path. The prefetches are not issued inside the chain's
kernels: a kernel does not retire while its prefetches are in flight, which makes the chain slower.

`WINDOW_MB` is how far ahead the weights are fetched, in bytes of the weights that follow the linear about to
run (0: off). Read when a step is traced, so set it before graphs are captured.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

# Decode step ms on the H100 at batch 1 / 4 / 16 (benchmarks/decode_launch.py --prefetch-mb, retired in f313fec:
# `git show f313fec^:benchmarks/decode_launch.py`): off 0.705 /
# 0.742 / 0.807; 4 MB 0.645 / 0.672 / 0.767; 8 MB 0.645 / 0.672 / 0.765; 16 MB 0.649 / 0.670 / 0.765;
# 24 MB 0.662 / 0.708 / 0.849 (the L2 then holds too much not yet read); every layer on one layer's
# L2-resident weights 0.573 / 0.625 / 0.734. 8 MB is in the flat optimum.
WINDOW_MB = 8.0
# Decode steps of more rows than this run without it (LMRunner): at batch 16 the step gains little in
# isolation (0.807 -> 0.765 ms), and in the engine at 16 streams, beside the token-to-wave worker, the
# prefetch lowers the aggregate real-time factor and raises first-audio p90 over HTTP (docs/benchmarks.md);
# at one stream it takes first audio from 51-52 to 49-50 ms.
MAX_ROWS = 8
PROGRAMS = 8  # programs of one prefetch kernel: each issues its share of the bulk prefetches
LANES = 128  # bulk prefetches per program and tensor

_active = threading.local()


class _Plan:
    """Weights in the order a step reads them, and which of them a fork has already asked for."""

    def __init__(self, weights: Sequence[torch.Tensor], window_bytes: float,
                 launch: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        self.weights = list(weights)
        self.index = {w.data_ptr(): i for i, w in enumerate(self.weights)}
        self.window = window_bytes
        self.next = 0  # weights [0, next) have been asked for
        self.launch = launch or self._fork
        self.forked = False

    def ahead_of(self, position: int) -> None:
        """Ask for the weights after `position` (-1: from the first) that start within the window."""
        first = position + 1
        start = max(self.next, first)
        offset = sum(_nbytes(w) for w in self.weights[first:start])
        stop = start
        while stop < len(self.weights) and (stop == first or offset < self.window):
            offset += _nbytes(self.weights[stop])
            stop += 1
        if stop > start:
            self.launch(self.weights[start:stop])
            self.next = stop

    def _fork(self, weights: list[torch.Tensor]) -> None:
        """The prefetch kernels on the side stream, after what the current stream has queued so far."""
        side = _side_stream(weights[0].device)
        side.wait_stream(torch.cuda.current_stream(weights[0].device))
        self.forked = True
        with torch.cuda.stream(side):
            for i in range(0, len(weights), 4):
                _prefetch(weights[i:i + 4])

    def join(self) -> None:
        if self.forked:
            device = self.weights[0].device
            torch.cuda.current_stream(device).wait_stream(_side_stream(device))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _side_stream(device: torch.device, purpose: str = "prefetch") -> torch.cuda.Stream:
    """This thread's side stream on `device` for `purpose`. One per thread: the engine thread (LM graphs)
    and the token-to-wave worker (flow) must not share one, or one thread's eager prefetch could land on a
    stream the other is capturing into a graph, and either's join would wait for the other's work."""
    streams = getattr(_active, "streams", None)
    if streams is None:
        streams = _active.streams = {}
    if (device, purpose) not in streams:
        streams[(device, purpose)] = torch.cuda.Stream(device)
    return streams[(device, purpose)]


def branch(device: torch.device) -> torch.cuda.Stream | None:
    """A stream for work beside the chain that the chain reads only later (not a prefetch: its own stream,
    so it never queues behind them), ordered after everything the current stream has queued; None off CUDA.
    Launch the work under `torch.cuda.stream(branch)` into
    memory allocated before, and make the current stream wait for the branch (`wait_stream`) before the
    kernel that reads it. In a CUDA graph the branch is a parallel node, off the critical path."""
    if device.type != "cuda":
        return None
    side = _side_stream(device, "branch")
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def usable(weights: Sequence[torch.Tensor], window_mb: float | None = None) -> bool:
    """Whether these weights can be prefetched here (a window > 0, default WINDOW_MB; a Hopper-or-newer GPU;
    contiguous 16-byte aligned and sized tensors, as the bulk prefetch needs)."""
    window_mb = WINDOW_MB if window_mb is None else window_mb
    if window_mb <= 0 or not weights or not weights[0].is_cuda:
        return False
    if torch.cuda.get_device_capability(weights[0].device)[0] < 9:
        return False
    return all(w.is_contiguous() and w.data_ptr() % 16 == 0 and _nbytes(w) % 16 == 0 for w in weights)


@contextlib.contextmanager
def prefetching(weights: Sequence[torch.Tensor], window_mb: float | None = None) -> Iterator[None]:
    """Within this block, every `before(weight)` of one of `weights` (listed in the order they are read)
    forks a prefetch of the ones after it; the branch joins the current stream at the end. window_mb:
    how far ahead (None: WINDOW_MB; 0: off)."""
    window_mb = WINDOW_MB if window_mb is None else window_mb
    if not usable(weights, window_mb) or getattr(_active, "plan", None) is not None:
        yield
        return
    plan = _Plan(weights, window_mb * 2**20)
    _active.plan = plan
    try:
        plan.ahead_of(-1)
        yield
    finally:
        _active.plan = None
        plan.join()


def before(weight: torch.Tensor) -> None:
    """Called by a kernel wrapper before it launches a kernel reading `weight`."""
    plan = getattr(_active, "plan", None)
    if plan is not None:
        position = plan.index.get(weight.data_ptr())
        if position is not None:
            plan.ahead_of(position)


def _prefetch(weights: list[torch.Tensor]) -> None:
    from cosystream.kernels._decode_jit import prefetch_l2_kernel

    padded = weights + [weights[0]] * (4 - len(weights))
    sizes = [_nbytes(w) for w in weights] + [0] * (4 - len(weights))
    args = [a for w, n in zip(padded, sizes, strict=True) for a in (w, n)]
    prefetch_l2_kernel[(PROGRAMS,)](*args, LANES=LANES, num_warps=4)
