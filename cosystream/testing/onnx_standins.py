"""Tiny random ONNX models with the official interfaces of the two CosyVoice2 side models.

speech_tokenizer_v2: feats [1,128,T] float32 + feats_length [1] int32 -> indices [1, ceil(T/4)] int64
(an 8-digit base-3 code per 4 frames, like the real FSQ). campplus: [1,T,80] -> [1,192].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

_OPSET = 17


def _save(graph: onnx.GraphProto, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def write_speech_tokenizer(path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    weights = numpy_helper.from_array((rng.standard_normal((128, 8)) * 0.3).astype(np.float32), "w")
    powers = numpy_helper.from_array((3.0 ** np.arange(8)).astype(np.float32), "powers")
    scale = numpy_helper.from_array(np.array(2.999, dtype=np.float32), "scale")
    axes = numpy_helper.from_array(np.array([-1], dtype=np.int64), "axes")
    nodes = [
        helper.make_node("AveragePool", ["feats"], ["pooled"], kernel_shape=[4], strides=[4], ceil_mode=1),
        helper.make_node("Transpose", ["pooled"], ["frames"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["frames", "w"], ["proj"]),
        helper.make_node("Sigmoid", ["proj"], ["unit"]),
        helper.make_node("Mul", ["unit", "scale"], ["scaled"]),
        helper.make_node("Floor", ["scaled"], ["digits"]),
        helper.make_node("Mul", ["digits", "powers"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted", "axes"], ["code"], keepdims=0),
        helper.make_node("Cast", ["code"], ["indices"], to=TensorProto.INT64),
    ]
    graph = helper.make_graph(
        nodes, "speech_tokenizer_standin",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
         helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])],
        [helper.make_tensor_value_info("indices", TensorProto.INT64, [1, "N"])],
        initializer=[weights, powers, scale, axes])
    _save(graph, path)


def write_campplus(path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed + 1)
    weights = numpy_helper.from_array((rng.standard_normal((80, 192)) * 0.1).astype(np.float32), "w")
    nodes = [
        helper.make_node("ReduceMean", ["input"], ["mean"], axes=[1], keepdims=0),
        helper.make_node("MatMul", ["mean", "w"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes, "campplus_standin",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 192])],
        initializer=[weights])
    _save(graph, path)
