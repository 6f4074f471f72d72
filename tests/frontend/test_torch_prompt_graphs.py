"""The ONNX-in-torch runner (frontend/onnx_torch.py) against onnxruntime, and the batch-mode probe.

Each operator is checked on a one-node graph built here, so operators the fixture stand-ins do not
use (those of the released tokenizer and CAM++ graphs) are covered too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from cosystream.frontend.onnx_torch import TorchOnnxGraph, UnsupportedGraph
from cosystream.frontend.torch_prompt import BatchedGraph

OPSET = 17
RNG = np.random.default_rng(7)


def _f(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _save(tmp_path: Path, name: str, nodes, inputs, outputs, inits=()) -> Path:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return path


def _value(name: str, array: np.ndarray):
    elem = {np.float32: TensorProto.FLOAT, np.int64: TensorProto.INT64, np.bool_: TensorProto.BOOL,
            np.int32: TensorProto.INT32}[array.dtype.type]
    return helper.make_tensor_value_info(name, elem, list(array.shape))


def _init(name: str, array: np.ndarray):
    return numpy_helper.from_array(array, name)


# (op, {input name: array}, {initialiser name: array}, attributes, number of outputs)
CASES = [
    ("Add", {"a": _f(2, 3)}, {"b": _f(3)}, {}, 1),
    ("Sub", {"a": _f(2, 3)}, {"b": _f(2, 1)}, {}, 1),
    ("Mul", {"a": _f(4)}, {"b": _f(4)}, {}, 1),
    ("Div", {"a": _f(4)}, {"b": np.abs(_f(4)) + 1}, {}, 1),
    ("Div", {"a": np.array([7, -7, 9], np.int64)}, {"b": np.array([2, 2, -4], np.int64)}, {}, 1),
    ("Mod", {"a": np.array([7, -7, 9], np.int64)}, {"b": np.array([3, 3, -4], np.int64)}, {}, 1),
    ("Pow", {"a": _f(5)}, {"b": np.array(2.0, np.float32)}, {}, 1),
    ("Pow", {"a": np.abs(_f(5)) + 0.1}, {"b": np.array(0.5, np.float32)}, {}, 1),
    ("MatMul", {"a": _f(2, 3, 4)}, {"b": _f(4, 5)}, {}, 1),
    ("Gemm", {"a": _f(2, 4)}, {"b": _f(5, 4), "c": _f(5)}, {"transB": 1, "alpha": 0.5, "beta": 2.0}, 1),
    ("Conv", {"x": _f(1, 3, 11)}, {"w": _f(4, 3, 3), "b": _f(4)}, {"pads": [1, 1], "strides": [2]}, 1),
    ("Conv", {"x": _f(1, 4, 9)}, {"w": _f(4, 2, 3)}, {"pads": [2, 0], "group": 2, "dilations": [2]}, 1),
    ("Conv", {"x": _f(1, 1, 6, 7)}, {"w": _f(2, 1, 3, 3), "b": _f(2)}, {"pads": [1, 1, 1, 1], "strides": [2, 1]}, 1),
    ("Softmax", {"x": _f(2, 5)}, {}, {"axis": -1}, 1),
    ("LayerNormalization", {"x": _f(2, 3, 6)}, {"s": _f(6), "b": _f(6)}, {"epsilon": 1e-5}, 1),
    ("BatchNormalization", {"x": _f(2, 3, 5)}, {"s": _f(3), "b": _f(3), "m": _f(3), "v": np.abs(_f(3)) + 0.5},
     {"epsilon": 1e-5}, 1),
    ("ReduceMean", {"x": _f(2, 3, 4)}, {}, {"axes": [2], "keepdims": 0}, 1),
    ("ReduceSum", {"x": _f(2, 3, 4)}, {"axes": np.array([-1], np.int64)}, {"keepdims": 1}, 1),
    ("ReduceMax", {"x": _f(2, 3, 4)}, {}, {"axes": [1]}, 1),
    ("ArgMax", {"x": _f(2, 6)}, {}, {"axis": 1, "keepdims": 0}, 1),
    ("Transpose", {"x": _f(2, 3, 4)}, {}, {"perm": [0, 2, 1]}, 1),
    ("Reshape", {"x": _f(2, 3, 4)}, {"s": np.array([0, -1], np.int64)}, {}, 1),
    ("Unsqueeze", {"x": _f(2, 3)}, {"axes": np.array([0, -1], np.int64)}, {}, 1),
    ("Squeeze", {"x": _f(1, 3, 1)}, {"axes": np.array([2], np.int64)}, {}, 1),
    ("Concat", {"a": _f(2, 3)}, {"b": _f(2, 2)}, {"axis": 1}, 1),
    ("Gather", {"x": _f(4, 3)}, {"i": np.array([[0, -1], [2, 1]], np.int64)}, {"axis": 0}, 1),
    ("Slice", {"x": _f(6, 5)}, {"s": np.array([1, -1], np.int64), "e": np.array([5, 0], np.int64),
                                "a": np.array([0, 1], np.int64), "t": np.array([2, -2], np.int64)}, {}, 1),
    ("Split", {"x": _f(2, 7)}, {"split": np.array([3, 4], np.int64)}, {"axis": 1}, 2),
    ("Expand", {"x": _f(3, 1)}, {"s": np.array([2, 3, 4], np.int64)}, {}, 1),
    ("Where", {"c": RNG.random((3, 4)) > 0.5}, {"a": _f(3, 4), "b": _f(4)}, {}, 1),
    ("Pad", {"x": _f(2, 5)}, {"p": np.array([0, 2, 0, 1], np.int64)}, {"mode": "reflect"}, 1),
    ("Pad", {"x": _f(2, 5)}, {"p": np.array([1, 0, 0, 3], np.int64), "v": np.array(1.5, np.float32)}, {}, 1),
    ("Clip", {"x": _f(8)}, {"lo": np.array(-0.5, np.float32), "hi": np.array(0.5, np.float32)}, {}, 1),
    ("Max", {"a": _f(4)}, {"b": _f(4)}, {}, 1),
    ("Erf", {"x": _f(5)}, {}, {}, 1),
    ("Sigmoid", {"x": _f(5)}, {}, {}, 1),
    ("Tanh", {"x": _f(5)}, {}, {}, 1),
    ("Sqrt", {"x": np.abs(_f(5))}, {}, {}, 1),
    ("Round", {"x": np.array([0.5, 1.5, 2.5, -0.5, 0.49], np.float32)}, {}, {}, 1),
    ("Cast", {"x": _f(5) * 3}, {}, {"to": TensorProto.INT64}, 1),
    ("AveragePool", {"x": _f(1, 2, 9)}, {}, {"kernel_shape": [3], "strides": [2], "ceil_mode": 1}, 1),
    ("MaxPool", {"x": _f(1, 2, 9)}, {}, {"kernel_shape": [2], "strides": [2]}, 1),
    ("CumSum", {"x": _f(2, 5)}, {"axis": np.array(1, np.int64)}, {}, 1),
    ("Trilu", {"x": _f(4, 4)}, {"k": np.array(1, np.int64)}, {"upper": 0}, 1),
    ("Range", {}, {"s": np.array(2, np.int64), "l": np.array(11, np.int64), "d": np.array(3, np.int64)}, {}, 1),
    ("Tile", {"x": _f(2, 3)}, {"r": np.array([2, 1], np.int64)}, {}, 1),
    *[(op, {"x": _f(2, 5)}, {}, {}, 1) for op in ("Abs", "Neg", "Exp", "Sin", "Cos", "Floor", "Ceil", "Sign",
                                                  "Softplus", "Relu", "Identity", "Reciprocal")],
    ("Log", {"x": np.abs(_f(6)) + 0.1}, {}, {}, 1),
    ("Dropout", {"x": _f(2, 5)}, {}, {}, 1),
    *[(op, {"a": _f(3, 4)}, {"b": _f(4)}, {}, 1) for op in ("Equal", "Less", "LessOrEqual", "Greater",
                                                            "GreaterOrEqual")],
    ("Equal", {"a": np.array([1, 2, 3], np.int64)}, {"b": np.array([1, 0, 3], np.int64)}, {}, 1),
    *[(op, {"a": RNG.random(6) > 0.5}, {"b": RNG.random(6) > 0.5}, {}, 1) for op in ("And", "Or", "Xor")],
    ("Not", {"a": RNG.random(6) > 0.5}, {}, {}, 1),
    ("Min", {"a": _f(4)}, {"b": _f(4), "c": _f(1)}, {}, 1),
    ("Sum", {"a": _f(2, 4)}, {"b": _f(4), "c": _f(2, 1)}, {}, 1),
    ("ArgMin", {"x": _f(3, 5)}, {}, {"axis": 0, "keepdims": 1}, 1),
    ("ReduceMin", {"x": _f(2, 3, 4)}, {}, {"axes": [0, 2], "keepdims": 0}, 1),
    ("ReduceL2", {"x": _f(2, 3, 4)}, {}, {"axes": [1]}, 1),
    ("ReduceProd", {"x": _f(2, 3, 4)}, {}, {"axes": [0, 2], "keepdims": 0}, 1),
    ("ReduceProd", {"x": np.array([2, 3, 4], np.int64)}, {}, {"keepdims": 0}, 1),  # CAM++'s shape arithmetic
    ("LogSoftmax", {"x": _f(2, 5)}, {}, {"axis": 1}, 1),
    ("InstanceNormalization", {"x": _f(2, 3, 7)}, {"s": _f(3), "b": _f(3)}, {"epsilon": 1e-5}, 1),
    ("GlobalAveragePool", {"x": _f(2, 3, 4, 5)}, {}, {}, 1),
    ("Flatten", {"x": _f(2, 3, 4)}, {}, {"axis": 2}, 1),
    ("Shape", {"x": _f(2, 3, 4)}, {}, {"start": 1}, 1),
    ("ConstantOfShape", {}, {"s": np.array([2, 3], np.int64)},
     {"value": numpy_helper.from_array(np.array([0.25], np.float32))}, 1),
    ("Constant", {}, {}, {"value": numpy_helper.from_array(_f(2, 3))}, 1),
    ("Constant", {}, {}, {"value_ints": [3, 1, 2]}, 1),
]


@pytest.mark.parametrize(("op", "inputs", "inits", "attrs", "num_outputs"), CASES,
                         ids=[f"{case[0]}-{i}" for i, case in enumerate(CASES)])
def test_operator_matches_onnxruntime(tmp_path, op, inputs, inits, attrs, num_outputs):
    outputs = [f"y{i}" for i in range(num_outputs)]
    node = helper.make_node(op, list(inputs) + list(inits), outputs, **attrs)
    out_info = [helper.make_empty_tensor_value_info(name) for name in outputs]  # onnxruntime infers them
    path = _save(tmp_path, op, [node], [_value(k, v) for k, v in inputs.items()], out_info,
                 [_init(k, v) for k, v in inits.items()])
    expected = ort.InferenceSession(str(path)).run(None, inputs)
    got = TorchOnnxGraph(path)({k: torch.from_numpy(v) for k, v in inputs.items()})
    for name, want in zip(outputs, expected, strict=True):
        have = got[name].numpy()
        assert have.shape == want.shape and have.dtype == want.dtype, (have.shape, have.dtype, want.shape, want.dtype)
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("op", "inputs", "inits", "attrs", "num_outputs"), CASES,
                         ids=[f"{case[0]}-{i}" for i, case in enumerate(CASES)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_operator_keeps_its_data_on_the_compute_device(tmp_path, op, inputs, inits, attrs, num_outputs, dtype):
    """On a device other than the CPU ("meta" stands in for CUDA: it has shapes but no data), float work runs
    there in the compute dtype while shape arithmetic stays on the CPU; reading a device value for a shape
    would fail here."""
    outputs = [f"y{i}" for i in range(num_outputs)]
    node = helper.make_node(op, list(inputs) + list(inits), outputs, **attrs)
    out_info = [helper.make_empty_tensor_value_info(name) for name in outputs]
    path = _save(tmp_path, op, [node], [_value(k, v) for k, v in inputs.items()], out_info,
                 [_init(k, v) for k, v in inits.items()])
    expected = ort.InferenceSession(str(path)).run(None, inputs)
    got = TorchOnnxGraph(path, "meta", dtype)({k: torch.from_numpy(v) for k, v in inputs.items()})
    for name, want in zip(outputs, expected, strict=True):
        assert tuple(got[name].shape) == want.shape
        if want.dtype == np.float32 and got[name].numel() > 1:
            assert got[name].device.type == "meta" and got[name].dtype == dtype


def test_an_unsupported_operator_is_refused_at_load(tmp_path):
    node = helper.make_node("Einsum", ["a", "b"], ["y"], equation="ij,jk->ik")
    path = _save(tmp_path, "einsum", [node], [_value("a", _f(2, 3)), _value("b", _f(3, 2))],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])])
    with pytest.raises(UnsupportedGraph, match="Einsum"):
        TorchOnnxGraph(path)


def _tokenizer_like(tmp_path: Path, name: str, kernel: int, channels: int = 6) -> Path:
    """feats [1, C, T] + feats_length [1] -> int64 codes [1, ceil(T/2)]: a stride-2 conv, then argmax over
    channels, cut to ceil(feats_length[0] / 2) like the official tokenizer. kernel 1 never reads a
    neighbour frame (padding-safe); kernel 5 reads beyond the last frame (not padding-safe)."""
    pads = [(kernel - 1) // 2] * 2
    nodes = [
        helper.make_node("Conv", ["feats", "w"], ["h"], strides=[2], pads=pads),
        helper.make_node("ArgMax", ["h"], ["codes"], axis=1, keepdims=0),
        helper.make_node("Cast", ["feats_length"], ["lengths"], to=TensorProto.INT64),
        helper.make_node("Gather", ["lengths", "zero"], ["len64"], axis=0),
        helper.make_node("Add", ["len64", "one"], ["len_up"]),
        helper.make_node("Div", ["len_up", "two"], ["out_len"]),
        helper.make_node("Slice", ["codes", "zero", "out_len", "one"], ["indices"]),
    ]
    inits = [_init("w", _f(channels, 128, kernel)), _init("one", np.array([1], np.int64)),
             _init("two", np.array([2], np.int64)), _init("zero", np.array([0], np.int64))]
    feats = helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"])
    length = helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])
    out = helper.make_tensor_value_info("indices", TensorProto.INT64, [1, "N"])
    return _save(tmp_path, name, nodes, [feats, length], [out], inits)


def test_a_padding_safe_graph_runs_padded_and_slices_each_row(tmp_path):
    path = _tokenizer_like(tmp_path, "safe", kernel=1)
    graph = BatchedGraph(TorchOnnxGraph(path), sequence_axis=2)
    assert graph.probe_batching(channels=128) == "padded"
    assert graph.frames_per_output == 2
    session = ort.InferenceSession(str(path))
    feats = [torch.from_numpy(_f(128, t)) for t in (37, 90, 41, 64)]
    rows = graph.run(feats)
    for f, row in zip(feats, rows, strict=True):
        want = session.run(None, {"feats": f[None].numpy(), "feats_length": np.array([f.shape[1]], np.int32)})[0]
        assert row.shape[0] == -(-f.shape[1] // 2)
        np.testing.assert_array_equal(row.numpy(), want[0])


def test_a_graph_that_reads_its_padding_is_batched_by_length_only(tmp_path):
    path = _tokenizer_like(tmp_path, "unsafe", kernel=5)
    graph = BatchedGraph(TorchOnnxGraph(path), sequence_axis=2)
    assert graph.probe_batching(channels=128) == "same_length"
    session = ort.InferenceSession(str(path))
    feats = [torch.from_numpy(_f(128, t)) for t in (37, 37, 41)]
    for f, row in zip(feats, graph.run(feats), strict=True):
        want = session.run(None, {"feats": f[None].numpy(), "feats_length": np.array([f.shape[1]], np.int32)})[0]
        np.testing.assert_array_equal(row.numpy(), want[0])


def test_a_graph_fixed_to_batch_one_runs_prompt_by_prompt(tmp_path):
    nodes = [helper.make_node("ReduceMean", ["input"], ["m"], axes=[1], keepdims=0),
             helper.make_node("Reshape", ["m", "shape"], ["output"])]
    inits = [_init("shape", np.array([1, 80], np.int64))]
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])]
    path = _save(tmp_path, "batch_one", nodes, inputs,
                 [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 80])], inits)
    graph = BatchedGraph(TorchOnnxGraph(path), sequence_axis=1)
    assert graph.probe_batching(channels=80) == "single"
    feats = [torch.from_numpy(_f(80, t)) for t in (30, 30, 12)]
    for f, row in zip(feats, graph.run(feats), strict=True):
        torch.testing.assert_close(row, f.mean(dim=1))


def _masked_tokenizer(tmp_path: Path, channels: int = 8) -> Path:
    """A whisper-style tokenizer in miniature: feats [B, 128, T] and feats_length [B]; each of two stride-2
    convs reads its input multiplied by the length mask (as the released encoder does), so padding never
    reaches a valid frame; argmax codes cut to ceil(feats_length[0] / 4)."""
    nodes, inits = [], [_init("zero", np.array(0, np.int64)), _init("one", np.array(1, np.int64)),
                        _init("two", np.array(2, np.int64)), _init("axis1", np.array([1], np.int64)),
                        _init("axis2", np.array([2], np.int64)), _init("first", np.array([0], np.int64)),
                        _init("w1", _f(channels, 128, 3)), _init("w2", _f(channels, channels, 3))]
    nodes.append(helper.make_node("Cast", ["feats_length"], ["len0"], to=TensorProto.INT64))

    def masked(x: str, lengths: str, out: str) -> None:
        nodes.extend([
            helper.make_node("Shape", [x], [f"{out}_shape"]),
            helper.make_node("Gather", [f"{out}_shape", "two"], [f"{out}_frames"], axis=0),
            helper.make_node("Range", ["zero", f"{out}_frames", "one"], [f"{out}_range"]),
            helper.make_node("Unsqueeze", [lengths, "axis1"], [f"{out}_len_col"]),
            helper.make_node("Less", [f"{out}_range", f"{out}_len_col"], [f"{out}_keep"]),
            helper.make_node("Cast", [f"{out}_keep"], [f"{out}_keepf"], to=TensorProto.FLOAT),
            helper.make_node("Unsqueeze", [f"{out}_keepf", "axis1"], [f"{out}_mask"]),
            helper.make_node("Mul", [x, f"{out}_mask"], [out]),
        ])

    def halve(lengths: str, out: str) -> None:  # ceil(len / 2) of a stride-2 conv with kernel 3, pad 1
        nodes.extend([helper.make_node("Add", [lengths, "one"], [f"{out}_up"]),
                      helper.make_node("Div", [f"{out}_up", "two"], [out])])

    masked("feats", "len0", "x0")
    nodes.append(helper.make_node("Conv", ["x0", "w1"], ["c1"], strides=[2], pads=[1, 1]))
    nodes.append(helper.make_node("Relu", ["c1"], ["r1"]))
    halve("len0", "len1")
    masked("r1", "len1", "x1")
    nodes.append(helper.make_node("Conv", ["x1", "w2"], ["c2"], strides=[2], pads=[1, 1]))
    halve("len1", "len2")
    nodes.extend([helper.make_node("ArgMax", ["c2"], ["codes"], axis=1, keepdims=0),
                  helper.make_node("Gather", ["len2", "first"], ["n_out"], axis=0),
                  helper.make_node("Slice", ["codes", "first", "n_out", "axis1"], ["indices"])])
    feats = helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"])
    length = helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])
    out = helper.make_tensor_value_info("indices", TensorProto.INT64, [1, "N"])
    return _save(tmp_path, "masked", nodes, [feats, length], [out], inits)


def test_a_length_masked_encoder_batches_prompts_of_any_length(tmp_path):
    path = _masked_tokenizer(tmp_path)
    graph = BatchedGraph(TorchOnnxGraph(path), sequence_axis=2)
    assert graph.probe_batching(channels=128) == "padded"
    assert graph.frames_per_output == 4
    session = ort.InferenceSession(str(path))
    feats = [torch.from_numpy(_f(128, t)) for t in (53, 120, 121, 66, 67)]
    for f, row in zip(feats, graph.run(feats), strict=True):
        want = session.run(None, {"feats": f[None].numpy(), "feats_length": np.array([f.shape[1]], np.int32)})[0]
        np.testing.assert_array_equal(row.numpy(), want[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_length_masked_encoder_keeps_its_masks_arithmetic_off_the_device(tmp_path, dtype):
    """On "meta" (standing in for CUDA) the length masks are built on the CPU and meet the device tensors there."""
    graph = TorchOnnxGraph(_masked_tokenizer(tmp_path), "meta", dtype)
    out = graph({"feats": torch.randn(3, 128, 90), "feats_length": torch.tensor([90, 61, 7], dtype=torch.int32)})
    assert tuple(out["indices"].shape) == (3, -(-90 // 4))
