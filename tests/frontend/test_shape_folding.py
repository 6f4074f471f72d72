"""Shape folding in the ONNX-in-torch runner (frontend/onnx_torch.py `ShapeFolding`): a folded call gives exactly
what the plain interpretation of every node gives, on the fixture sets' graphs and on graphs of the released
architectures, for new, repeated and evicted input shapes; a cached shape runs the compute nodes alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from cosystream.frontend.onnx_torch import TorchOnnxGraph
from cosystream.frontend.shape_folding import SHAPE_ARGUMENTS, shape_determined
from cosystream.testing.realistic_side_models import write_campplus, write_speech_tokenizer

TOKENIZER_FRAMES = (203, 161, 203, 97, 161)  # new, new, repeated, new, repeated
SPEAKER_FRAMES = (251, 130, 251, 131, 77, 130)


@pytest.fixture(scope="module")
def realistic(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("folding_realistic")
    return {"v2": write_speech_tokenizer(root / "speech_tokenizer_v2.onnx", "v2", "small", seed=31),
            "v3": write_speech_tokenizer(root / "speech_tokenizer_v3.onnx", "v3", "small", seed=32),
            "campplus": write_campplus(root / "campplus.onnx", "small", seed=33)}


def _fixture_models(fixture_dir: Path) -> list[Path]:
    cv3 = Path(os.environ.get("COSYSTREAM_FIXTURES_CV3",
                              str(Path(__file__).resolve().parents[1] / "fixtures" / "cosyvoice3-tiny")))
    return [fixture_dir / "model", cv3 / "model"]


def _inputs(graph: TorchOnnxGraph, frames: int, batch: int, seed: int) -> dict[str, torch.Tensor]:
    """The official side models' interfaces: [B, 128, T] + lengths (tokenizer) or [B, T, 80] (CAM++)."""
    gen = torch.Generator().manual_seed(seed)
    if len(graph.input_names) == 2:
        feats, lengths = graph.input_names
        shorter = [frames - 7 * i for i in range(batch)]  # padded rows: each its own length
        return {feats: torch.randn(batch, 128, frames, generator=gen),
                lengths: torch.tensor(shorter, dtype=torch.int32)}
    return {graph.input_names[0]: torch.randn(batch, frames, 80, generator=gen)}


def _check_equal_to_plain(path: Path, frames: tuple[int, ...], capacity: int | None = None) -> TorchOnnxGraph:
    plain, folded = TorchOnnxGraph(path, fold_shapes=False), TorchOnnxGraph(path)
    if capacity is not None:
        assert folded.folding is not None
        folded.folding.capacity = capacity
    seen: set[tuple[int, int]] = set()
    for seed, (count, batch) in enumerate((t, b) for t in frames for b in (1, 2)):
        inputs = _inputs(plain, count, batch, seed)
        want = plain(inputs)
        got = folded(inputs)
        for name in plain.output_names:
            assert torch.equal(got[name], want[name]), f"{path.name}: {name} differs at T={count}, B={batch}"
        cached = (count, batch) in seen and capacity is None
        assert folded.stats.shape_cached == cached
        if cached:
            assert folded.stats.ops_run == folded.node_counts["compute"]
        else:
            assert folded.node_counts["compute"] <= folded.stats.ops_run <= folded.node_counts["plan"]
        seen.add((count, batch))
    return folded


@pytest.mark.parametrize("name", ["v2", "v3", "campplus"])
def test_folding_equals_the_plain_interpretation_on_realistic_graphs(realistic, name):
    frames = SPEAKER_FRAMES if name == "campplus" else TOKENIZER_FRAMES
    folded = _check_equal_to_plain(realistic[name], frames)
    counts = folded.node_counts
    # a real export: about as many shape nodes as compute nodes, and a cached shape runs none of them
    assert counts["compute"] < 0.8 * counts["plan"]


def test_a_new_length_recomputes_only_the_shape_values_that_depend_on_it(realistic):
    graph = TorchOnnxGraph(realistic["campplus"])
    graph(_inputs(graph, 251, 1, 0))
    assert graph.stats.ops_run == graph.node_counts["plan"] and graph.stats.values_reused == 0
    graph(_inputs(graph, 252, 1, 1))
    assert graph.stats.values_reused > 0
    assert graph.node_counts["compute"] < graph.stats.ops_run < graph.node_counts["plan"]


def test_folding_equals_the_plain_interpretation_on_the_fixture_graphs(fixture_dir):
    for model in _fixture_models(fixture_dir):
        _check_equal_to_plain(next(model.glob("speech_tokenizer_v*.onnx")), TOKENIZER_FRAMES)
        _check_equal_to_plain(model / "campplus.onnx", SPEAKER_FRAMES)


def test_the_cache_keeps_only_its_capacity_and_stays_exact(realistic):
    graph = _check_equal_to_plain(realistic["campplus"], SPEAKER_FRAMES, capacity=2)
    assert graph.folding is not None and len(graph.folding) == 2


@pytest.mark.parametrize("name", ["v2", "campplus"])
def test_folded_calls_read_no_device_value(realistic, name):
    """On "meta" (shapes, no data: a device tensor read back would raise) both the folding call and the cached
    call run: the shape arithmetic never waits for the device."""
    graph = TorchOnnxGraph(realistic[name], "meta")
    for seed, frames in enumerate((203, 204, 203)):
        out = graph(_inputs(graph, frames, 2, seed))[graph.output_names[0]]
        assert out.shape[0] == 2
    assert graph.stats.shape_cached


def _save(tmp_path: Path, nodes, inputs, outputs, inits) -> Path:
    graph = helper.make_graph(nodes, "folding", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "folding.onnx"
    onnx.save(model, str(path))
    return path


def test_shape_determined_marks_shape_arithmetic_only(tmp_path):
    """x [B, T] -> reshape to [B, T/2, 2] computed from Shape; n (an int input) -> Cast: a value, not a shape."""
    import numpy as np

    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["b"]),
             helper.make_node("Unsqueeze", ["b", "zero"], ["b1"]),
             helper.make_node("Concat", ["b1", "minus_one", "two"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["y"]),
             helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["y", "nf"], ["out"])]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
             numpy_helper.from_array(np.array([2], np.int64), "two")]
    path = _save(tmp_path, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T"]),
                                   helper.make_tensor_value_info("n", TensorProto.INT64, [1])],
                 [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    graph = TorchOnnxGraph(path)
    flags = shape_determined(graph.nodes, set(graph.constants), set(graph.input_names), set(graph.output_names))
    assert flags == [True, True, True, True, False, False, False]
    x = torch.randn(3, 8)
    for n in (2, 5):  # the int input's value changes, its shape does not: the result follows the value
        out = graph({"x": x, "n": torch.tensor([n])})["out"]
        assert torch.equal(out, x.reshape(3, 4, 2) * n)
    assert graph.stats.shape_cached and graph.stats.ops_run == 3


def test_a_new_length_starts_from_the_nearest_cached_one(realistic):
    """From a folding of 251 frames, 131 frames re-derives more than from one of 130 (the stride and the
    segment count of CAM++'s context pooling differ from 251's, not from 130's); the results are exact."""
    plain = TorchOnnxGraph(realistic["campplus"], fold_shapes=False)
    ops = []
    for history in ((251,), (251, 130)):
        graph = TorchOnnxGraph(realistic["campplus"])
        for seed, frames in enumerate(history):
            graph(_inputs(graph, frames, 1, seed))
        inputs = _inputs(graph, 131, 1, 99)
        assert torch.equal(graph(inputs)["output"], plain(inputs)["output"])
        ops.append(graph.stats.ops_run)
    assert ops[1] < ops[0]


def test_calls_on_several_threads_share_the_fold_cache_exactly(realistic):
    from concurrent.futures import ThreadPoolExecutor

    plain, folded = TorchOnnxGraph(realistic["campplus"], fold_shapes=False), TorchOnnxGraph(realistic["campplus"])
    folded.folding.capacity = 3  # evictions while other threads read
    work = [(frames, seed) for seed, frames in enumerate((120, 121, 120, 180, 121, 122, 180, 120) * 2)]

    def call(item: tuple[int, int]) -> bool:
        inputs = _inputs(plain, item[0], 1, item[1])
        return torch.equal(folded(inputs)["output"], plain(inputs)["output"])

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(call, work))


def test_a_shape_set_by_an_input_value_is_not_folded(tmp_path):
    """x [B, T] cut to its first n frames, n an int input (as a mask of max(lengths) frames): the cut's shape
    follows n's value, so the Shape node that reads it runs on every call, and each call gives its own n."""
    import numpy as np

    nodes = [helper.make_node("Unsqueeze", ["n", "zero"], ["end"]),
             helper.make_node("Slice", ["x", "start", "end", "one"], ["cut"]),
             helper.make_node("Shape", ["cut"], ["s"]),
             helper.make_node("Gather", ["s", "one_scalar"], ["frames"]),
             helper.make_node("Cast", ["frames"], ["frames_f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["cut", "frames_f"], ["out"])]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "start"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array(1, np.int64), "one_scalar")]
    path = _save(tmp_path, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T"]),
                                   helper.make_tensor_value_info("n", TensorProto.INT64, [])],
                 [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    graph = TorchOnnxGraph(path)
    assert shape_determined(graph.nodes, set(graph.constants), set(graph.input_names),
                            set(graph.output_names)) == [False] * 6
    x = torch.randn(2, 9)
    for n in (5, 3, 5):  # the same input shapes each time
        out = graph({"x": x, "n": torch.tensor(n)})["out"]
        assert torch.equal(out, x[:, :n] * n)


def test_every_operator_is_placed_for_the_folding():
    """An operator whose output shape an input's value sets must be in SHAPE_ARGUMENTS; these are the ones whose
    output shape follows from their inputs' shapes and attributes. A new operator must be placed in one."""
    from cosystream.frontend.onnx_torch import SUPPORTED_OPS

    shapes_only = {
        "Add", "Sub", "Mul", "Div", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor",
        "Mod", "Pow", "Max", "Min", "Sum", "Not", "Neg", "Abs", "Sqrt", "Reciprocal", "Exp", "Log", "Erf", "Tanh",
        "Sigmoid", "Relu", "Sin", "Cos", "Floor", "Ceil", "Round", "Sign", "Softplus", "Identity", "Dropout",
        "Where", "Cast", "Clip", "Flatten", "Transpose", "Concat", "Gather", "Shape", "Trilu", "CumSum", "Conv",
        "MatMul", "Gemm", "Softmax", "LogSoftmax", "LayerNormalization", "BatchNormalization",
        "InstanceNormalization", "ArgMax", "ArgMin", "MaxPool", "AveragePool", "GlobalAveragePool", "Constant"}
    assert set(SHAPE_ARGUMENTS) | shapes_only == set(SUPPORTED_OPS)
    assert not set(SHAPE_ARGUMENTS) & shapes_only
