"""CAM++ (3D-Speaker's CAMPPlus, CosyVoice's `campplus.onnx`) as a hand-written torch network, batched over prompts
of any lengths in one call.

The op-by-op ONNX interpreter (`onnx_torch.TorchOnnxGraph`) runs about a thousand host-side operator calls per
CAM++ call, and the graph has no length input, so prompts of distinct lengths need one call each. This module
runs the same network with the graph's own weights:

* **Loading** reads the graph's parameter operators (Conv, BatchNormalization, Gemm, MatMul with constant
  weights) in topological order and matches them, by shape and attributes, against the released architecture
  (`cosystream/testing/realistic_side_models.py` documents it): the FCM head (2D convolutions over fbank bins and
  time, two layers of two residual blocks, frequency strided 8x), a strided TDNN layer, densely connected blocks
  of CAM layers, transition layers, statistics pooling and the embedding layer. Initializer names are never
  read (an exporter names them freely, `onnx::Conv_123` after it fused a batch norm into the convolution).
  A batch norm that directly follows a convolution (the convolution's only reader) is folded into it, as the
  exporter does; the other batch norms become a per-channel scale and shift. The layer counts, widths and
  dilations are read from the graph. A graph of another structure (the fixture sets' stand-ins) is refused
  with the reason (`NotCamPlusPlus`).
* **Batching**: the prompts are right-padded into one batch with their lengths. Every convolution with a
  temporal extent reads zeros past a prompt's end, as the unbatched one reads its zero padding (a mask is
  applied in the same kernel as the ReLU before it); the TDNN's stride halves the lengths (ceil), and the mask
  follows. The context of each CAM layer (the prompt's mean plus the mean of each frame's 100-frame segment,
  the last segment averaging only its own frames, as the official `avg_pool1d(ceil_mode=True)` does) and the
  statistics pooling (mean and unbiased standard deviation) count only a prompt's own frames. So each prompt's
  embedding is the one it gets alone, up to float rounding.
* **Self-check** (`load_fast_campplus`): the module and the interpreter run the same deterministic inputs on the
  analysis device; the module is used only if it agrees within the x-vector tolerance, so a released file
  whose graph computes something this module does not (an operator between the parameters that differs) keeps
  the interpreter.

The context gate is computed once per segment (it is constant over a segment's frames) and expanded to the
frames; the official layer computes it per frame, with the same values. A burst whose padded batch would pass
MAX_BATCH_FRAMES runs in several calls (longest prompts together). With `cuda_graphs`, calls are padded to
shape buckets and each bucket's call is captured once as a CUDA graph and replayed (the full-size network
makes about 730 operator calls a call, views aside, each one kernel launch or more on a GPU).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from cosystream.frontend.onnx_torch import TorchOnnxGraph, _Node

log = logging.getLogger(__name__)

SEGMENT_FRAMES = 100  # CAM layers' context: means over segments of 100 frames (after the TDNN's stride)
FCM_LAYERS = 2  # residual layers of the FCM head, each of FCM_BLOCKS blocks, the first strided over frequency
FCM_BLOCKS = 2
FCM_FREQUENCY_STRIDES = 3  # two strided layers and the final convolution: bins / 8
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
# With CUDA graphs (`cuda_graphs=True`), a call pads its prompts to a multiple of this many fbank frames (1 s) and its
# rows to a batch bucket (engine/graphs.py), so one captured graph serves every batch in its bucket; padding changes
# no result (the masks), only the device's work, which a launch-bound network has to spare.
GRAPH_FRAME_STEP = 100
MAX_GRAPHS = 160  # captured shapes at most (capture_buckets' 120 for 30 s and 16 rows fit); others run eagerly
# ops through which a batch norm may read the convolution it follows (a squeeze before a 2D batch norm)
_PASSTHROUGH_OPS = {"Identity", "Squeeze", "Unsqueeze", "Reshape", "Flatten"}


class NotCamPlusPlus(ValueError):
    """The ONNX graph is not the released CAM++ architecture (the message says where it differs)."""


# ---------------------------------------------------------------------------------------------- graph reading
@dataclass
class _Param:
    """A parameter operator of the graph: a convolution or linear layer (batch norm folded in where the exporter
    would have), or a standalone batch norm as `scale`/`shift`."""

    kind: str  # "conv", "linear" or "norm"
    index: int  # position among the graph's parameter operators (messages)
    output: str
    weight: torch.Tensor | None = None  # conv [O, I, k...], linear [O, I]
    bias: torch.Tensor | None = None
    strides: tuple[int, ...] = ()
    pads: tuple[int, ...] = ()
    dilations: tuple[int, ...] = ()
    scale: torch.Tensor | None = None  # norm: y = x * scale + shift, per channel
    shift: torch.Tensor | None = None

    def describe(self) -> str:
        if self.kind == "norm":
            assert self.scale is not None
            return f"parameter op {self.index}: BatchNormalization over {self.scale.numel()} channels"
        assert self.weight is not None
        extra = f", strides {list(self.strides)}" if self.strides and any(s != 1 for s in self.strides) else ""
        return f"parameter op {self.index}: {self.kind} {list(self.weight.shape)}{extra}"


def _norm_affine(scale: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """An eval batch norm as y = x * a + b (computed in float64, rounded once)."""
    a = scale.double() / torch.sqrt(var.double() + eps)
    return a, bias.double() - mean.double() * a


class _GraphReader:
    """The parameter operators of a TorchOnnxGraph, in order, with batch norms folded as the exporter folds them."""

    def __init__(self, graph: TorchOnnxGraph) -> None:
        self.graph = graph
        self.producer = {out: node for node in graph.nodes for out in node.outputs}
        self.readers: dict[str, int] = {}
        for node in graph.nodes:
            for name in node.inputs:
                self.readers[name] = self.readers.get(name, 0) + 1
        for name in graph.output_names:
            self.readers[name] = self.readers.get(name, 0) + 1

    def constant(self, name: str) -> torch.Tensor | None:
        """The constant behind a tensor name (initializer or Constant, through Identity), else None."""
        for _ in range(8):
            if name in self.graph.constants:
                return self.graph.constants[name].detach().to("cpu", torch.float64)
            node = self.producer.get(name)
            if node is None or node.op_type != "Identity":
                return None
            name = node.inputs[0]
        return None

    def params(self) -> list[_Param]:
        """The parameter operators in the graph's (topological) order, batch norms folded where they can be."""
        params: list[_Param] = []
        by_output: dict[str, _Param] = {}
        for node in self.graph.nodes:
            param = self._param(node, len(params))
            if param is None:
                continue
            if param.kind == "norm":
                target = self._folds_into(node, by_output)
                if target is not None:
                    _fold_norm(target, param)
                    by_output[param.output] = target
                    target.output = param.output
                    continue
            params.append(param)
            by_output[param.output] = param
        return params

    def _folds_into(self, norm_node: _Node, by_output: dict[str, _Param]) -> _Param | None:
        """The conv/linear whose output this batch norm alone reads (through reshapes), if any."""
        name = norm_node.inputs[0]
        for _ in range(4):
            if self.readers.get(name, 0) != 1:
                return None
            target = by_output.get(name)
            if target is not None:
                return target if target.kind in ("conv", "linear") else None
            node = self.producer.get(name)
            if node is None or node.op_type not in _PASSTHROUGH_OPS:
                return None
            name = node.inputs[0]
        return None

    def _param(self, node: _Node, index: int) -> _Param | None:
        op, ins = node.op_type, node.inputs
        if op == "Conv":
            weight = self.constant(ins[1])
            if weight is None:
                return None
            if node.attrs.get("group", 1) != 1:
                raise NotCamPlusPlus(f"parameter op {index}: a grouped convolution")
            if node.attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
                raise NotCamPlusPlus(f"parameter op {index}: a convolution with auto_pad")
            dims = weight.ndim - 2
            pads = tuple(node.attrs.get("pads", [0] * 2 * dims))
            if pads[:dims] != pads[dims:]:
                raise NotCamPlusPlus(f"parameter op {index}: asymmetric convolution padding {list(pads)}")
            bias = self.constant(ins[2]) if len(ins) > 2 and ins[2] else None
            return _Param("conv", index, node.outputs[0], weight, bias,
                          tuple(node.attrs.get("strides", [1] * dims)), pads[:dims],
                          tuple(node.attrs.get("dilations", [1] * dims)))
        if op == "BatchNormalization":
            values = [self.constant(name) for name in ins[1:5]]
            if any(v is None for v in values):
                return None
            scale, shift = _norm_affine(*values, float(node.attrs.get("epsilon", 1e-5)))  # type: ignore[arg-type]
            return _Param("norm", index, node.outputs[0], scale=scale, shift=shift)
        if op in ("Gemm", "MatMul"):
            return self._linear(node, index)
        return None

    def _linear(self, node: _Node, index: int) -> _Param | None:
        """A Gemm/MatMul with a constant weight, as weight [O, I] (+ bias)."""
        weight = self.constant(node.inputs[1])
        if weight is None or weight.ndim != 2 or self.constant(node.inputs[0]) is not None:
            return None
        if node.op_type == "MatMul":
            return _Param("linear", index, node.outputs[0], weight.T.contiguous())
        attrs = node.attrs
        if attrs.get("transA", 0):
            return None
        weight = weight * float(attrs.get("alpha", 1.0))
        weight = weight if attrs.get("transB", 0) else weight.T.contiguous()
        bias = self.constant(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
        if bias is not None:
            bias = (bias * float(attrs.get("beta", 1.0))).reshape(-1)
        return _Param("linear", index, node.outputs[0], weight, bias)


def _fold_norm(target: _Param, norm: _Param) -> None:
    """Fold a batch norm into the conv/linear it follows: W' = W a, b' = b a + shift."""
    assert target.weight is not None and norm.scale is not None and norm.shift is not None
    if target.weight.shape[0] != norm.scale.numel():
        raise NotCamPlusPlus(f"{norm.describe()} follows {target.describe()}: channel counts differ")
    shape = (-1,) + (1,) * (target.weight.ndim - 1)
    target.weight = target.weight * norm.scale.reshape(shape)
    bias = target.bias if target.bias is not None else torch.zeros_like(norm.scale)
    target.bias = bias * norm.scale + norm.shift


# ---------------------------------------------------------------------------------------------- the network
@dataclass
class _Conv:
    weight: torch.Tensor
    bias: torch.Tensor | None
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]


@dataclass
class _ResBlock:
    conv1: _Conv
    conv2: _Conv
    shortcut: _Conv | None


@dataclass
class _CamLayer:
    scale: torch.Tensor  # [1, C, 1] pre-activation batch norm
    shift: torch.Tensor
    bottleneck: _Conv  # 1x1, mid batch norm folded
    local: _Conv  # kernel k, dilated
    context1_weight: torch.Tensor  # [C'/2, C'] linear on the per-segment context
    context1_bias: torch.Tensor
    context2_weight: torch.Tensor  # [growth, C'/2]
    context2_bias: torch.Tensor

    @property
    def growth(self) -> int:
        return self.local.weight.shape[0]


@dataclass
class _Block:
    layers: list[_CamLayer]
    transit_scale: torch.Tensor
    transit_shift: torch.Tensor
    transit: _Conv


class _Cursor:
    def __init__(self, params: list[_Param]) -> None:
        self.params = params
        self.at = 0

    def peek(self, ahead: int = 0) -> _Param | None:
        i = self.at + ahead
        return self.params[i] if i < len(self.params) else None

    def take(self, what: str) -> _Param:
        param = self.peek()
        if param is None:
            raise NotCamPlusPlus(f"the graph ends where {what} was expected")
        self.at += 1
        return param


def _expect_conv(param: _Param, what: str, shape: tuple[int | None, ...], strides: tuple[int, ...] | None = None,
                 bias: bool | None = None) -> _Conv:
    """The conv `param` as a _Conv, after checking it has `shape` (None: any size) and attributes that keep the
    frame count (or halve it, with `strides`)."""
    if param.kind != "conv" or param.weight is None:
        raise NotCamPlusPlus(f"{what} expected, found {param.describe()}")
    got = tuple(param.weight.shape)
    if len(got) != len(shape) or any(w is not None and w != g for w, g in zip(shape, got, strict=True)):
        wanted = [s if s is not None else "*" for s in shape]
        raise NotCamPlusPlus(f"{what} of shape {wanted} expected, found {param.describe()}")
    kernel = got[2:]
    want_strides = strides if strides is not None else (1,) * len(kernel)
    if param.strides != want_strides:
        raise NotCamPlusPlus(f"{what} with strides {list(want_strides)} expected, found {param.describe()}")
    want_pads = tuple((k - 1) // 2 * d for k, d in zip(kernel, param.dilations, strict=True))
    if any(k % 2 == 0 for k in kernel) or param.pads != want_pads:
        raise NotCamPlusPlus(f"{what}: a centred odd kernel expected, found pads {list(param.pads)} for "
                             f"kernel {list(kernel)}")
    if bias is True and param.bias is None:
        raise NotCamPlusPlus(f"{what} with a batch norm (or bias) expected, found {param.describe()} without one")
    return _Conv(param.weight, param.bias, param.strides, param.pads, param.dilations)


def _expect_norm(param: _Param | None, channels: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if param is None or param.kind != "norm" or param.scale is None or param.shift is None:
        raise NotCamPlusPlus(f"{what} (a batch norm over {channels} channels) expected, found "
                             f"{param.describe() if param else 'the end of the graph'}")
    if param.scale.numel() != channels:
        raise NotCamPlusPlus(f"{what} over {channels} channels expected, found {param.describe()}")
    return param.scale.reshape(1, -1, 1), param.shift.reshape(1, -1, 1)


def _read_head(cur: _Cursor, bins: int) -> tuple[_Conv, list[_ResBlock], _Conv, int]:
    first = cur.take("the FCM head's first convolution")
    if first.weight is None or first.weight.ndim != 4:
        raise NotCamPlusPlus(f"the FCM head's first 2D convolution expected, found {first.describe()}")
    channels = first.weight.shape[0]
    conv1 = _expect_conv(first, "the FCM head's first convolution", (channels, 1, 3, 3), bias=True)
    square = (channels, channels, 3, 3)
    blocks = []
    for layer in range(FCM_LAYERS):
        for block in range(FCM_BLOCKS):
            what = f"FCM layer {layer + 1} block {block + 1}"
            if block == 0:  # strided over frequency, with a 1x1 shortcut; its three convolutions in any order
                group = [cur.take(what) for _ in range(3)]
                shortcut = [p for p in group if p.weight is not None and p.weight.shape[-1] == 1]
                convs = sorted((p for p in group if p not in shortcut), key=lambda p: p.strides != (2, 1))
                if len(shortcut) != 1:
                    raise NotCamPlusPlus(f"{what}: one 1x1 shortcut convolution expected, found "
                                         f"{[p.describe() for p in group]}")
                blocks.append(_ResBlock(_expect_conv(convs[0], f"{what} conv1", square, (2, 1), bias=True),
                                        _expect_conv(convs[1], f"{what} conv2", square, bias=True),
                                        _expect_conv(shortcut[0], f"{what} shortcut", (channels, channels, 1, 1),
                                                     (2, 1), bias=True)))
            else:
                blocks.append(_ResBlock(_expect_conv(cur.take(what), f"{what} conv1", square, bias=True),
                                        _expect_conv(cur.take(what), f"{what} conv2", square, bias=True), None))
    conv2 = _expect_conv(cur.take("the FCM head's last convolution"), "the FCM head's last convolution", square,
                         (2, 1), bias=True)
    for _ in range(FCM_FREQUENCY_STRIDES):
        bins = (bins - 1) // 2 + 1
    return conv1, blocks, conv2, channels * bins


def _read_cam_layer(cur: _Cursor, channels: int) -> _CamLayer:
    what = f"the CAM layer over {channels} channels"
    scale, shift = _expect_norm(cur.take(what), channels, f"{what}'s batch norm")
    bottle = cur.take(what)
    if bottle.weight is None:
        raise NotCamPlusPlus(f"{what}'s bottleneck convolution expected, found {bottle.describe()}")
    width = bottle.weight.shape[0]
    bottleneck = _expect_conv(bottle, f"{what}'s bottleneck", (width, channels, 1), bias=True)
    group = [cur.take(what) for _ in range(3)]  # the local convolution and the two context layers, in any order
    local = [p for p in group if p.kind == "conv" and p.weight is not None and p.weight.shape[-1] > 1]
    if len(local) != 1:
        raise NotCamPlusPlus(f"{what}: one local convolution with a temporal kernel expected among "
                             f"{[p.describe() for p in group]}")
    rest = [p for p in group if p is not local[0]]
    growth = local[0].weight.shape[0]  # type: ignore[union-attr]
    first = [p for p in rest if p.weight is not None and p.weight.shape[1] == width]
    second = [p for p in rest if p not in first]
    if len(first) != 1 or len(second) != 1:
        raise NotCamPlusPlus(f"{what}: two context layers expected among {[p.describe() for p in group]}")
    reduced = first[0].weight.shape[0]  # type: ignore[union-attr]
    context1 = _expect_conv(first[0], f"{what}'s first context layer", (reduced, width, 1))
    context2 = _expect_conv(second[0], f"{what}'s second context layer", (growth, reduced, 1))
    local_conv = _expect_conv(local[0], f"{what}'s local convolution", (growth, width, None))
    return _CamLayer(scale, shift, bottleneck, local_conv, context1.weight[..., 0], _bias_or_zero(context1),
                     context2.weight[..., 0], _bias_or_zero(context2))


def _bias_or_zero(conv: _Conv) -> torch.Tensor:
    return conv.bias if conv.bias is not None else torch.zeros(conv.weight.shape[0], dtype=conv.weight.dtype)


def _starts_cam_layer(cur: _Cursor, channels: int) -> bool:
    """A batch norm over `channels`, a 1x1 convolution from them, then a convolution reading its output (a CAM
    layer); a transition layer's 1x1 convolution is followed by a batch norm or the embedding instead."""
    norm, conv, after = cur.peek(), cur.peek(1), cur.peek(2)
    if norm is None or norm.kind != "norm" or conv is None or conv.weight is None or after is None:
        return False
    return (conv.kind == "conv" and conv.weight.shape[1] == channels and after.kind == "conv"
            and after.weight is not None and after.weight.shape[1] == conv.weight.shape[0])


def _read_blocks(cur: _Cursor, channels: int) -> tuple[list[_Block], int]:
    blocks: list[_Block] = []
    while _starts_cam_layer(cur, channels):
        layers = []
        while _starts_cam_layer(cur, channels):
            layers.append(_read_cam_layer(cur, channels))
            channels += layers[-1].growth
        what = f"dense block {len(blocks) + 1}'s transition layer"
        scale, shift = _expect_norm(cur.take(what), channels, what)
        param = cur.take(what)
        if param.weight is None:
            raise NotCamPlusPlus(f"{what}'s convolution expected, found {param.describe()}")
        transit = _expect_conv(param, what, (param.weight.shape[0], channels, 1))
        blocks.append(_Block(layers, scale, shift, transit))
        channels = transit.weight.shape[0]
    if not blocks:
        raise NotCamPlusPlus(f"a dense block of CAM layers over {channels} channels expected after the TDNN layer, "
                             f"found {cur.peek().describe() if cur.peek() else 'the end of the graph'}")
    last = blocks[-1].transit
    following = cur.peek()
    if last.bias is None and following is not None and following.kind == "norm":  # the output norm, not folded
        scale, shift = _expect_norm(cur.take("the output batch norm"), channels, "the output batch norm")
        last.weight, last.bias = last.weight * scale.reshape(-1, 1, 1), shift.reshape(-1)
    if last.bias is None:
        raise NotCamPlusPlus("the output batch norm after the last transition layer is missing")
    return blocks, channels


def _read_embedding(cur: _Cursor, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    param = cur.take("the embedding layer")
    if param.weight is None or param.weight.shape[1] != 2 * channels or param.weight.ndim not in (2, 3) or (
            param.weight.ndim == 3 and param.weight.shape[2] != 1):
        raise NotCamPlusPlus(f"the embedding layer over the {2 * channels} pooled statistics expected, found "
                             f"{param.describe()}")
    weight = param.weight.reshape(param.weight.shape[0], -1)
    bias = param.bias if param.bias is not None else torch.zeros(weight.shape[0], dtype=weight.dtype)
    norm = cur.peek()
    if norm is not None and norm.kind == "norm":  # the embedding's batch norm where the exporter did not fold it
        scale, shift = _expect_norm(cur.take("the embedding's batch norm"), weight.shape[0], "the embedding's norm")
        weight, bias = weight * scale.reshape(-1, 1), bias * scale.reshape(-1) + shift.reshape(-1)
    rest = cur.peek()
    if rest is not None:
        raise NotCamPlusPlus(f"nothing after the embedding layer expected, found {rest.describe()}")
    return weight, bias


class CamPlusPlus:
    """The released CAM++ network with a graph's weights: fbank [B, bins, T] + lengths -> embeddings [B, E].

    Build it with `from_graph`. It holds no state between calls.
    """

    def __init__(self, head: tuple[_Conv, list[_ResBlock], _Conv], tdnn: _Conv, blocks: list[_Block],
                 embedding: tuple[torch.Tensor, torch.Tensor], bins: int, device: torch.device,
                 dtype: torch.dtype, cuda_graphs: bool = False) -> None:
        self.device, self.dtype, self.bins = device, dtype, bins
        place = self._place
        conv1, res_blocks, conv2 = head
        self.head_conv1, self.head_conv2 = place(conv1), place(conv2)
        self.res_blocks = [_ResBlock(place(b.conv1), place(b.conv2), place(b.shortcut) if b.shortcut else None)
                           for b in res_blocks]
        self.tdnn = place(tdnn)
        self.blocks = [self._place_block(b) for b in blocks]
        self.embedding_weight, self.embedding_bias = (self._tensor(t) for t in embedding)
        self.embedding_size = self.embedding_weight.shape[0]
        self._zero = torch.zeros((), device=device, dtype=dtype)
        # calls padded to shape buckets, each bucket's call captured once as a CUDA graph and replayed (on the CPU the
        # same padded calls run eagerly)
        self.cuda_graphs = cuda_graphs
        self._graphs = _GraphedCalls(self.compute, device, dtype, bins) if cuda_graphs and device.type == "cuda" \
            else None

    @classmethod
    def from_graph(cls, graph: TorchOnnxGraph, cuda_graphs: bool = False) -> CamPlusPlus:
        """The network behind a CAM++ graph, on the graph's device and in its dtype; NotCamPlusPlus if the graph
        has another structure."""
        if len(graph.input_names) != 1 or len(graph.output_names) != 1:
            raise NotCamPlusPlus(f"one input and one output expected, found inputs {graph.input_names} and outputs "
                                 f"{graph.output_names}")
        shape = graph.input_shapes.get(graph.input_names[0], [])
        if len(shape) != 3 or not isinstance(shape[2], int) or shape[2] < 8:
            raise NotCamPlusPlus(f"input {graph.input_names[0]!r} of shape [1, T, bins] expected, found {shape}")
        bins = shape[2]
        cur = _Cursor(_GraphReader(graph).params())
        conv1, res_blocks, conv2, head_channels = _read_head(cur, bins)
        param = cur.take("the TDNN layer")
        if param.weight is None or param.weight.ndim != 3:
            raise NotCamPlusPlus(f"the TDNN layer's 1D convolution expected, found {param.describe()}")
        tdnn = _expect_conv(param, "the TDNN layer", (param.weight.shape[0], head_channels, None), (2,), bias=True)
        blocks, channels = _read_blocks(cur, tdnn.weight.shape[0])
        embedding = _read_embedding(cur, channels)
        return cls((conv1, res_blocks, conv2), tdnn, blocks, embedding, bins, graph.ctx.device, graph.ctx.dtype,
                   cuda_graphs)

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, self.dtype).contiguous()

    def _place(self, conv: _Conv) -> _Conv:
        return _Conv(self._tensor(conv.weight), self._tensor(conv.bias) if conv.bias is not None else None,
                     conv.stride, conv.padding, conv.dilation)

    def _place_block(self, block: _Block) -> _Block:
        t = self._tensor
        layers = [_CamLayer(t(x.scale), t(x.shift), self._place(x.bottleneck), self._place(x.local),
                            t(x.context1_weight), t(x.context1_bias), t(x.context2_weight), t(x.context2_bias))
                  for x in block.layers]
        return _Block(layers, t(block.transit_scale), t(block.transit_shift), self._place(block.transit))

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
        from cosystream.engine.graphs import BATCH_BUCKETS

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
        from cosystream.engine.graphs import bucket

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

    def _dense_block(self, x: torch.Tensor, block: _Block, frames: _Masks) -> torch.Tensor:
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

    def _cam_layer(self, x: torch.Tensor, layer: _CamLayer, frames: _Masks, out: torch.Tensor) -> None:
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
        from cosystream.engine.graphs import capture_stream

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
        from cosystream.engine.graphs import CAPTURE_LOCK

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
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
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


def _conv(x: torch.Tensor, conv: _Conv) -> torch.Tensor:
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
    t = t.to(dtype) if t.dtype.is_floating_point else t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


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


def load_fast_campplus(graph: TorchOnnxGraph, cuda_graphs: bool = False) -> tuple[CamPlusPlus | None, str | None]:
    """(the module, None) when the graph is the released CAM++ architecture and the module reproduces it on the
    graph's device (with `cuda_graphs`, through its graphed calls), else (None, why not). Float32 only: the
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
