"""The batched CAM++ network (frontend/campplus.py) against onnxruntime and against itself unbatched.

The graph is the reduced-width export of the released architecture (cosystream/testing/realistic_side_models.py,
size "small": every layer type, fewer channels and layers); the fixture sets' campplus.onnx are stand-ins with
only the official interface, which the loader must refuse, leaving the interpreter in charge.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from cosystream.checkpoint.hparams import _mel_dims, _Reader, read_hyperpyyaml
from cosystream.frontend.audio import speaker_features
from cosystream.frontend.campplus import (
    SEGMENT_FRAMES,
    XVECTOR_ATOL,
    XVECTOR_RTOL,
    CamPlusPlus,
    NotCamPlusPlus,
    load_fast_campplus,
)
from cosystream.frontend.onnx_torch import TorchOnnxGraph
from cosystream.frontend.speaker import SpeakerEncoder
from cosystream.frontend.torch_prompt import BATCH_MODES, TorchPromptAnalyzer
from cosystream.testing.realistic_side_models import EXPORT_OPSET, campplus_net, write_campplus

BATCH_RTOL = 1e-5  # a prompt in a padded batch vs alone: only the convolutions' blocking may differ
BATCH_ATOL = 1e-6
# fbank frames of a batch: after the TDNN's stride (ceil(T / 2)) one frame short of a segment, exactly one and
# two segments, one frame into the next, a 7-frame tail, and a prompt shorter than a segment; odd and even T
S = SEGMENT_FRAMES
DISTINCT_FRAMES = (2 * S - 2, 2 * S - 1, 2 * S, 2 * S + 1, 4 * S, 4 * S + 13, S // 2 + 1)


@pytest.fixture(scope="module")
def campplus_path(tmp_path_factory) -> Path:
    return write_campplus(tmp_path_factory.mktemp("campplus") / "campplus.onnx", "small", seed=31)


@pytest.fixture(scope="module")
def graph(campplus_path: Path) -> TorchOnnxGraph:
    return TorchOnnxGraph(campplus_path)


@pytest.fixture(scope="module")
def module(graph: TorchOnnxGraph) -> CamPlusPlus:
    return CamPlusPlus.from_graph(graph)


def _onnxruntime(path: Path, feats: list[torch.Tensor]) -> list[torch.Tensor]:
    session = ort.InferenceSession(str(path))
    name = session.get_inputs()[0].name
    return [torch.from_numpy(session.run(None, {name: f.T[None].numpy()})[0].reshape(-1)) for f in feats]


def _random_feats(frames: tuple[int, ...], seed: int, bins: int = 80) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [2.0 * torch.randn(bins, t, generator=gen) for t in frames]


def _assert_xvectors_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=XVECTOR_ATOL, rtol=XVECTOR_RTOL)


def test_the_module_reads_the_architecture_sizes_from_the_graph(module):
    net = campplus_net("small", seed=31)  # the sizes the export was made with, read back from the network
    dense = [m for m in net.xvector if type(m).__name__ == "_DenseLayer"]
    assert module.head_conv1.weight.shape[0] == net.head.conv1.out_channels
    assert module.tdnn.weight.shape[0] == net.xvector[0].out_channels
    assert sum(len(b.layers) for b in module.blocks) == len(dense) and len(module.blocks) == 3
    assert [layer.local.dilation[0] for b in module.blocks for layer in b.layers] == \
        [d.cam.local.dilation[0] for d in dense]
    assert module.embedding_size == net.embed.out_channels


def test_speech_embeddings_equal_onnxruntime(campplus_path, module, speech_like):
    feats = [speaker_features(torch.from_numpy(speech_like(s, 16000, seed=i))).T for i, s in
             enumerate((0.9, 2.13, 4.41))]
    want = _onnxruntime(campplus_path, feats)
    _assert_xvectors_close([module.embed([f])[0] for f in feats], want)  # one at a time
    _assert_xvectors_close(module.embed(feats), want)  # one batch


def test_a_batch_of_distinct_lengths_equals_each_prompt_alone(campplus_path, module):
    feats = _random_feats(DISTINCT_FRAMES, seed=5)
    batched = module.embed(feats)
    alone = [module.embed([f])[0] for f in feats]
    for a, b in zip(batched, alone, strict=True):
        torch.testing.assert_close(a, b, rtol=BATCH_RTOL, atol=BATCH_ATOL)
    _assert_xvectors_close(batched, _onnxruntime(campplus_path, feats))


def test_a_burst_over_the_frame_budget_runs_in_calls_of_similar_lengths(module, monkeypatch):
    from cosystream.frontend import campplus

    lengths = [f.shape[-1] for f in _random_feats(DISTINCT_FRAMES, seed=0)]
    budget = 3 * max(lengths)
    groups = campplus.batch_groups(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths))) and len(groups) > 1
    assert all(len(g) * max(lengths[i] for i in g) <= budget for g in groups)
    assert [lengths[g[0]] for g in groups] == sorted((lengths[g[0]] for g in groups), reverse=True)
    assert campplus.batch_groups([5 * budget, 1], budget) == [[0], [1]]  # too long for the budget: alone

    feats = _random_feats(DISTINCT_FRAMES, seed=11)
    whole = module.embed(feats)
    monkeypatch.setattr(campplus, "MAX_BATCH_FRAMES", budget)
    for a, b in zip(module.embed(feats), whole, strict=True):
        torch.testing.assert_close(a, b, rtol=BATCH_RTOL, atol=BATCH_ATOL)


def test_calls_padded_to_graph_buckets_give_the_same_embeddings(graph, module):
    """With `cuda_graphs` a call's rows and frames are padded to shape buckets (on the CPU the padded call runs
    eagerly: the same code the captured graph records): filler rows and extra frames change no embedding."""
    bucketed = CamPlusPlus.from_graph(graph, cuda_graphs=True)
    rows, frames = bucketed.padded_size(5, 2 * S + 1)
    assert rows >= 5 and frames >= 2 * S + 1 and frames % S == 0
    for seed, count in ((12, 5), (13, 3)):  # two batches of one bucket shape, then another
        feats = _random_feats(DISTINCT_FRAMES[:count], seed=seed)
        for a, b in zip(bucketed.embed(feats), module.embed(feats), strict=True):
            torch.testing.assert_close(a, b, rtol=BATCH_RTOL, atol=BATCH_ATOL)


class _ReplayedCall:
    """A stand-in for a captured CUDA graph on the CPU: replaying recomputes into the captured output, from the
    captured (static) inputs, as a graph replay does."""

    def __init__(self, compute, feats: torch.Tensor, static: list[torch.Tensor], out: torch.Tensor) -> None:
        self.compute, self.feats, self.static, self.out = compute, feats, static, out

    def replay(self) -> None:
        self.out.copy_(self.compute(self.feats, *self.static))


def test_graphed_calls_read_the_shared_buffer_and_fresh_masks(graph, module, monkeypatch):
    """The CUDA-graph plumbing on the CPU (`_GraphedCalls` with its captures emulated): each bucket is captured
    once, and a later call of a bucket replays it with its own features and masks, not the captured call's."""
    from cosystream.frontend import campplus

    def capture(self, key, masks):
        static = [m.clone() for m in masks]
        out = torch.empty(key[0], module.embedding_size)  # a graph's output buffer: written by its replays only
        return _ReplayedCall(self.compute, self.features(*key), static, out), static, out

    monkeypatch.setattr(campplus._GraphedCalls, "_capture", capture)
    graphed = CamPlusPlus.from_graph(graph, cuda_graphs=True)
    graphed._graphs = campplus._GraphedCalls(graphed.compute, graphed.device, graphed.dtype, graphed.bins)
    assert graphed.capture_buckets(max_frames=3 * S - 7, max_rows=3) == 3 * 3  # rows 1, 2, 4 x 1-3 s
    batches = ((2 * S + 1, S + 3, 2 * S - 9), (3 * S - 10, 2 * S + 50, S + 20), (S - 1,))  # 1st, 2nd: one bucket
    assert graphed.padded_size(3, 2 * S + 1) == graphed.padded_size(3, 3 * S - 10)
    for seed, frames in enumerate(batches):
        feats = _random_feats(frames, seed=20 + seed)
        for a, b in zip(graphed.embed(feats), module.embed(feats), strict=True):
            torch.testing.assert_close(a, b, rtol=BATCH_RTOL, atol=BATCH_ATOL)
    assert len(graphed._graphs.graphs) == 9  # every call replayed a bucket captured before


def test_the_padding_is_never_read(module):
    feats = _random_feats(DISTINCT_FRAMES, seed=6)
    longest = max(DISTINCT_FRAMES)
    zeros = torch.zeros(len(feats), 80, longest)
    noisy = 1e3 * torch.randn(len(feats), 80, longest, generator=torch.Generator().manual_seed(7))
    for row, f in enumerate(feats):
        zeros[row, :, : f.shape[-1]] = f
        noisy[row, :, : f.shape[-1]] = f
    assert torch.equal(module(zeros, DISTINCT_FRAMES), module(noisy, DISTINCT_FRAMES))


def _renamed(path: Path, out: Path) -> Path:
    """The graph with every initializer under an opaque name, in reversed order, as an exporter may name them."""
    model = onnx.load(str(path))
    names = {init.name: f"onnx::param_{i}" for i, init in enumerate(reversed(model.graph.initializer))}
    for init in model.graph.initializer:
        init.name = names[init.name]
    for node in model.graph.node:
        node.input[:] = [names.get(name, name) for name in node.input]
    onnx.save(model, str(out))
    return out


def test_loading_does_not_depend_on_initializer_names(campplus_path, module, tmp_path):
    renamed = CamPlusPlus.from_graph(TorchOnnxGraph(_renamed(campplus_path, tmp_path / "renamed.onnx")))
    feats = _random_feats((2 * S + 3, S - 5), seed=8)
    for a, b in zip(renamed.embed(feats), module.embed(feats), strict=True):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def unfolded_path(tmp_path_factory) -> Path:
    """CAM++ exported without constant folding: every batch norm stays a node."""
    path = tmp_path_factory.mktemp("campplus_unfolded") / "campplus.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(campplus_net("small", seed=32), (torch.randn(1, 151, 80),), str(path),
                          input_names=["input"], output_names=["output"], dynamic_axes={"input": {1: "T"}},
                          opset_version=EXPORT_OPSET["campplus"], dynamo=False, do_constant_folding=False)
    return path


def test_batch_norms_the_exporter_did_not_fold_are_folded_at_load(unfolded_path):
    ops = [node.op_type for node in onnx.load(str(unfolded_path)).graph.node]
    assert ops.count("BatchNormalization") > ops.count("Conv") // 2  # the norms after convolutions are nodes
    module, reason = load_fast_campplus(TorchOnnxGraph(unfolded_path))
    assert reason is None and module is not None
    feats = _random_feats((2 * S + 1, S + 2), seed=9)
    _assert_xvectors_close(module.embed(feats), _onnxruntime(unfolded_path, feats))


def test_the_output_norm_is_applied_where_its_convolution_has_another_reader(unfolded_path, tmp_path):
    """The last transition's convolution read twice: its batch norm cannot be folded by dataflow and follows it
    as a node of its own, which the loader recognises as the output norm."""
    def second_reader(graph) -> None:
        convs = [n for n in graph.node if n.op_type == "Conv"]
        transit = convs[-2].output[0]  # the last convolution is the embedding layer
        graph.node.append(onnx.helper.make_node("Identity", [transit], ["unused_copy"]))

    path = _edited(unfolded_path, tmp_path / "read_twice.onnx", second_reader)
    module, reason = load_fast_campplus(TorchOnnxGraph(path))
    assert reason is None and module is not None
    feats = _random_feats((2 * S - 3, S + 9), seed=14)
    _assert_xvectors_close(module.embed(feats), _onnxruntime(path, feats))


def _edited(path: Path, out: Path, edit) -> Path:
    model = onnx.load(str(path))
    edit(model.graph)
    onnx.save(model, str(out))
    return out


def test_another_structure_is_refused_with_the_place_it_differs(campplus_path, tmp_path):
    def unstrided_tdnn(graph) -> None:
        conv1d = [n for n in graph.node if n.op_type == "Conv" and len(_attr(n, "kernel_shape")) == 1]
        _attr(conv1d[0], "strides")[:] = [1]

    path = _edited(campplus_path, tmp_path / "unstrided.onnx", unstrided_tdnn)
    with pytest.raises(NotCamPlusPlus, match="the TDNN layer with strides \\[2\\] expected"):
        CamPlusPlus.from_graph(TorchOnnxGraph(path))


def _attr(node, name: str):
    return next(a for a in node.attribute if a.name == name).ints


def test_a_graph_the_module_does_not_reproduce_keeps_the_interpreter(campplus_path, tmp_path, caplog):
    """The same parameters with another gate function between them: the structure matches, the self-check
    against the interpreter does not."""
    def tanh_gates(graph) -> None:
        for node in graph.node:
            if node.op_type == "Sigmoid":
                node.op_type = "Tanh"

    path = _edited(campplus_path, tmp_path / "tanh.onnx", tanh_gates)
    graph = TorchOnnxGraph(path)
    CamPlusPlus.from_graph(graph)  # the structure is the released one
    with caplog.at_level(logging.WARNING, logger="cosystream.frontend.campplus"):
        module, reason = load_fast_campplus(graph)
    assert module is None and "does not reproduce the graph" in reason
    assert "stays on the ONNX interpreter" in caplog.text


def test_an_unforeseen_reading_error_leaves_the_interpreter_in_charge(graph, monkeypatch):
    def fails(cls, graph, cuda_graphs=False):
        raise KeyError("a tensor the reader did not expect")

    monkeypatch.setattr(CamPlusPlus, "from_graph", classmethod(fails))
    module, reason = load_fast_campplus(graph)
    assert module is None and "reading it failed: KeyError" in reason


def test_float32_only(campplus_path):
    module, reason = load_fast_campplus(TorchOnnxGraph(campplus_path, dtype=torch.bfloat16))
    assert module is None and "float32" in reason


def test_the_analyzer_runs_all_prompts_in_one_call_of_the_module(campplus_path, graph, speech_like, fixture_dir,
                                                                monkeypatch):
    from cosystream.frontend import campplus as campplus_module

    tokenizer = next((fixture_dir / "model").glob("speech_tokenizer_v*.onnx"))
    analyzer = TorchPromptAnalyzer(tokenizer, campplus_path, _fixture_mel_dims(fixture_dir))
    assert analyzer.speaker_mode == "campplus_module" and analyzer.speaker_fallback is None
    calls = []
    masks = campplus_module.CamPlusPlus.masks  # built once per call, from the call's prompt lengths
    monkeypatch.setattr(campplus_module.CamPlusPlus, "masks",
                        lambda self, lengths, frames: calls.append(list(lengths)) or masks(self, lengths, frames))
    wavs = [torch.from_numpy(speech_like(s, 16000, seed=i)) for i, s in enumerate((0.71, 1.52, 2.33))]
    xvectors = analyzer.embed(wavs)
    assert len(calls) == 1 and len(set(calls[0])) == len(wavs)
    speaker = SpeakerEncoder(campplus_path)
    _assert_xvectors_close(xvectors, [speaker.embed(w) for w in wavs])


def test_a_stand_in_graph_is_refused_and_the_analyzer_keeps_the_interpreter(fixture_dir, speech_like):
    model = fixture_dir / "model"
    module, reason = load_fast_campplus(TorchOnnxGraph(model / "campplus.onnx"))
    assert module is None and reason.startswith("campplus.onnx: not the CAM++ architecture: ")
    analyzer = TorchPromptAnalyzer(next(model.glob("speech_tokenizer_v*.onnx")), model / "campplus.onnx",
                                   _fixture_mel_dims(fixture_dir))
    assert analyzer.speaker_mode in BATCH_MODES and analyzer.speaker_fallback == reason
    wavs = [torch.from_numpy(speech_like(s, 16000, seed=i)) for i, s in enumerate((0.8, 1.9))]
    speaker = SpeakerEncoder(model / "campplus.onnx")
    _assert_xvectors_close(analyzer.embed(wavs), [speaker.embed(w) for w in wavs])


def _fixture_mel_dims(fixture_dir: Path):
    model = fixture_dir / "model"
    yaml_path = next(model.glob("cosyvoice*.yaml"))
    hparams = read_hyperpyyaml(yaml_path, overrides={"qwen_pretrain_path": str(model / "CosyVoice-BlankEN")})
    return _mel_dims(_Reader(yaml_path.name, hparams))


def test_module_outputs_are_finite_and_vary(module):
    """The comparisons above are meaningful: the embeddings are not constant across prompts."""
    out = torch.stack(module.embed(_random_feats((S, 3 * S), seed=10)))
    assert bool(torch.isfinite(out).all()) and float((out[0] - out[1]).abs().max()) > 100 * XVECTOR_ATOL
    assert not np.allclose(out[0].numpy(), 0.0)
