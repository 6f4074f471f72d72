"""CAM++ (3D-Speaker's CAMPPlus, CosyVoice's `campplus.onnx`) as a hand-written torch network, batched over prompts
of any lengths in one call.

The op-by-op ONNX interpreter (`onnx_torch.TorchOnnxGraph`) runs about a thousand host-side operator calls per
CAM++ call, and the graph has no length input, so prompts of distinct lengths need one call each. This module
runs the same network with the graph's own weights (read by `campplus_graph.read_campplus`, never by name):

* **Batching**: the prompts are right-padded into one batch with their lengths. Every convolution with a
  temporal extent reads zeros past a prompt's end, as the unbatched one reads its zero padding (a mask is
  applied in the same kernel as the ReLU before it); the TDNN's stride halves the lengths (ceil), and the mask
  follows. The context of each CAM layer (the prompt's mean plus the mean of each frame's 100-frame segment,
  the last segment averaging only its own frames, as the official `avg_pool1d(ceil_mode=True)` does) and the
  statistics pooling (mean and unbiased standard deviation) count only a prompt's own frames. So each prompt's
  embedding is the one it gets alone, up to float rounding. The context gate is computed once per segment (it
  is constant over a segment's frames) and expanded to the frames; the official layer computes it per frame,
  with the same values.
* **Self-check** (`load_fast_campplus`): the module and the interpreter run the same deterministic inputs on the
  analysis device; the module is used only if it agrees within the x-vector tolerance, so a released file
  whose graph computes something this module does not (an operator between the parameters that differs) keeps
  the interpreter.

A burst whose padded batch would pass MAX_BATCH_FRAMES runs in several calls (longest prompts together). With
`cuda_graphs`, calls are padded to shape buckets and each bucket's call is captured once as a CUDA graph and
replayed (the full-size network makes about 730 operator calls a call, views aside, each one kernel launch or
more on a GPU).

Past 400 lines with its CUDA-graph calls (`_GraphedCalls`), which are this network's alone and read with it.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from cosystream.frontend.campplus_graph import (
    CamLayer,
    CamWeights,
    Conv,
    DenseBlock,
    NotCamPlusPlus,
    ResBlock,
    read_campplus,
)
from cosystream.frontend.onnx_torch import TorchOnnxGraph
from cosystream.transfers import to_device

log = logging.getLogger(__name__)

SEGMENT_FRAMES = 100  # CAM layers' context: means over segments of 100 frames (after the TDNN's stride)
# the x-vector tolerance of the project's parity tests (tests/frontend/test_speaker.py): |a - b| <= atol + rtol|b|
XVECTOR_ATOL = 1e-4
XVECTOR_RTOL = 1e-4
# Self-check input lengths (fbank frames): odd and even, after the stride 49 (one short segment), 125 (a
# 25-frame tail), 200 (two full segments) and 207 (a 7-frame tail): every masked path of the batch.
CHECK_FRAMES = (413, 250, 97, 400)
CHECK_SEED = 20240638
# Padded frames (prompts x longest frame count) of one call. Each of the FCM head's activations (a few alive at
# once) takes 10 KiB a frame in the full-size model (32 channels x 80 bins, float32): about 160 MiB at this bound,
# which 16 prompts of 10 s reach; a burst of longer prompts runs in several calls.
MAX_BATCH_FRAMES = 16_000
# With CUDA graphs (on CUDA), a call pads its prompts to a multiple of this many fbank frames (1 s) and its
# rows to a batch bucket (cuda_graphs.py), so one captured graph serves every batch in its bucket; padding changes
# no result (the masks), only the device's work.
GRAPH_FRAME_STEP = 100
MAX_GRAPHS = 160  # captured shapes at most (capture_buckets' 120 for 30 s and 16 rows fit); others run eagerly


class CamPlusPlus:
    """The released CAM++ network with a graph's weights: fbank [B, bins, T] + lengths -> embeddings [B, E].

    Build it with `from_graph`. Apart from its captured CUDA graphs it keeps nothing between calls; one caller at
    a time (the graphs share their buffers).
    """

    def __init__(self, weights: CamWeights, device: torch.device, dtype: torch.dtype,
                 cuda_graphs: bool | None = None) -> None:
        self.device, self.dtype, self.bins = device, dtype, weights.bins
        place = self._place
        self.head_conv1, self.head_conv2 = place(weights.head_conv1), place(weights.head_conv2)
        self.res_blocks = [ResBlock(place(b.conv1), place(b.conv2), place(b.shortcut) if b.shortcut else None)
                           for b in weights.res_blocks]
        self.tdnn = place(weights.tdnn)
        self.blocks = [self._place_block(b) for b in weights.blocks]
        self.embedding_weight = self._tensor(weights.embedding_weight)
        self.embedding_bias = self._tensor(weights.embedding_bias)
        self.embedding_size = self.embedding_weight.shape[0]
        self._zero = torch.zeros((), device=device, dtype=dtype)
        # on CUDA, calls padded to shape buckets, each bucket's call captured once as a CUDA graph and replayed: eager,
        # its ~1,000 small kernels a call are bound by their launches. `cuda_graphs` (None: on CUDA) pads the calls on
        # the CPU too, where they run eagerly (tests)
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self._graphs = _GraphedCalls(self.compute, device, dtype, self.bins) \
            if self.cuda_graphs and device.type == "cuda" else None

    @classmethod
    def from_graph(cls, graph: TorchOnnxGraph, cuda_graphs: bool | None = None) -> CamPlusPlus:
        """The network behind a CAM++ graph, on the graph's device and in its dtype; NotCamPlusPlus if the graph
        has another structure (`campplus_graph.read_campplus`)."""
        return cls(read_campplus(graph), graph.ctx.device, graph.ctx.dtype, cuda_graphs)

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, self.dtype).contiguous()

    def _place(self, conv: Conv) -> Conv:
        return Conv(self._tensor(conv.weight), self._tensor(conv.bias) if conv.bias is not None else None,
                     conv.stride, conv.padding, conv.dilation)

    def _place_block(self, block: DenseBlock) -> DenseBlock:
        t = self._tensor
        layers = [CamLayer(t(x.scale), t(x.shift), self._place(x.bottleneck), self._place(x.local),
                            t(x.context1_weight), t(x.context1_bias), t(x.context2_weight), t(x.context2_bias))
                  for x in block.layers]
        return DenseBlock(layers, t(block.transit_scale), t(block.transit_shift), self._place(block.transit))

    @property
    def summary(self) -> str:
        layers = [len(b.layers) for b in self.blocks]
        return (f"CAM++: FCM {self.head_conv1.weight.shape[0]} channels, TDNN {self.tdnn.weight.shape[0]}, "
                f"dense blocks {layers} (growth {self.blocks[0].layers[0].growth}), embedding {self.embedding_size}")

    # ------------------------------------------------------------------------------------------ running
    def embed(self, features: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per-prompt fbank [bins, T_i] (mean-normalised, as the graph's input transposed) -> embeddings [E] each:
        one batched call, or several where the padded batch would exceed MAX_BATCH_FRAMES (longest prompts
        together, so the padding stays short)."""
        results: list[torch.Tensor | None] = [None] * len(features)
        for group in batch_groups([f.shape[-1] for f in features], MAX_BATCH_FRAMES, self.padded_size):
            for i, row in zip(group, self._call([features[i] for i in group]).unbind(0), strict=True):
                results[i] = row
        return [r for r in results if r is not None]

    def capture_buckets(self, max_frames: int, max_rows: int) -> int:
        """Capture the graph of every bucket a call of up to `max_rows` prompts of up to `max_frames` frames may
        use (within MAX_BATCH_FRAMES), so that none is captured mid-traffic (a capture synchronises the device and
        empties torch's allocator cache); returns how many were captured. Nothing without CUDA graphs."""
        if self._graphs is None:
            return 0
        from cosystream.cuda_graphs import BATCH_BUCKETS

        before = len(self._graphs.graphs)
        longest = self.padded_size(1, max_frames)[1]
        for rows in (b for b in BATCH_BUCKETS if b <= self.padded_size(max_rows, 1)[0]):
            for frames in range(GRAPH_FRAME_STEP, longest + 1, GRAPH_FRAME_STEP):
                if rows * frames <= MAX_BATCH_FRAMES:
                    self._call([torch.zeros(self.bins, frames, device=self.device, dtype=self.dtype)] * rows)
        return len(self._graphs.graphs) - before

    def padded_size(self, prompts: int, longest: int) -> tuple[int, int]:
        """(rows, frames) of the call for `prompts` prompts of at most `longest` frames."""
        if not self.cuda_graphs:
            return prompts, longest
        from cosystream.cuda_graphs import bucket

        return bucket(prompts), -(-longest // GRAPH_FRAME_STEP) * GRAPH_FRAME_STEP

    def _call(self, features: Sequence[torch.Tensor]) -> torch.Tensor:
        count = len(features)
        lengths = [f.shape[-1] for f in features]
        rows, frames = self.padded_size(count, max(lengths))
        lengths += [frames] * (rows - count)  # filler rows: all frames, zeros (finite results, dropped)
        graphs = self._graphs if self._graphs is not None and self._graphs.takes(rows, frames) else None
        batch = graphs.features(rows, frames) if graphs is not None else torch.empty(
            rows, self.bins, frames, device=self.device, dtype=self.dtype)
        batch.zero_()
        for row, feats in enumerate(features):
            batch[row, :, : lengths[row]] = feats
        with torch.inference_mode():
            masks = self.masks(lengths, frames)
            if graphs is None:
                return self.compute(batch, *masks)[:count]
            return graphs.run((rows, frames), masks)[:count].clone()  # its buffer is rewritten by the next replay

    def forward(self, feats: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """feats [B, bins, T] (anything past each row's length is ignored) -> [B, E]."""
        with torch.inference_mode():
            masks = self.masks(lengths, feats.shape[-1])
            return self.compute(feats.to(self.device, self.dtype), *masks)

    def __call__(self, feats: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        return self.forward(feats, lengths)

    def masks(self, lengths: Sequence[int], frames: int) -> tuple[torch.Tensor, ...]:
        """The mask tensors `compute` takes for prompts of `lengths` in a batch of `frames`, on the device."""
        head = _Frames(lengths, frames)
        conv = self.tdnn
        dense = head.after_conv(conv.weight.shape[-1], conv.stride[0], conv.padding[0])
        return tuple(_send(t, self.device, self.dtype) for t in (*head.edge_masks(), *dense.all_masks()))

    def compute(self, feats: torch.Tensor, head_keep: torch.Tensor, head_cap: torch.Tensor, keep: torch.Tensor,
                cap: torch.Tensor, count: torch.Tensor, segment_of_frame: torch.Tensor,
                context_weights: torch.Tensor) -> torch.Tensor:
        """The network on a padded batch and its masks (`masks`): device work alone, no host synchronisation (so
        it can be captured in a CUDA graph)."""
        dense = _Masks(keep, cap, count, segment_of_frame, context_weights)
        x = self._head(feats, head_keep, head_cap)
        x = self._relu_masked(_conv(x, self.tdnn), cap)
        for block in self.blocks:
            x = self._dense_block(x, block, dense)
        return self._pool_and_embed(x, dense)

    def _relu_masked(self, x: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
        """ReLU, and zero past each prompt's end, in one kernel: clamp to [0, cap] with cap inf or 0 per frame."""
        return x.clamp_(self._zero, cap)

    def _head(self, feats: torch.Tensor, keep: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
        cap = cap[:, None]  # [B, 1, 1, T]
        x = feats[:, None] * keep[:, None]
        x = self._relu_masked(_conv(x, self.head_conv1), cap)
        for block in self.res_blocks:
            out = self._relu_masked(_conv(x, block.conv1), cap)
            out = _conv(out, block.conv2)
            out += _conv(x, block.shortcut) if block.shortcut is not None else x
            x = self._relu_masked(out, cap)
        x = self._relu_masked(_conv(x, self.head_conv2), cap)
        return x.reshape(x.shape[0], x.shape[1] * x.shape[2], x.shape[3])

    def _dense_block(self, x: torch.Tensor, block: DenseBlock, frames: _Masks) -> torch.Tensor:
        channels = x.shape[1]
        total = channels + sum(layer.growth for layer in block.layers)
        features = torch.empty(x.shape[0], total, x.shape[2], device=x.device, dtype=x.dtype)
        features[:, :channels] = x
        for layer in block.layers:
            out = features[:, channels: channels + layer.growth]
            self._cam_layer(features[:, :channels], layer, frames, out)
            channels += layer.growth
        h = torch.addcmul(block.transit_shift, features, block.transit_scale).relu_()
        out = _conv(h, block.transit)
        # the last transition carries the output batch norm (folded): its ReLU (and the mask the pooling needs)
        return self._relu_masked(out, frames.cap) if block is self.blocks[-1] else out

    def _cam_layer(self, x: torch.Tensor, layer: CamLayer, frames: _Masks, out: torch.Tensor) -> None:
        h = torch.addcmul(layer.shift, x, layer.scale).relu_()
        # masked: the local convolution reads zeros past the end, and the segment sums count real frames only
        h = self._relu_masked(_conv(h, layer.bottleneck), frames.cap)
        local = _conv(h, layer.local)
        sums = F.avg_pool1d(h, SEGMENT_FRAMES, SEGMENT_FRAMES, ceil_mode=True)  # [B, C, S]
        context = torch.bmm(frames.context_weights, sums.transpose(1, 2))  # [B, S, C]: mean + segment mean
        gate = F.linear(context, layer.context1_weight, layer.context1_bias).relu_()
        gate = torch.sigmoid(F.linear(gate, layer.context2_weight, layer.context2_bias))  # [B, S, growth]
        per_frame = gate.index_select(1, frames.segment_of_frame).transpose(1, 2)  # [B, growth, T]
        torch.mul(local, per_frame, out=out)

    def _pool_and_embed(self, x: torch.Tensor, frames: _Masks) -> torch.Tensor:
        """Statistics pooling over each prompt's frames (x is zero past them): mean and unbiased std."""
        mean = x.sum(dim=-1) / frames.count
        centred = (x - mean[..., None]) * frames.keep
        std = torch.sqrt((centred * centred).sum(dim=-1) / (frames.count - 1))
        return F.linear(torch.cat([mean, std], dim=-1), self.embedding_weight, self.embedding_bias)


class _GraphedCalls:
    """`compute` captured as one CUDA graph per (rows, frames) bucket and replayed.

    The replays take turns (one analysis at a time), so every graph reads its features from one shared buffer of
    MAX_BATCH_FRAMES frames (a view of its shape) and allocates from one memory pool; each graph's masks are its
    own small static copies. Captures run on a stream of their own (engine/graphs.py says why), one at a time in
    the process (`CAPTURE_LOCK`).
    """

    def __init__(self, compute: Callable[..., torch.Tensor], device: torch.device, dtype: torch.dtype,
                 bins: int) -> None:
        from cosystream.cuda_graphs import capture_stream

        self.compute, self.device, self.bins = compute, device, bins
        self.shared = torch.zeros(MAX_BATCH_FRAMES * bins, device=device, dtype=dtype)
        self.stream = capture_stream(device)
        self.pool = None
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor]] = {}

    def takes(self, rows: int, frames: int) -> bool:
        """Whether a call of this shape replays a graph (captured or to capture); else it runs eagerly."""
        return rows * frames <= MAX_BATCH_FRAMES and ((rows, frames) in self.graphs or len(self.graphs) < MAX_GRAPHS)

    def features(self, rows: int, frames: int) -> torch.Tensor:
        """The shared feature buffer as [rows, bins, frames]: fill it, then `run`."""
        return self.shared[: rows * self.bins * frames].view(rows, self.bins, frames)

    def run(self, key: tuple[int, int], masks: Sequence[torch.Tensor]) -> torch.Tensor:
        if key not in self.graphs:
            self.graphs[key] = self._capture(key, masks)
        graph, static, out = self.graphs[key]
        for buffer, mask in zip(static, masks, strict=True):
            buffer.copy_(mask)
        graph.replay()
        return out

    def _capture(self, key: tuple[int, int], masks: Sequence[torch.Tensor]
                 ) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor]:
        from cosystream.cuda_graphs import CAPTURE_LOCK, capturing

        with CAPTURE_LOCK:
            static = [m.clone() for m in masks]
            feats = self.features(*key)
            caller = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(caller)
            with torch.cuda.stream(side):
                self.compute(feats, *static)  # warm-up: kernel choices and allocator state outside the graph
            caller.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self.pool, self.stream):
                out = self.compute(feats, *static)
            self.pool = graph.pool()
            return graph, static, out


def batch_groups(lengths: Sequence[int], max_frames: int,
                 padded: Callable[[int, int], tuple[int, int]] = lambda n, t: (n, t)) -> list[list[int]]:
    """Indices of `lengths` in calls of at most `max_frames` padded frames (rows x frames of `padded(prompts,
    longest)`), longest first; a prompt too long for `max_frames` alone runs alone."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and math.prod(padded(len(groups[-1]) + 1, lengths[groups[-1][0]])) <= max_frames:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _conv(x: torch.Tensor, conv: Conv) -> torch.Tensor:
    fn = F.conv2d if conv.weight.ndim == 4 else F.conv1d
    return fn(x, conv.weight, conv.bias, stride=conv.stride, padding=conv.padding, dilation=conv.dilation)


class _Masks(NamedTuple):
    """A padded batch's masks at one frame rate, on the device."""

    keep: torch.Tensor  # [B, 1, T] 1.0 on each prompt's frames, 0.0 past them
    cap: torch.Tensor  # [B, 1, T] inf on each prompt's frames, 0 past them (the masked ReLU's upper bound)
    count: torch.Tensor  # [B, 1] frames per prompt
    segment_of_frame: torch.Tensor  # [T] the 100-frame segment of each frame
    context_weights: torch.Tensor  # [B, S, S] pooled segment sums -> each prompt's context (_context_weights)


class _Frames:
    """Per-prompt frame counts of a padded batch, and their masks built on the host (where the lengths are)."""

    def __init__(self, lengths: Sequence[int], frames: int) -> None:
        self.lengths, self.frames = list(lengths), frames
        if not self.lengths or max(self.lengths) > frames or min(self.lengths) < 1:
            raise ValueError(f"prompt lengths {self.lengths} do not fit a batch of {frames} frames")
        self.n = torch.tensor(self.lengths)
        self.keep = torch.arange(frames)[None, :] < self.n[:, None]  # [B, T]

    def edge_masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """keep and cap, [B, 1, T]: what convolutions with a temporal extent need."""
        return self.keep.float()[:, None], torch.where(self.keep, math.inf, 0.0)[:, None]

    def all_masks(self) -> tuple[torch.Tensor, ...]:
        """The fields of _Masks, on the host."""
        segments = -(-self.frames // SEGMENT_FRAMES)
        return (*self.edge_masks(), self.n.float()[:, None], torch.arange(self.frames) // SEGMENT_FRAMES,
                _context_weights(self.n, self.frames, segments))

    def after_conv(self, kernel: int, stride: int, padding: int) -> _Frames:
        """The frames after a convolution: each prompt keeps the frames its unbatched convolution outputs."""
        out = [(n + 2 * padding - kernel) // stride + 1 for n in self.lengths]
        return _Frames(out, (self.frames + 2 * padding - kernel) // stride + 1)


def _send(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor on the device (floats in `dtype`), without waiting for the device's queued work."""
    return to_device(t, device, dtype if t.dtype.is_floating_point else None)


def _context_weights(lengths: torch.Tensor, frames: int, segments: int) -> torch.Tensor:
    """[B, S, S] weights W with context[b, s] = sum_s' W[b, s, s'] pooled[b, s']: from `avg_pool1d(ceil_mode=True)`
    over the batch's padded length (whose last window divides by the frames left in the batch, and whose sums see
    zeros past each prompt), the prompt's mean over its own frames plus the mean of segment s over its own frames
    (zero for segments past the prompt's end)."""
    starts = torch.arange(segments) * SEGMENT_FRAMES
    pooled_count = (torch.clamp(frames - starts, max=SEGMENT_FRAMES)).double()  # [S]: the pool's divisors
    own = torch.clamp(lengths[:, None] - starts[None, :], 0, SEGMENT_FRAMES).double()  # [B, S] real frames
    mean_part = pooled_count[None, None, :] / lengths.double()[:, None, None]  # [B, 1, S']
    segment_part = torch.where(own > 0, pooled_count[None, :] / own.clamp(min=1), torch.zeros(()))  # [B, S]
    return mean_part.expand(-1, segments, -1) + torch.diag_embed(segment_part)


# ---------------------------------------------------------------------------------------------- choosing it
def self_check(module: CamPlusPlus, graph: TorchOnnxGraph) -> str | None:
    """Run the module (one batch) and the graph (one prompt per call) on deterministic fbank-like inputs of
    CHECK_FRAMES lengths; None if every embedding agrees within the x-vector tolerance, else why not."""
    gen = torch.Generator().manual_seed(CHECK_SEED)
    feats = [2.0 * torch.randn(module.bins, t, generator=gen) for t in CHECK_FRAMES]
    device, dtype = graph.ctx.device, graph.ctx.dtype
    want = []
    for f in feats:
        out = graph({graph.input_names[0]: f.T[None].to(device, dtype)})[graph.output_names[0]]
        want.append(out.reshape(-1).to("cpu", torch.float32))
    got = [g.to("cpu", torch.float32) for g in module.embed([f.to(device, dtype) for f in feats])]
    for frames, a, b in zip(CHECK_FRAMES, got, want, strict=True):
        if a.shape != b.shape:
            return f"{frames} frames: {a.numel()} embedding values against the graph's {b.numel()}"
        excess = (a - b).abs() - (XVECTOR_ATOL + XVECTOR_RTOL * b.abs())
        if not bool(torch.isfinite(a).all()) or float(excess.max()) > 0:
            return (f"{frames} frames: the embedding differs from the graph's by up to "
                    f"{float((a - b).abs().max()):.3g} (tolerance {XVECTOR_ATOL:g} + {XVECTOR_RTOL:g}|x|)")
    return None


def load_fast_campplus(graph: TorchOnnxGraph, cuda_graphs: bool | None = None
                       ) -> tuple[CamPlusPlus | None, str | None]:
    """(the module, None) when the graph is the released CAM++ architecture and the module reproduces it on the
    graph's device (on CUDA through its graphed calls), else (None, why not). Float32 only: the
    analysis dtype, which the tolerance is for."""
    name = graph.path.name
    if graph.ctx.dtype != torch.float32:
        return None, f"{name}: the batched CAM++ module runs in float32 only (analysis dtype {graph.ctx.dtype})"
    # A fast path never stops the analysis from loading: whatever fails here leaves the interpreter in charge.
    try:
        module = CamPlusPlus.from_graph(graph, cuda_graphs)
    except Exception as exc:  # noqa: BLE001 (NotCamPlusPlus, or a graph the reader did not foresee)
        reason = str(exc) if isinstance(exc, NotCamPlusPlus) else f"reading it failed: {exc!r}"
        log.warning("%s: not the released CAM++ architecture (%s); CAM++ stays on the ONNX interpreter", name,
                    reason)
        return None, f"{name}: not the CAM++ architecture: {reason}"
    try:
        mismatch = self_check(module, graph)
    except Exception as exc:  # noqa: BLE001 (out of memory, a graph the interpreter cannot run on these inputs)
        mismatch = f"the self-check failed to run: {exc!r}"
    if mismatch is not None:
        log.warning("%s: the batched CAM++ module does not reproduce the graph (%s); CAM++ stays on the ONNX "
                    "interpreter", name, mismatch)
        return None, f"{name}: the batched CAM++ module does not reproduce the graph: {mismatch}"
    log.info("%s: %s, batched across prompt lengths", name, module.summary)
    return module, None
