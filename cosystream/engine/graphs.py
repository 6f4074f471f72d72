"""CUDA-graph capture and replay with static input buffers, shared by the runners.

A `GraphCache` maps a shape key to one captured graph of `fn(*static_inputs)`. `run(key, inputs)`
copies the inputs into that graph's static buffers, replays it, and returns its static outputs (valid
until the next replay of the same key). On the CPU, or when disabled, it simply calls `fn`.

Graphs that may replay at the same time (the LM's on the engine thread, token-to-wave's on its worker)
must be captured on different streams: cuBLAS picks its workspace by (handle, stream) at capture time
and bakes it into the graph, so two graphs captured on one stream share one workspace, and two split-K
GEMMs replaying concurrently corrupt each other's partial sums and semaphores (at 16 overlapped streams
the engine hangs). Captures themselves take turns (`CAPTURE_LOCK`): since streams open
ahead of their first chunk, the worker may capture a new flow shape while the engine thread captures a
new prefill shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence

import torch

from cosystream.cuda_graphs import CAPTURE_LOCK, capturing

log = logging.getLogger("cosystream.engine")

# Most streams in one replay of a token-to-wave graph whose batch the flow slots do not bound (official
# final passes and their vocoder calls: a stream gives its slot back when only its final pass is left,
# so dozens may wait for one): warm-up captures every bucket up to it, so no batch captures mid-traffic
# (≈ 1.5 s of stalled worker on the H100 when a vocoder batch of 49 finals did).
REPLAY_ROWS = 32


def maybe_compile(fn: Callable, enabled: bool) -> Callable:
    """torch.compile with dynamic shapes (one compilation serves every bucket), or `fn` itself.

    PERF: the decode step, the estimator step and HiFT are chains of hundreds of tiny kernels; even
    inside a CUDA graph each costs a few microseconds, and inductor fuses the element-wise ones.
    """
    if not enabled:
        return fn
    return torch.compile(fn, dynamic=True, fullgraph=False)


class GraphCache:
    def __init__(self, fn: Callable[..., Sequence[torch.Tensor]], device: torch.device, enabled: bool = True,
                 max_graphs: int = 256, stream: torch.cuda.Stream | None = None) -> None:
        self.fn = fn
        self.device = device
        self.enabled = enabled and device.type == "cuda"
        self.max_graphs = max_graphs
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], Sequence[torch.Tensor]]] = {}
        self._pool = None
        self.stream = stream  # capture stream (None: torch's shared default capture stream)

    def run(self, key: Hashable, inputs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        if not self.enabled or (key not in self.graphs and len(self.graphs) >= self.max_graphs):
            return self.fn(*inputs)
        if key not in self.graphs:
            self.graphs[key] = self._capture(inputs)
        graph, static_in, static_out = self.graphs[key]
        for buf, x in zip(static_in, inputs, strict=True):
            buf.copy_(x)
        graph.replay()
        return static_out

    def _capture(self, inputs: Sequence[torch.Tensor]):
        with CAPTURE_LOCK:
            return self._capture_unlocked(inputs)

    def _capture_unlocked(self, inputs: Sequence[torch.Tensor]):
        static_in = [x.clone() for x in inputs]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.fn(*static_in)  # warm-up: kernel selection and allocator state outside the graph
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self._pool, self.stream):
            static_out = self.fn(*static_in)
        self._pool = graph.pool()
        return graph, static_in, static_out
