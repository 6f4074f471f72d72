"""Run an ONNX graph with torch ops: the official side models (speech tokenizer, CAM++) on any torch device.

The graph is executed node by node exactly as stored (no architecture is assumed), so the same code
runs the released models and the fixtures' stand-ins. Float initialisers live on the compute device
in the compute dtype; integer and boolean tensors that only describe shapes (constants, `Shape`
results and what is computed from them) stay on the CPU, so shape arithmetic never waits for the GPU.

Shape arithmetic is folded per input shape (`shape_folding.ShapeFolding`): the nodes whose results follow from the
constants and the shapes alone (a real export has as many of them as compute nodes: Shape, Gather,
Unsqueeze, Concat, ConstantOfShape, Equal, Where, ...) run once per input shape, and a call with a shape
seen before runs only the compute nodes. Each of those nodes is a host-side torch call, so on a GPU
this is what bounds a small network's time, not the device.

A graph with an operator that is not implemented here is refused when it is loaded
(`UnsupportedGraph`, naming the operators), so a caller can keep onnxruntime for it.

One module past 600 lines on purpose: the loader, the plan and the operator table are one contract (every
operator the table lacks is what `UnsupportedGraph` names), read and tested together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from cosystream.errors import CheckpointError
from cosystream.frontend.shape_folding import (
    CallStats,
    FoldedShapes,
    ShapeFolding,
    same_value,
    shape_determined,
    unchanged,
)
from cosystream.transfers import to_device


class UnsupportedGraph(CheckpointError):
    """The ONNX graph uses an operator or attribute this interpreter does not implement."""


_ONNX_TO_TORCH_DTYPE = {
    1: torch.float32, 2: torch.uint8, 3: torch.int8, 5: torch.int16, 6: torch.int32, 7: torch.int64,
    9: torch.bool, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16,
}
_FLOAT_ONNX_TYPES = {1, 10, 11, 16}
MAX_CPU_NUMEL = 1024  # integer/boolean results up to this size stay on the CPU (shapes, lengths, small masks)

Attrs = dict[str, Any]
OpFn = Callable[["_Context", list[Any], Attrs], list[torch.Tensor]]
Step = tuple[OpFn, tuple[str, ...], tuple[str, ...], Attrs, tuple[str, ...]]


class _Context:
    """Where float work happens and in which dtype.

    Float scalars (graph constants such as 1/sqrt(d), the FSQ scale, a GELU's 0.5) stay float32 CPU
    tensors: combined with a device tensor they act as exact scalars (torch computes in its op math type),
    so bf16/fp16 runs do not round the constants themselves, and length arithmetic done in float stays
    exact.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype

    def to_compute(self, t: torch.Tensor) -> torch.Tensor:
        """On the device; floats in the compute dtype."""
        return self.send(t.to(self.dtype) if t.dtype.is_floating_point else t)

    def send(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the device. A host tensor goes to a CUDA device through pinned memory without waiting: a plain
        copy from the host synchronises the host with the stream, which would stall the host's work (launching the
        graph's next operators) until the device had run everything queued before it."""
        return to_device(t, self.device)

    def same_place(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Operands of one op on one device and, for floats, one dtype (the compute dtype wins over float32)."""
        first = tensors[0]
        if all(t.is_cpu == first.is_cpu and t.dtype == first.dtype for t in tensors):
            return list(tensors)
        floats = {t.dtype for t in tensors if t.dtype.is_floating_point}
        if len(floats) > 1:
            tensors = [t.to(self.dtype) if t.dtype.is_floating_point else t for t in tensors]
        if not all(t.is_cpu for t in tensors):
            return [self.to_compute(t) for t in tensors]
        return list(tensors)

    def pair(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Operands of an elementwise arithmetic op. A one-element CPU operand meeting a device tensor becomes a
        0-d CPU scalar (no copy to the device; torch's type promotion gives the device tensor's dtype, and the
        result shape is unchanged since the other operand has at least its rank)."""
        if a.is_cpu == b.is_cpu and a.dtype == b.dtype:
            return a, b
        if a.is_cpu != b.is_cpu:
            if _scalar_for(b, a):
                return a, b.reshape(())
            if _scalar_for(a, b):
                return a.reshape(()), b
        x, y = self.same_place([a, b])
        return x, y

    def cast_target(self, onnx_type: int, source: torch.Tensor) -> torch.dtype:
        """A cast to float keeps the compute dtype on the device (the graph was exported in float32; the dtype is
        our choice) and float32 on the CPU, where only shape and length arithmetic lives."""
        if onnx_type in _FLOAT_ONNX_TYPES:
            return self.dtype if not source.is_cpu or source.dtype == self.dtype else torch.float32
        return _ONNX_TO_TORCH_DTYPE[onnx_type]


class CaptureUnsafe(RuntimeError):
    """A call being captured in a CUDA graph would copy a host tensor its warm-up did not: the copy's source would
    be a host buffer the graph does not own."""


class StaticUploads(_Context):
    """The context of calls captured in a CUDA graph (`TorchOnnxGraph.__call__(..., ctx=)`).

    A graph replays the device work alone: a copy from the host captured in it would read, at every replay, a
    host buffer that is long reused. So every host tensor a call sends to the device (shape arithmetic that meets
    device tensors: an index range, a position table) is copied once, in a warm-up call of the same shapes before
    the capture, and kept here, keyed by its dtype, shape and bytes; while `capturing`, a call takes those copies,
    and a host tensor not copied before raises `CaptureUnsafe` (the capture fails; its caller runs eagerly).
    The copies are only read (the runner's operators write no input in place), so one serves every call that
    sends equal contents. Host values that only depend on the input shapes are what a captured call may bake in;
    a host value that depends on the inputs' data would need a device-to-host copy, which a capture refuses.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(device, dtype)
        self.copies: dict[tuple, torch.Tensor] = {}
        self.capturing = False

    def send(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_cpu:
            return t.to(self.device)
        key = (t.dtype, tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        copy = self.copies.get(key)
        if copy is None:
            if self.capturing:
                raise CaptureUnsafe(f"a host tensor {t.dtype} {tuple(t.shape)} not copied in the warm-up")
            copy = self.copies[key] = t.to(self.device)  # outside the capture: a plain copy may wait
        return copy


def _scalar_for(t: torch.Tensor, other: torch.Tensor) -> bool:
    return t.is_cpu and t.numel() == 1 and other.ndim >= t.ndim


def torch_dtype(onnx_type: int) -> torch.dtype:
    """The torch dtype of an ONNX tensor element type."""
    if onnx_type not in _ONNX_TO_TORCH_DTYPE:
        raise UnsupportedGraph(f"ONNX element type {onnx_type} is not supported")
    return _ONNX_TO_TORCH_DTYPE[onnx_type]


def _ints(t: torch.Tensor) -> list[int]:
    if t.ndim == 1 and not t.dtype.is_floating_point and t.dtype != torch.bool:
        return t.tolist()  # ints already (the common case: shape arguments; a reshape costs more than the rest)
    return [int(v) for v in t.reshape(-1).tolist()]


def _axis(axis: int, ndim: int) -> int:
    return axis + ndim if axis < 0 else axis


def _binary(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> OpFn:
    def op(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
        a, b = ctx.pair(x[0], x[1])
        return [fn(a, b)]
    return op


def _unary(fn: Callable[[torch.Tensor], torch.Tensor]) -> OpFn:
    return lambda ctx, x, attrs: [fn(x[0])]


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype.is_floating_point or b.dtype.is_floating_point:
        return a / b
    return torch.div(a, b, rounding_mode="trunc")  # ONNX integer Div truncates (C semantics)


def _mod(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    a, b = ctx.pair(x[0], x[1])
    return [torch.fmod(a, b) if attrs.get("fmod", 0) else torch.remainder(a, b)]


def _pow(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    a, b = x
    if b.numel() == 1 and b.device.type == "cpu" and float(b) == 2.0:
        return [a * a]  # the exact square, as onnxruntime computes it
    a, b = ctx.pair(a, b)
    return [torch.pow(a, b)]


def _conv(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    inp, weight = x[0], ctx.to_compute(x[1])
    bias = ctx.to_compute(x[2]) if len(x) > 2 and x[2] is not None else None
    dims = weight.ndim - 2
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise UnsupportedGraph("Conv: auto_pad is not supported")
    pads = list(attrs.get("pads", [0] * 2 * dims))
    strides = attrs.get("strides", [1] * dims)
    dilations = attrs.get("dilations", [1] * dims)
    group = attrs.get("group", 1)
    begin, end = pads[:dims], pads[dims:]
    if begin != end:  # asymmetric: pad explicitly (F.pad takes the last dim first)
        pad_arg: list[int] = []
        for b, e in zip(reversed(begin), reversed(end), strict=True):
            pad_arg += [b, e]
        inp, begin = F.pad(inp, pad_arg), [0] * dims
    conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    return [conv(inp, weight, bias, stride=strides, padding=begin, dilation=dilations, groups=group)]


def _matmul(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    a, b = ctx.same_place(x)
    return [torch.matmul(a, b)]


def _gemm(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    a, b = ctx.same_place([x[0], x[1]])
    if attrs.get("transA", 0):
        a = a.T
    if attrs.get("transB", 0):
        b = b.T
    out = attrs.get("alpha", 1.0) * (a @ b)
    if len(x) > 2 and x[2] is not None:
        out = out + attrs.get("beta", 1.0) * ctx.to_compute(x[2])
    return [out]


def _reduce(fn: Callable[..., torch.Tensor]) -> OpFn:
    def op(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
        data = x[0]
        axes = attrs.get("axes")
        if axes is None and len(x) > 1 and x[1] is not None:
            axes = _ints(x[1])  # opset 13 (ReduceSum) / 18 (the others): axes as an input
        keep = bool(attrs.get("keepdims", 1))
        if not axes:
            if attrs.get("noop_with_empty_axes", 0):
                return [data]
            axes = list(range(data.ndim))
        return [fn(data, dim=[_axis(a, data.ndim) for a in axes], keepdim=keep)]
    return op


def _amax(data: torch.Tensor, dim: list[int], keepdim: bool) -> torch.Tensor:
    return torch.amax(data, dim=dim, keepdim=keepdim)


def _amin(data: torch.Tensor, dim: list[int], keepdim: bool) -> torch.Tensor:
    return torch.amin(data, dim=dim, keepdim=keepdim)


def _prod(data: torch.Tensor, dim: list[int], keepdim: bool) -> torch.Tensor:
    for axis in sorted(dim, reverse=True):  # torch.prod reduces one axis at a time
        data = torch.prod(data, dim=axis, keepdim=keepdim)
    return data


def _reduce_l2(data: torch.Tensor, dim: list[int], keepdim: bool) -> torch.Tensor:
    return torch.sqrt(torch.sum(data * data, dim=dim, keepdim=keepdim))


def _reshape(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    shape = _ints(x[1])
    if not attrs.get("allowzero", 0):
        shape = [x[0].shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return [x[0].reshape(shape)]


def _flatten(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    axis = _axis(attrs.get("axis", 1), x[0].ndim)
    return [x[0].reshape(int(np.prod(x[0].shape[:axis])), -1)]


def _transpose(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    perm = attrs.get("perm", list(reversed(range(x[0].ndim))))
    return [x[0].permute(*perm)]


def _unsqueeze(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    axes = attrs.get("axes") or _ints(x[1])
    out = x[0]
    ndim = out.ndim + len(axes)
    for a in sorted(_axis(a, ndim) for a in axes):
        out = out.unsqueeze(a)
    return [out]


def _squeeze(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    axes = attrs.get("axes")
    if axes is None and len(x) > 1 and x[1] is not None:
        axes = _ints(x[1])
    if axes is None:
        return [x[0].squeeze()]
    out = x[0]
    for a in sorted((_axis(a, out.ndim) for a in axes), reverse=True):
        out = out.squeeze(a)
    return [out]


def _concat(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    parts = ctx.same_place([t for t in x if t is not None])
    dtype = parts[0].dtype
    return [torch.cat([p.to(dtype) for p in parts], dim=attrs["axis"])]


def _gather(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    data, index = x
    axis = _axis(attrs.get("axis", 0), data.ndim)
    index = index.long()
    index = torch.where(index < 0, index + data.shape[axis], index)  # on the host for a host index
    index = index.to(data.device) if data.is_cpu else ctx.send(index)
    out = torch.index_select(data, axis, index.reshape(-1))
    return [out.reshape([*data.shape[:axis], *index.shape, *data.shape[axis + 1:]])]


def _slice(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    data = x[0]
    starts, ends = _ints(x[1]), _ints(x[2])
    axes = _ints(x[3]) if len(x) > 3 and x[3] is not None else list(range(len(starts)))
    steps = _ints(x[4]) if len(x) > 4 and x[4] is not None else [1] * len(starts)
    index: list[slice] = [slice(None)] * data.ndim
    flips: list[int] = []
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis = _axis(axis, data.ndim)
        size = data.shape[axis]
        if step > 0:
            index[axis] = slice(*slice(start, end, step).indices(size))
        else:  # negative step: take the equivalent forward slice, then flip it
            first, stop, _ = slice(start, end, step).indices(size)
            count = max(0, -(-(first - stop) // -step))
            last = first + step * (count - 1) if count else first
            index[axis] = slice(last, first + 1, -step) if count else slice(0, 0)
            flips.append(axis)
    out = data[tuple(index)]
    return [out.flip(flips) if flips else out]


def _split(ctx: _Context, x: list[Any], attrs: Attrs, num_outputs: int) -> list[torch.Tensor]:
    data = x[0]
    axis = _axis(attrs.get("axis", 0), data.ndim)
    sizes = attrs.get("split")
    if sizes is None and len(x) > 1 and x[1] is not None:
        sizes = _ints(x[1])
    if sizes is None:
        chunk = -(-data.shape[axis] // num_outputs)
        sizes = [min(chunk, data.shape[axis] - i * chunk) for i in range(num_outputs)]
    return list(torch.split(data, sizes, dim=axis))


def _expand(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    data, shape = x[0], _ints(x[1])
    ndim = max(data.ndim, len(shape))
    full = [1] * (ndim - len(shape)) + shape
    padded = data.reshape([1] * (ndim - data.ndim) + list(data.shape))
    target = [max(d, s) if d == 1 or s == 1 else d for d, s in zip(padded.shape, full, strict=True)]
    return [padded.expand(target)]


def _tile(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    return [x[0].repeat(_ints(x[1]))]


def _shape(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    shape = torch.tensor(list(x[0].shape), dtype=torch.int64)
    start, end = attrs.get("start", 0), attrs.get("end")
    return [shape[start:end]]


def _constant_of_shape(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    value = attrs.get("value")
    fill = torch.zeros(1, dtype=torch.float32) if value is None else value
    dtype = ctx.dtype if fill.dtype.is_floating_point else fill.dtype
    device = ctx.device if fill.dtype.is_floating_point else torch.device("cpu")
    return [torch.full(_ints(x[0]), fill.reshape(-1)[0].item(), dtype=dtype, device=device)]


def _range(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    start, limit, delta = (t.reshape(()).item() for t in x)
    return [torch.arange(start, limit, delta, dtype=x[0].dtype, device=x[0].device)]


def _where(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    cond, a, b = ctx.same_place(x)
    if a.dtype != b.dtype:
        b = b.to(a.dtype)
    return [torch.where(cond, a, b)]


def _cast(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    return [x[0].to(ctx.cast_target(attrs["to"], x[0]))]


def _softmax(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    return [torch.softmax(x[0], dim=attrs.get("axis", -1))]


def _log_softmax(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    return [torch.log_softmax(x[0], dim=attrs.get("axis", -1))]


def _layer_norm(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    data, scale = x[0], ctx.to_compute(x[1])
    bias = ctx.to_compute(x[2]) if len(x) > 2 and x[2] is not None else None
    axis = _axis(attrs.get("axis", -1), data.ndim)
    return [F.layer_norm(data, data.shape[axis:], scale, bias, eps=attrs.get("epsilon", 1e-5))]


def _batch_norm(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    data, (scale, bias, mean, var) = x[0], (ctx.to_compute(t) for t in x[1:5])
    return [F.batch_norm(data, mean, var, scale, bias, training=False, eps=attrs.get("epsilon", 1e-5))]


def _instance_norm(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    return [F.instance_norm(x[0], weight=ctx.to_compute(x[1]), bias=ctx.to_compute(x[2]),
                            eps=attrs.get("epsilon", 1e-5))]


def _pad(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    data = x[0]
    pads = attrs.get("pads") or _ints(x[1])
    value = x[2].reshape(-1)[0].item() if len(x) > 2 and x[2] is not None and x[2].numel() else 0.0
    axes = _ints(x[3]) if len(x) > 3 and x[3] is not None else list(range(data.ndim))
    mode = attrs.get("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    half = len(pads) // 2
    per_axis = {_axis(a, data.ndim): (pads[i], pads[i + half]) for i, a in enumerate(axes)}
    pad_arg: list[int] = []
    for axis in reversed(range(data.ndim)):
        pad_arg += list(per_axis.get(axis, (0, 0)))
    torch_mode = {"constant": "constant", "reflect": "reflect", "edge": "replicate"}.get(mode)
    if torch_mode is None:
        raise UnsupportedGraph(f"Pad: mode {mode!r} is not supported")
    if torch_mode == "constant":
        return [F.pad(data, pad_arg, value=value)]
    # reflect/replicate pad only the trailing dims in torch: trim the untouched leading zeros
    while pad_arg[-2:] == [0, 0]:
        pad_arg = pad_arg[:-2]
    return [F.pad(data, pad_arg, mode=torch_mode)]


def _clip(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    low = x[1] if len(x) > 1 and x[1] is not None else attrs.get("min")
    high = x[2] if len(x) > 2 and x[2] is not None else attrs.get("max")
    low = low.item() if isinstance(low, torch.Tensor) else low
    high = high.item() if isinstance(high, torch.Tensor) else high
    return [torch.clamp(x[0], min=low, max=high)]


def _variadic(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> OpFn:
    def op(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
        parts = ctx.same_place(x)
        out = parts[0]
        for part in parts[1:]:
            out = fn(out, part)
        return [out]
    return op


def _arg(fn: Callable[..., torch.Tensor]) -> OpFn:
    def op(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
        if attrs.get("select_last_index", 0):
            raise UnsupportedGraph("ArgMax/ArgMin: select_last_index is not supported")
        return [fn(x[0], dim=attrs.get("axis", 0), keepdim=bool(attrs.get("keepdims", 1)))]
    return op


def _pool(kind: str) -> OpFn:
    def op(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
        data = x[0]
        dims = data.ndim - 2
        kernel = attrs["kernel_shape"]
        strides = attrs.get("strides", [1] * dims)
        pads = list(attrs.get("pads", [0] * 2 * dims))
        if pads[:dims] != pads[dims:]:
            raise UnsupportedGraph(f"{kind}: asymmetric pads are not supported")
        ceil = bool(attrs.get("ceil_mode", 0))
        if kind == "MaxPool":
            pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[dims - 1]
            return [pool(data, kernel, strides, pads[:dims], ceil_mode=ceil)]
        pool = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[dims - 1]
        include = bool(attrs.get("count_include_pad", 0))
        return [pool(data, kernel, strides, pads[:dims], ceil_mode=ceil, count_include_pad=include)]
    return op


def _global_average_pool(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    return [x[0].mean(dim=list(range(2, x[0].ndim)), keepdim=True)]


def _cumsum(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    if attrs.get("exclusive", 0) or attrs.get("reverse", 0):
        raise UnsupportedGraph("CumSum: exclusive/reverse are not supported")
    return [torch.cumsum(x[0], dim=int(x[1].reshape(-1)[0]))]


def _trilu(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    k = int(x[1].reshape(-1)[0]) if len(x) > 1 and x[1] is not None else 0
    return [torch.triu(x[0], k) if attrs.get("upper", 1) else torch.tril(x[0], k)]


def _identity(ctx: _Context, x: list[Any], attrs: Attrs) -> list[torch.Tensor]:
    return [x[0]]


def _round(t: torch.Tensor) -> torch.Tensor:
    return torch.round(t)  # half to even, as ONNX specifies


def _elementwise_ops() -> dict[str, OpFn]:
    return {
        "Add": _binary(torch.add), "Sub": _binary(torch.sub), "Mul": _binary(torch.mul), "Div": _binary(_div),
        "Equal": _binary(torch.eq), "Less": _binary(torch.lt), "LessOrEqual": _binary(torch.le),
        "Greater": _binary(torch.gt), "GreaterOrEqual": _binary(torch.ge), "And": _binary(torch.logical_and),
        "Or": _binary(torch.logical_or), "Xor": _binary(torch.logical_xor), "Mod": _mod, "Pow": _pow,
        "Max": _variadic(torch.maximum), "Min": _variadic(torch.minimum), "Sum": _variadic(torch.add),
        "Not": _unary(torch.logical_not), "Neg": _unary(torch.neg), "Abs": _unary(torch.abs),
        "Sqrt": _unary(torch.sqrt), "Reciprocal": _unary(torch.reciprocal), "Exp": _unary(torch.exp),
        "Log": _unary(torch.log), "Erf": _unary(torch.erf), "Tanh": _unary(torch.tanh),
        "Sigmoid": _unary(torch.sigmoid), "Relu": _unary(torch.relu), "Sin": _unary(torch.sin),
        "Cos": _unary(torch.cos), "Floor": _unary(torch.floor), "Ceil": _unary(torch.ceil),
        "Round": _unary(_round), "Sign": _unary(torch.sign), "Softplus": _unary(F.softplus),
        "Identity": _identity, "Dropout": _identity, "Where": _where, "Cast": _cast, "Clip": _clip,
    }


def _shape_ops() -> dict[str, OpFn]:
    return {
        "Reshape": _reshape, "Flatten": _flatten, "Transpose": _transpose, "Unsqueeze": _unsqueeze,
        "Squeeze": _squeeze, "Concat": _concat, "Gather": _gather, "Slice": _slice, "Expand": _expand,
        "Tile": _tile, "Shape": _shape, "ConstantOfShape": _constant_of_shape, "Range": _range, "Pad": _pad,
        "Trilu": _trilu, "CumSum": _cumsum,
    }


def _compute_ops() -> dict[str, OpFn]:
    return {
        "Conv": _conv, "MatMul": _matmul, "Gemm": _gemm, "Softmax": _softmax, "LogSoftmax": _log_softmax,
        "LayerNormalization": _layer_norm, "BatchNormalization": _batch_norm,
        "InstanceNormalization": _instance_norm, "ReduceMean": _reduce(torch.mean),
        "ReduceSum": _reduce(torch.sum), "ReduceMax": _reduce(_amax), "ReduceMin": _reduce(_amin),
        "ReduceL2": _reduce(_reduce_l2), "ReduceProd": _reduce(_prod), "ArgMax": _arg(torch.argmax),
        "ArgMin": _arg(torch.argmin),
        "MaxPool": _pool("MaxPool"), "AveragePool": _pool("AveragePool"),
        "GlobalAveragePool": _global_average_pool,
    }


OPS: dict[str, OpFn] = {**_elementwise_ops(), **_shape_ops(), **_compute_ops()}
SUPPORTED_OPS = frozenset(OPS) | {"Constant", "Split"}


def _op_for(node: _Node) -> OpFn:
    if node.op_type == "Split":
        count = len(node.outputs)
        return lambda ctx, x, attrs: _split(ctx, x, attrs, count)
    return OPS[node.op_type]


def _attribute_value(attr: Any) -> Any:
    from onnx import helper, numpy_helper

    value = helper.get_attribute_value(attr)
    if hasattr(value, "raw_data") or hasattr(value, "dims"):
        return torch.from_numpy(numpy_helper.to_array(value).copy())
    return value


class _Node:
    __slots__ = ("op_type", "inputs", "outputs", "attrs", "name")

    def __init__(self, op_type: str, inputs: list[str], outputs: list[str], attrs: Attrs, name: str) -> None:
        self.op_type, self.inputs, self.outputs, self.attrs, self.name = op_type, inputs, outputs, attrs, name


class TorchOnnxGraph:
    """One ONNX model, callable on torch tensors: `graph({"feats": x, ...}) -> {"indices": y, ...}`.

    Float inputs are cast to `dtype` on `device`; outputs are returned where they were computed.
    `fold_shapes=False` interprets every node on every call (the reference the folding is tested against).
    Calls may run on several threads at once (each on its own values; the fold cache is locked); `stats`
    describes the call that finished last.
    """

    def __init__(self, path: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, fold_shapes: bool = True) -> None:
        import onnx
        from onnx import numpy_helper

        model = onnx.load(str(path))
        graph = model.graph
        self.path = Path(path)
        self.ctx = _Context(torch.device(device), dtype)
        missing = sorted({n.op_type for n in graph.node if n.domain not in ("", "ai.onnx")
                          or n.op_type not in SUPPORTED_OPS})
        if missing:
            raise UnsupportedGraph(f"{self.path.name}: operators not supported by the torch runner: "
                                   f"{', '.join(missing)}")
        self.initializers = {init.name: self._place(torch.from_numpy(numpy_helper.to_array(init).copy()))
                             for init in graph.initializer}
        self.input_names = [i.name for i in graph.input if i.name not in self.initializers]
        self.input_types = {i.name: i.type.tensor_type.elem_type for i in graph.input}
        self.input_shapes: dict[str, list[int | str]] = {
            i.name: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in i.type.tensor_type.shape.dim]
            for i in graph.input}
        self.output_names = [o.name for o in graph.output]
        self.nodes = [_Node(n.op_type, list(n.input), list(n.output),
                            {a.name: _attribute_value(a) for a in n.attribute}, n.name) for n in graph.node]
        # constants join the initialisers; the rest becomes a plan of (op, inputs, outputs, attributes, values
        # to free after it), so a call does no per-node lookups beyond the op itself
        self.constants = dict(self.initializers)
        for node in self.nodes:
            if node.op_type == "Constant":
                self.constants[node.outputs[0]] = self._constant(node)
        computed = [n for n in self.nodes if n.op_type != "Constant"]
        self._plan = self._build_plan(computed)
        static = shape_determined(computed, set(self.constants), set(self.input_names), set(self.output_names))
        self._dynamic_plan = self._build_plan([n for n, s in zip(computed, static, strict=True) if not s])
        self.folding = ShapeFolding(static) if fold_shapes else None
        self.stats = CallStats()

    @property
    def node_counts(self) -> dict[str, int]:
        """Nodes run per call: all of them without folding, the compute nodes alone with a cached shape."""
        return {"constants": len(self.nodes) - len(self._plan), "plan": len(self._plan),
                "compute": len(self._dynamic_plan)}

    def _build_plan(self, nodes: list[_Node]) -> list[Step]:
        last: dict[str, int] = {}
        for index, node in enumerate(nodes):
            for name in node.inputs:
                if name and name not in self.constants:
                    last[name] = index
        keep = set(self.output_names)
        plan = []
        for index, node in enumerate(nodes):
            # inputs read for the last time, and results no later node of this plan reads (in the compute
            # plan, a tensor only the folded shape arithmetic read)
            done = [n for n in node.inputs if last.get(n) == index] + [n for n in node.outputs if n not in last]
            frees = tuple(dict.fromkeys(n for n in done if n and n not in keep))
            plan.append((_op_for(node), tuple(node.inputs), tuple(node.outputs), node.attrs, frees))
        return plan

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        """Float tensors go to the device in the compute dtype; float scalars (float32), integers and booleans
        stay on the CPU (constants and shape math)."""
        if tensor.dtype.is_floating_point and tensor.numel() > 1:
            return tensor.to(device=self.ctx.device, dtype=self.ctx.dtype)
        return tensor.to(torch.float32) if tensor.dtype.is_floating_point else tensor

    def _constant(self, node: _Node) -> torch.Tensor:
        attrs = node.attrs
        if "value" in attrs:
            return self._place(attrs["value"])
        for key, dtype in (("value_float", torch.float32), ("value_int", torch.int64)):
            if key in attrs:
                return self._place(torch.tensor(attrs[key], dtype=dtype))
        for key, dtype in (("value_floats", torch.float32), ("value_ints", torch.int64)):
            if key in attrs:
                return self._place(torch.tensor(list(attrs[key]), dtype=dtype))
        raise UnsupportedGraph(f"{self.path.name}: Constant node {node.name!r} has no supported value")

    def __call__(self, inputs: dict[str, torch.Tensor], ctx: _Context | None = None) -> dict[str, torch.Tensor]:
        """The graph's outputs for `inputs`. `ctx` replaces the graph's own context for this call (`StaticUploads`
        for calls captured in a CUDA graph)."""
        ctx = self.ctx if ctx is None else ctx
        given: dict[str, torch.Tensor] = {}
        for name in self.input_names:
            if name not in inputs:
                raise ValueError(f"{self.path.name}: missing input {name!r}")
            tensor = inputs[name]
            if self.input_types.get(name) in _FLOAT_ONNX_TYPES:
                tensor = tensor.to(device=ctx.device, dtype=ctx.dtype)
            given[name] = tensor
        with torch.inference_mode():
            if self.folding is None:
                values = self._run(self._plan, {**self.constants, **given}, ctx)
            else:
                values = self._run_folded(self.folding, given, ctx)
        return {name: values[name] for name in self.output_names}

    def folded_for(self, inputs: dict[str, torch.Tensor]) -> FoldedShapes | None:
        """The cached shape arithmetic of inputs of these shapes (None: not folded yet, or no folding). A CUDA graph
        captured over calls of these shapes reads its device tensors, so it holds them (the cache may drop them)."""
        if self.folding is None:
            return None
        return self.folding.get(_fold_key({name: inputs[name] for name in self.input_names}))

    def _run(self, plan: list[Step], values: dict[str, torch.Tensor], ctx: _Context) -> dict[str, torch.Tensor]:
        settle = ctx.device.type != "cpu"
        for fn, names, outputs, attrs, frees in plan:
            outs = fn(ctx, [values[name] if name else None for name in names], attrs)
            for name, out in zip(outputs, outs, strict=False):
                if name:
                    values[name] = _settle(out, ctx) if settle else out
            for name in frees:
                del values[name]
        self.stats = CallStats(ops_run=len(plan))
        return values

    def _run_folded(self, folding: ShapeFolding, given: dict[str, torch.Tensor], ctx: _Context
                    ) -> dict[str, torch.Tensor]:
        key = _fold_key(given)
        folded = folding.get(key)
        if folded is not None:
            values = self._run(self._dynamic_plan, {**self.constants, **folded.values, **given}, ctx)
            self.stats = CallStats(ops_run=len(self._dynamic_plan), values_reused=len(folded.values),
                                   shape_cached=True)
            return values
        folded, values = self._fold(folding, folding.reference_for(key), {**self.constants, **given}, ctx)
        folding.put(key, folded)
        return values

    def _fold(self, folding: ShapeFolding, reference: FoldedShapes | None, values: dict[str, torch.Tensor],
              ctx: _Context) -> tuple[FoldedShapes, dict[str, torch.Tensor]]:
        """The whole plan for a new input shape, recording its shape-determined values; those that cannot differ
        from the reference folding's (every input unchanged) are taken from it instead of computed."""
        settle = ctx.device.type != "cpu"
        folded = FoldedShapes()
        changed: set[str] = set()
        ops_run = reused = 0
        for index, (fn, names, outputs, attrs, frees) in enumerate(self._plan):
            static = folding.static[index]
            if static and fn is _shape:
                folded.shapes_read[index] = tuple(values[names[0]].shape)
            if static and reference is not None and unchanged(index, names, folded, reference, changed):
                for name in outputs:
                    if name:
                        values[name] = folded.values[name] = reference.values[name]
                reused += 1
            else:
                outs = fn(ctx, [values[name] if name else None for name in names], attrs)
                ops_run += 1
                for name, out in zip(outputs, outs, strict=False):
                    if name:
                        values[name] = _settle(out, ctx) if settle else out
                        if static:
                            folded.values[name] = values[name]
                            if not same_value(values[name], reference, name):
                                changed.add(name)
            for name in frees:
                del values[name]
        self.stats = CallStats(ops_run=ops_run, values_reused=reused)
        return folded, values


def _fold_key(given: dict[str, torch.Tensor]) -> tuple:
    return tuple((name, tuple(t.shape), t.dtype) for name, t in given.items())


def _settle(out: torch.Tensor, ctx: _Context) -> torch.Tensor:
    """A CPU result larger than shape bookkeeping (a mask expanded to [B, T, T]) moves to the device, where the work
    that reads it runs."""
    if out.is_cpu and out.numel() > MAX_CPU_NUMEL:
        return ctx.to_compute(out)
    return out
