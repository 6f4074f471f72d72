"""Reading CAM++ (3D-Speaker's CAMPPlus, CosyVoice's `campplus.onnx`) out of an ONNX graph: its parameters in
the layout of the released architecture, for `campplus.CamPlusPlus`.

The graph's parameter operators (Conv, BatchNormalization, Gemm and MatMul with constant weights) are taken in
topological order and matched, by shape and attributes, against the released architecture
(`cosystream/testing/realistic_side_models.py` documents it): the FCM head (2D convolutions over fbank bins and
time, two layers of two residual blocks, frequency strided 8x), a strided TDNN layer, densely connected blocks of
CAM layers, transition layers, statistics pooling and the embedding layer. Initializer names are never read (an
exporter names them freely, `onnx::Conv_123` after it fused a batch norm into the convolution). A batch norm that
directly follows a convolution (the convolution's only reader) is folded into it, as the exporter does; the other
batch norms become a per-channel scale and shift. The layer counts, widths and dilations are read from the graph.
A graph of another structure (the fixture sets' stand-ins) is refused with the place it differs
(`NotCamPlusPlus`). The operators between the parameters are not read: `campplus.self_check` compares the
network with the graph itself.

Past 400 lines: the reader and the layout it checks against are one contract, read together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cosystream.frontend.onnx_torch import TorchOnnxGraph, _Node

FCM_LAYERS = 2  # residual layers of the FCM head, each of FCM_BLOCKS blocks, the first strided over frequency
FCM_BLOCKS = 2
FCM_FREQUENCY_STRIDES = 3  # two strided layers and the final convolution: bins / 8
# ops through which a batch norm may read the convolution it follows (a squeeze before a 2D batch norm)
_PASSTHROUGH_OPS = {"Identity", "Squeeze", "Unsqueeze", "Reshape", "Flatten"}


class NotCamPlusPlus(ValueError):
    """The ONNX graph is not the released CAM++ architecture (the message says where it differs)."""


# ---------------------------------------------------------------------------------------------- parameter operators
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


# ---------------------------------------------------------------------------------------------- the parameters
@dataclass
class Conv:
    weight: torch.Tensor
    bias: torch.Tensor | None
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]


@dataclass
class ResBlock:
    conv1: Conv
    conv2: Conv
    shortcut: Conv | None


@dataclass
class CamLayer:
    scale: torch.Tensor  # [1, C, 1] pre-activation batch norm
    shift: torch.Tensor
    bottleneck: Conv  # 1x1, mid batch norm folded
    local: Conv  # kernel k, dilated
    context1_weight: torch.Tensor  # [C'/2, C'] linear on the per-segment context
    context1_bias: torch.Tensor
    context2_weight: torch.Tensor  # [growth, C'/2]
    context2_bias: torch.Tensor

    @property
    def growth(self) -> int:
        return self.local.weight.shape[0]


@dataclass
class DenseBlock:
    layers: list[CamLayer]
    transit_scale: torch.Tensor
    transit_shift: torch.Tensor
    transit: Conv


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
                 bias: bool | None = None) -> Conv:
    """The conv `param` as a Conv, after checking it has `shape` (None: any size) and attributes that keep the
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
    return Conv(param.weight, param.bias, param.strides, param.pads, param.dilations)


def _expect_norm(param: _Param | None, channels: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if param is None or param.kind != "norm" or param.scale is None or param.shift is None:
        raise NotCamPlusPlus(f"{what} (a batch norm over {channels} channels) expected, found "
                             f"{param.describe() if param else 'the end of the graph'}")
    if param.scale.numel() != channels:
        raise NotCamPlusPlus(f"{what} over {channels} channels expected, found {param.describe()}")
    return param.scale.reshape(1, -1, 1), param.shift.reshape(1, -1, 1)


def _read_head(cur: _Cursor, bins: int) -> tuple[Conv, list[ResBlock], Conv, int]:
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
                blocks.append(ResBlock(_expect_conv(convs[0], f"{what} conv1", square, (2, 1), bias=True),
                                        _expect_conv(convs[1], f"{what} conv2", square, bias=True),
                                        _expect_conv(shortcut[0], f"{what} shortcut", (channels, channels, 1, 1),
                                                     (2, 1), bias=True)))
            else:
                blocks.append(ResBlock(_expect_conv(cur.take(what), f"{what} conv1", square, bias=True),
                                        _expect_conv(cur.take(what), f"{what} conv2", square, bias=True), None))
    conv2 = _expect_conv(cur.take("the FCM head's last convolution"), "the FCM head's last convolution", square,
                         (2, 1), bias=True)
    for _ in range(FCM_FREQUENCY_STRIDES):
        bins = (bins - 1) // 2 + 1
    return conv1, blocks, conv2, channels * bins


def _read_cam_layer(cur: _Cursor, channels: int) -> CamLayer:
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
    return CamLayer(scale, shift, bottleneck, local_conv, context1.weight[..., 0], _bias_or_zero(context1),
                     context2.weight[..., 0], _bias_or_zero(context2))


def _bias_or_zero(conv: Conv) -> torch.Tensor:
    return conv.bias if conv.bias is not None else torch.zeros(conv.weight.shape[0], dtype=conv.weight.dtype)


def _starts_cam_layer(cur: _Cursor, channels: int) -> bool:
    """A batch norm over `channels`, a 1x1 convolution from them, then a convolution reading its output (a CAM
    layer); a transition layer's 1x1 convolution is followed by a batch norm or the embedding instead."""
    norm, conv, after = cur.peek(), cur.peek(1), cur.peek(2)
    if norm is None or norm.kind != "norm" or conv is None or conv.weight is None or after is None:
        return False
    return (conv.kind == "conv" and conv.weight.shape[1] == channels and after.kind == "conv"
            and after.weight is not None and after.weight.shape[1] == conv.weight.shape[0])


def _read_blocks(cur: _Cursor, channels: int) -> tuple[list[DenseBlock], int]:
    blocks: list[DenseBlock] = []
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
        blocks.append(DenseBlock(layers, scale, shift, transit))
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


@dataclass
class CamWeights:
    """The released CAM++ network's parameters, batch norms folded (float64, on the CPU)."""

    head_conv1: Conv
    res_blocks: list[ResBlock]
    head_conv2: Conv
    tdnn: Conv
    blocks: list[DenseBlock]
    embedding_weight: torch.Tensor  # [E, 2C] over the pooled mean and standard deviation
    embedding_bias: torch.Tensor
    bins: int


def read_campplus(graph: TorchOnnxGraph) -> CamWeights:
    """The parameters of a CAM++ graph; NotCamPlusPlus (saying where) if it has another structure."""
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
    return CamWeights(conv1, res_blocks, conv2, tdnn, blocks, *embedding, bins)
