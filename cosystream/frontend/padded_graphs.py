"""CUDA graphs of a padded side-model call (the speech tokenizer): each call's device work in one launch.

The speech tokenizer runs through the ONNX interpreter (`onnx_torch.TorchOnnxGraph`) operator by operator: a few
hundred host-side operator calls a call on the released graphs, which bound its time on a GPU. In the padded batch
mode (`torch_prompt.BatchedGraph`) one call takes prompts of any lengths, zero-padded, with their lengths as the
graph's length input, so a call padded further, to a shape bucket (rows: a batch bucket of cuda_graphs.py; frames:
a multiple of GRAPH_FRAME_STEP), can be captured once and replayed with other features and lengths:

* the lengths go to a device buffer, so what the graph computes from them (its masks) is device work, in the
  graph; what stays on the host follows from the shapes alone (shape folding), fixed within a bucket;
* the host tensors a call sends to the device are copied once, before the capture (`onnx_torch.StaticUploads`),
  and the fold cache's device values the graph reads are held with it;
* a host synchronisation inside the call (a value read back, as a graph that sized a tensor by its lengths
  would need) fails the capture.

Self-check: once captured, each bucket replays a sample with other lengths and values than the capture's, and its
outputs must equal the interpreter's eager call on the same padded batch (the same kernels on the same shapes, so
bit-equal unless the capture missed an input). A failed capture or a differing replay switches the replays off
for good (logged) and every call runs eagerly, so a fault in the graphs never changes a token.

The buckets are captured when the analysis loads (`capture`), not on first use: a capture synchronises the device
and empties torch's allocator cache, which mid-traffic would stall the engine's work. Calls of shapes not captured
(more rows, or a padded batch past MAX_GRAPH_FRAMES) run eagerly. The graphs share one memory pool, one feature
buffer and one length buffer (the replays take turns: one analysis at a time).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cosystream.cuda_graphs import BATCH_BUCKETS, bucket
from cosystream.frontend.onnx_torch import StaticUploads
from cosystream.frontend.shape_folding import CallStats, FoldedShapes

if TYPE_CHECKING:
    from cosystream.frontend.torch_prompt import BatchedGraph

log = logging.getLogger(__name__)

GRAPH_FRAME_STEP = 100  # a call's padded length is a multiple of this many log-mel frames (1 s; 25 tokens)
# Rows x padded frames of the largest captured call: 16 prompts of 10 s, 4 of 30 s. Bounds the graphs' shared
# memory pool (the activations of the largest call) and the captures at load (120 shapes up to 16 rows of 30 s).
MAX_GRAPH_FRAMES = 16_000
CHECK_SEED = 20240738

Forward = Callable[[], torch.Tensor]
Capture = Callable[[Forward], Forward]  # the call over the static buffers -> its replay (same output tensor)


def padded_shape(prompts: int, longest: int, step: int = GRAPH_FRAME_STEP) -> tuple[int, int]:
    """(rows, frames) of the graphed call for `prompts` prompts of at most `longest` frames."""
    return bucket(prompts), -(-longest // step) * step


def capture_shapes(max_rows: int, max_frames: int, step: int = GRAPH_FRAME_STEP,
                   budget: int = MAX_GRAPH_FRAMES) -> list[tuple[int, int]]:
    """Every (rows, frames) a call of up to `max_rows` prompts of up to `max_frames` frames pads to, within
    `budget` padded frames; shortest first (a capture at load that fails stops before the costly ones)."""
    rows_max, frames_max = padded_shape(max_rows, max_frames, step)
    rows = [b for b in BATCH_BUCKETS if b <= rows_max]
    return [(r, f) for f in range(step, frames_max + 1, step) for r in rows if r * f <= budget]


@dataclass
class _Replay:
    run: Forward
    folded: FoldedShapes | None  # the fold cache's values of this shape, which the graph reads: held here


class PaddedGraphs:
    """Captured calls of a padded `BatchedGraph` (with a length input), one per shape bucket.

    `capture` makes a replayable call from the call over the static buffers (default: a CUDA graph); tests pass a
    stand-in, so the bucketing, the self-check and the fallback run on the CPU too. `disabled` says why the
    replays are off for good (None while on).
    """

    def __init__(self, batched: BatchedGraph, channels: int, capture: Capture | None = None,
                 step: int = GRAPH_FRAME_STEP, budget: int = MAX_GRAPH_FRAMES) -> None:
        if batched.length_name is None or batched.frames_per_output is None:
            raise ValueError(f"{batched.graph.path.name}: only a padded graph with a length input can be captured")
        self.batched, self.graph, self.channels = batched, batched.graph, channels
        self.step, self.budget = step, budget
        device, dtype = self.graph.ctx.device, self.graph.ctx.dtype
        self.device = device
        self.ctx = StaticUploads(device, dtype)
        self.capture_fn = capture if capture is not None else self._cuda_capture
        self.replays: dict[tuple[int, int], _Replay] = {}
        self.disabled: str | None = None
        self.replayed = 0  # calls served by a replay
        self._features = torch.zeros(budget * channels, device=device, dtype=dtype)
        self._lengths = torch.zeros(max(BATCH_BUCKETS), device=device, dtype=batched.length_dtype)
        self._pool = None
        self._stream = None

    # ------------------------------------------------------------------------------------------- running
    def run(self, features: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """Per-prompt features [C, T_i] -> each prompt's output row, padded (the caller keeps its own outputs), from
        the replay of their bucket; None when this call runs eagerly (no graph of its shape, or the replays off)."""
        if self.disabled is not None or not features:
            return None
        key = padded_shape(len(features), max(f.shape[-1] for f in features), self.step)
        replay = self.replays.get(key)
        if replay is None:
            return None
        out = self._replay(replay, key, features)
        self.replayed += 1
        self.graph.stats = CallStats(replayed=True)
        return list(out[: len(features)].clone().unbind(0))  # the graph's output is rewritten by its next replay

    def _replay(self, replay: _Replay, key: tuple[int, int], features: Sequence[torch.Tensor]) -> torch.Tensor:
        self._fill(key, features)
        return replay.run()

    def _buffers(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        rows, frames = key
        feats = self._features[: rows * self.channels * frames].view(rows, self.channels, frames)
        assert self.batched.length_name is not None
        return {self.batched.feature_name: feats, self.batched.length_name: self._lengths[:rows]}

    def _fill(self, key: tuple[int, int], features: Sequence[torch.Tensor]) -> None:
        """The static buffers of `key` hold `features`, zero-padded; filler rows: zeros of the full length."""
        rows, frames = key
        buffers = self._buffers(key)
        feats = buffers[self.batched.feature_name]
        feats.zero_()
        for row, f in enumerate(features):
            feats[row, :, : f.shape[-1]] = f
        lengths = torch.tensor([f.shape[-1] for f in features] + [frames] * (rows - len(features)),
                               dtype=self.batched.length_dtype)
        if self.device.type == "cuda":
            lengths = lengths.pin_memory()  # copied without waiting for the device
        assert self.batched.length_name is not None
        buffers[self.batched.length_name].copy_(lengths, non_blocking=True)

    # ------------------------------------------------------------------------------------------- capturing
    def capture(self, shapes: Sequence[tuple[int, int]]) -> int:
        """Capture and self-check each shape in turn; the first failure switches the replays off for good (and
        stops). Returns how many shapes replay."""
        for key in shapes:
            if self.disabled is not None:
                break
            if key in self.replays:
                continue
            rows, frames = key
            if rows > max(BATCH_BUCKETS) or rows * frames > self.budget:
                raise ValueError(f"shape {key} is past the graphs' buffers")
            try:
                replay = self._capture_one(key)
                mismatch = self.self_check(key, replay)
            except Exception as exc:  # noqa: BLE001 (a capture refused: a host sync, an upload, out of memory)
                mismatch = f"capturing {rows} x {frames} frames failed: {exc!r}"
            if mismatch is not None:
                self.switch_off(mismatch)
            else:
                self.replays[key] = replay
        return len(self.replays)

    def switch_off(self, why: str) -> None:
        self.disabled = why
        self.replays.clear()
        log.warning("%s: CUDA-graph replays off, every call runs operator by operator: %s",
                    self.graph.path.name, why)

    def _capture_one(self, key: tuple[int, int]) -> _Replay:
        rows, frames = key
        gen = torch.Generator().manual_seed(CHECK_SEED + rows * 7919 + frames)
        self._fill(key, [torch.randn(self.channels, frames, generator=gen).to(self.device) for _ in range(rows)])
        inputs = self._buffers(key)
        output = self.batched.output_name

        def forward() -> torch.Tensor:
            return self.graph(inputs, ctx=self.ctx)[output]

        run = self.capture_fn(forward)
        return _Replay(run, self.graph.folded_for(inputs))

    def self_check(self, key: tuple[int, int], replay: _Replay) -> str | None:
        """Replay a sample of other lengths (each row shorter than the capture's, distinct) and values than the
        capture's; None if each prompt's outputs equal the eager call's on the same padded batch, else why not."""
        rows, frames = key
        gen = torch.Generator().manual_seed(CHECK_SEED - rows * 7919 - frames)
        lengths = sorted((frames - 1 - (17 * r + 5) % (self.step - 1) for r in range(rows)), reverse=True)
        lengths = [max(n, 1) for n in lengths]
        features = [torch.randn(self.channels, n, generator=gen).to(self.device) for n in lengths]
        got = self._replay(replay, key, features).clone()
        batch = torch.zeros(rows, self.channels, frames, device=self.device)
        for row, f in enumerate(features):
            batch[row, :, : f.shape[-1]] = f
        want = self.batched.call_eager(batch, lengths)
        if got.shape[0] != rows or len(want) != rows:
            return f"{rows} x {frames} frames: {got.shape[0]} replayed rows, {len(want)} eager rows"
        for row, n in enumerate(lengths):
            count = self.batched.outputs_for(n)
            if not torch.equal(got[row][:count].cpu(), want[row][:count].cpu()):
                return (f"{rows} x {frames} frames, row {row} ({n} frames): the replay's outputs differ from the "
                        f"eager call's")
        return None

    def _cuda_capture(self, forward: Forward) -> Forward:
        """A warm-up call (shape folding, the host copies, kernel choices) on a side stream, then the capture on a
        stream of its own, one capture at a time in the process (cuda_graphs.py)."""
        from cosystream.cuda_graphs import CAPTURE_LOCK, capture_stream, capturing

        with CAPTURE_LOCK:
            if self._stream is None:
                self._stream = capture_stream(self.device)
            caller = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(caller)
            with torch.cuda.stream(side):
                forward()
            caller.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            self.ctx.capturing = True
            try:
                with capturing(graph, self._pool, self._stream):
                    out = forward()
            finally:
                self.ctx.capturing = False
            self._pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay
