"""On a GPU: the batched CAM++ network (frontend/campplus.py) against the ONNX interpreter and onnxruntime, eager
and replayed as CUDA graphs. Needs CUDA; CI (CPU only) does not run it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from cosystream.frontend.campplus import SEGMENT_FRAMES, XVECTOR_ATOL, XVECTOR_RTOL, load_fast_campplus
from cosystream.frontend.onnx_torch import TorchOnnxGraph
from cosystream.frontend.torch_prompt import ieee_float32
from cosystream.testing.realistic_side_models import write_campplus

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

S = SEGMENT_FRAMES
BATCHES = ((2 * S - 1, 2 * S + 1, 4 * S + 13), (4 * S + 40, S + 3, 3 * S), (S // 2 + 1,))  # 1st, 2nd: one bucket


@pytest.fixture(scope="module")
def campplus_path(tmp_path_factory) -> Path:
    return write_campplus(tmp_path_factory.mktemp("campplus_cuda") / "campplus.onnx", "small", seed=41)


def _feats(frames: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [2.0 * torch.randn(80, t, generator=gen) for t in frames]


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu(), b.cpu(), atol=XVECTOR_ATOL, rtol=XVECTOR_RTOL)


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_cuda_network_equals_the_interpreter_and_onnxruntime(campplus_path, cuda_graphs):
    graph = TorchOnnxGraph(campplus_path, "cuda")
    session = ort.InferenceSession(str(campplus_path))
    with ieee_float32(True):
        module, reason = load_fast_campplus(graph, cuda_graphs)
        assert reason is None and module is not None
        for seed, frames in enumerate(BATCHES):  # the second batch replays the first one's graph with new inputs
            feats = _feats(frames, seed)
            got = module.embed([f.cuda() for f in feats])
            _close(got, [graph({"input": f.T[None].cuda()})["output"].reshape(-1) for f in feats])
            _close(got, [torch.from_numpy(session.run(None, {"input": f.T[None].numpy()})[0].reshape(-1))
                         for f in feats])
    if cuda_graphs:
        assert module._graphs is not None and len(module._graphs.graphs) == 2  # two bucket shapes captured
    assert np.isfinite(torch.stack(got).cpu().numpy()).all()


def test_analyzer_captures_every_bucket_at_load_and_none_later(campplus_path, checkpoint, speech_like_wavs):
    from cosystream.cuda_graphs import BATCH_BUCKETS
    from cosystream.frontend.audio import MAX_PROMPT_S
    from cosystream.frontend.campplus import GRAPH_FRAME_STEP, MAX_BATCH_FRAMES
    from cosystream.frontend.speaker import SpeakerEncoder
    from cosystream.frontend.torch_prompt import GRAPH_ROWS, TorchPromptAnalyzer

    analyzer = TorchPromptAnalyzer(checkpoint.files.speech_tokenizer, campplus_path, checkpoint.hparams.mel, "cuda")
    assert analyzer.speaker_mode == "campplus_module"
    steps = range(GRAPH_FRAME_STEP, int(MAX_PROMPT_S * 100) + GRAPH_FRAME_STEP, GRAPH_FRAME_STEP)
    expected = sum(1 for rows in BATCH_BUCKETS if rows <= GRAPH_ROWS for frames in steps
                   if rows * frames <= MAX_BATCH_FRAMES)
    graphs = analyzer.fast_speaker._graphs.graphs
    assert len(graphs) == expected
    xvectors = analyzer.embed(speech_like_wavs)
    assert len(graphs) == expected  # every call replayed a graph captured at load
    speaker = SpeakerEncoder(campplus_path)
    _close(xvectors, [speaker.embed(w) for w in speech_like_wavs])


@pytest.fixture
def speech_like_wavs() -> list[torch.Tensor]:
    out = []
    for i, seconds in enumerate((0.9, 2.6, 6.3, 6.41, 11.2)):
        t = np.arange(int(seconds * 16000)) / 16000
        phase = 2 * np.pi * np.cumsum(110 + 13 * i + 25 * np.sin(2 * np.pi * 0.8 * t)) / 16000
        wav = 0.2 * sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))
        out.append(torch.from_numpy((wav + np.random.default_rng(i).normal(0, 0.01, t.shape)).astype(np.float32)))
    return out
