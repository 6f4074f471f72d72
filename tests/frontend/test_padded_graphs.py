"""The speech tokenizer's graphed calls (frontend/padded_graphs.py) on the CPU: the shape buckets, the captures'
host copies, and the self-check that switches the replays off, with stand-ins for the CUDA-graph capture.

The graph is the reduced-width export of the released v2 architecture (random weights); its tokens are checked
against onnxruntime's. tests/gpu/test_tokenizer_graphs_cuda.py runs the real CUDA graphs.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from cosystream.cuda_graphs import BATCH_BUCKETS
from cosystream.frontend.audio import whisper_log_mel
from cosystream.frontend.onnx_torch import CaptureUnsafe, StaticUploads, TorchOnnxGraph
from cosystream.frontend.padded_graphs import PaddedGraphs, capture_shapes, padded_shape
from cosystream.frontend.speech_tokenizer import SpeechTokenizer
from cosystream.frontend.torch_prompt import BatchedGraph, TorchPromptAnalyzer
from cosystream.testing.realistic_side_models import voiced_signal, write_campplus, write_speech_tokenizer

STEP = 40  # a short bucket step keeps the CPU calls small
CHANNELS = 128


def eager_capture(forward):
    """A faithful stand-in: the replay recomputes the call from the static buffers."""
    forward()
    return forward


def stale_capture(forward):
    """A broken capture: the replay returns the capture's output, whatever the buffers hold now."""
    out = forward().clone()
    return lambda: out


def failing_capture(forward):
    raise RuntimeError("operation not permitted when stream is capturing")


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> Path:
    return write_speech_tokenizer(tmp_path_factory.mktemp("padded_graphs") / "speech_tokenizer_v2.onnx", "v2",
                                  "small", seed=21)


@pytest.fixture(scope="module")
def onnx_tokenizer(tokenizer_path) -> SpeechTokenizer:
    return SpeechTokenizer(tokenizer_path)


@pytest.fixture
def batched(tokenizer_path) -> BatchedGraph:
    graph = BatchedGraph(TorchOnnxGraph(tokenizer_path), sequence_axis=2)
    assert graph.probe_batching(CHANNELS) == "padded"
    return graph


def _wavs(seconds: tuple[float, ...]) -> list[torch.Tensor]:
    return [voiced_signal(s, 16000, seed=i) for i, s in enumerate(seconds)]


def test_padded_shape_rounds_rows_to_a_batch_bucket_and_frames_to_the_step():
    for prompts in range(1, max(BATCH_BUCKETS) + 1):
        for longest in (1, STEP - 1, STEP, STEP + 1, 7 * STEP + 3):
            rows, frames = padded_shape(prompts, longest, STEP)
            assert rows in BATCH_BUCKETS and prompts <= rows
            assert frames % STEP == 0 and longest <= frames < longest + STEP


def test_capture_shapes_cover_every_call_within_the_budget_and_no_more():
    max_rows, max_frames, budget = 16, 3000, 16_000
    shapes = capture_shapes(max_rows, max_frames, 100, budget)
    assert len(shapes) == len(set(shapes))
    assert all(rows * frames <= budget for rows, frames in shapes)
    calls = {padded_shape(n, t, 100) for n in range(1, max_rows + 1) for t in range(1, max_frames + 1, 7)}
    assert {shape for shape in calls if shape[0] * shape[1] <= budget} == set(shapes)
    assert [f for _, f in shapes] == sorted(f for _, f in shapes)  # shortest first


def test_static_uploads_copy_each_host_tensor_once_and_refuse_new_ones_while_capturing():
    ctx = StaticUploads(torch.device("cpu"), torch.float32)
    positions = torch.arange(50)
    first = ctx.send(positions)
    assert ctx.send(torch.arange(50)) is first  # equal contents: the same copy
    assert torch.equal(first, positions)
    ctx.capturing = True
    assert ctx.send(positions.clone()) is first
    with pytest.raises(CaptureUnsafe):
        ctx.send(torch.arange(51))
    with pytest.raises(CaptureUnsafe):
        ctx.send(torch.arange(50, dtype=torch.int32))  # another dtype is another tensor


def test_replays_give_the_eager_and_onnxruntime_tokens(batched, onnx_tokenizer):
    wavs = _wavs((1.31, 1.07, 0.83, 2.2))
    feats = [whisper_log_mel(w) for w in wavs]
    eager = batched.run(feats)
    graphs = PaddedGraphs(batched, CHANNELS, capture=eager_capture, step=STEP)
    shapes = sorted({padded_shape(3, f.shape[-1], STEP) for f in feats[:3]} | {padded_shape(1, feats[1].shape[-1],
                                                                                              STEP)})
    assert graphs.capture(shapes) == len(shapes) and graphs.disabled is None
    batched.graphs = graphs
    together = batched.run(feats[:3])  # one bucket of 4 rows (a filler row)
    alone = batched.run(feats[1:2])
    assert graphs.replayed == 2 and batched.graph.stats.replayed and batched.graph.stats.ops_run == 0
    longer = batched.run(feats[3:])  # no graph of its shape: eager
    assert graphs.replayed == 2 and not batched.graph.stats.replayed and batched.graph.stats.ops_run > 0
    for got, want, wav in zip(together + longer, eager[:3] + eager[3:], wavs[:3] + wavs[3:], strict=True):
        assert got.shape == want.shape == (math.ceil(whisper_log_mel(wav).shape[-1] / 4),)
        assert torch.equal(got, want)
        assert torch.equal(got.to(torch.int32), onnx_tokenizer.tokenize(wav))
    assert torch.equal(alone[0], eager[1])
    assert batched.run([]) == []


def test_a_replay_that_ignores_its_inputs_fails_the_self_check_and_the_calls_run_eagerly(batched, onnx_tokenizer):
    wavs = _wavs((1.0, 0.9))
    feats = [whisper_log_mel(w) for w in wavs]
    graphs = PaddedGraphs(batched, CHANNELS, capture=stale_capture, step=STEP)
    shape = padded_shape(2, max(f.shape[-1] for f in feats), STEP)
    assert graphs.capture([shape, (1, STEP)]) == 0
    assert graphs.disabled is not None and "differ" in graphs.disabled
    assert graphs.replays == {}
    batched.graphs = graphs
    tokens = batched.run(feats)
    assert graphs.replayed == 0
    for got, wav in zip(tokens, wavs, strict=True):
        assert torch.equal(got.to(torch.int32), onnx_tokenizer.tokenize(wav))


def test_a_failed_capture_switches_the_replays_off_for_good(batched):
    graphs = PaddedGraphs(batched, CHANNELS, capture=eager_capture, step=STEP)
    assert graphs.capture([(1, STEP)]) == 1
    graphs.capture_fn = failing_capture
    assert graphs.capture([(2, STEP)]) == 0
    assert graphs.disabled is not None and "failed" in graphs.disabled and "capturing" in graphs.disabled
    assert graphs.run([torch.zeros(CHANNELS, STEP - 3)]) is None  # the bucket captured before is off too


def test_a_graph_without_a_length_input_is_refused(tokenizer_path, tmp_path):
    campplus = BatchedGraph(TorchOnnxGraph(write_campplus(tmp_path / "campplus.onnx", "small", seed=3)), 1)
    with pytest.raises(ValueError, match="length input"):
        PaddedGraphs(campplus, 80)


def test_the_cpu_analysis_captures_no_graphs(tokenizer_path, tmp_path, checkpoint):
    campplus = write_campplus(tmp_path / "campplus.onnx", "small", seed=4)
    analyzer = TorchPromptAnalyzer(tokenizer_path, campplus, checkpoint.hparams.mel, "cpu")
    assert analyzer.tokenizer.graphs is None and analyzer.tokenizer_fallback is not None


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_the_captured_call_reads_no_device_value_and_copies_nothing_new_from_the_host(tmp_path, version):
    """What a CUDA-graph capture demands of the call, on "meta" (shapes, no data: reading a device value back
    raises, as a capture refuses a synchronisation): with the lengths in a device buffer, the warm-up call folds the
    shapes and copies the host tensors; the captured call then runs with no host read and no new host copy."""
    path = write_speech_tokenizer(tmp_path / f"speech_tokenizer_{version}.onnx", version, "small", seed=22)
    batched = BatchedGraph(TorchOnnxGraph(path, "meta"), sequence_axis=2)
    batched.mode, batched.frames_per_output = "padded", 4  # the probe compares values, which meta has not
    graphs = PaddedGraphs(batched, CHANNELS, step=STEP)
    captured = []

    def strict_capture(forward):
        forward()  # the warm-up
        graphs.ctx.capturing = True
        try:
            out = forward()
        finally:
            graphs.ctx.capturing = False
        captured.append(out)
        return lambda: out

    graphs.capture_fn = strict_capture
    for rows, frames in ((1, STEP), (4, 3 * STEP)):
        replay = graphs._capture_one((rows, frames))
        assert captured[-1].shape == (rows, frames // 4)
        assert replay.folded is not None  # the shape arithmetic the graph reads, held with it
