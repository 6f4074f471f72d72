"""On a GPU: the speech tokenizer's calls replayed as CUDA graphs (frontend/padded_graphs.py), on the released
architectures (reduced width, random weights), against onnxruntime and the eager interpreter; what a replay launches
and waits for; and a capture that fails leaving the eager calls in charge. Needs CUDA; CI (CPU only) does not run
it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cosystream.frontend.audio import MAX_PROMPT_S, TOKENIZER_SAMPLE_RATE, WHISPER_HOP, whisper_log_mel
from cosystream.frontend.padded_graphs import capture_shapes
from cosystream.frontend.speech_tokenizer import SpeechTokenizer
from cosystream.frontend.torch_prompt import GRAPH_ROWS, TorchPromptAnalyzer
from cosystream.testing.realistic_side_models import voiced_signal, write_campplus, write_speech_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# batches of prompt lengths (s): one bucket each, up to 8 rows; none of the captures' or the self-checks' lengths
SECONDS = ((2.37,), (0.61, 4.05, 4.4), (6.02,), (1.13, 1.2, 0.99, 0.5, 3.3))


def _analyzer(tmp: Path, version: str, checkpoint, **kwargs) -> tuple[TorchPromptAnalyzer, Path]:
    tokenizer = write_speech_tokenizer(tmp / f"speech_tokenizer_{version}.onnx", version, "small", seed=31)
    campplus = write_campplus(tmp / "campplus.onnx", "small", seed=32)
    return TorchPromptAnalyzer(tokenizer, campplus, checkpoint.hparams.mel, "cuda", torch.float32, **kwargs), tokenizer


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_replayed_tokens_are_onnxruntimes_and_the_interpreters(tmp_path, checkpoint, version):
    analyzer, path = _analyzer(tmp_path, version, checkpoint)
    graphs = analyzer.tokenizer.graphs
    assert analyzer.tokenizer_fallback is None and graphs is not None
    longest = int(MAX_PROMPT_S * TOKENIZER_SAMPLE_RATE) // WHISPER_HOP
    assert set(graphs.replays) == set(capture_shapes(GRAPH_ROWS, longest))  # every bucket captured at load
    onnx_tokenizer = SpeechTokenizer(path)
    for batch_index, seconds in enumerate(SECONDS):
        wavs = [voiced_signal(s, 16000, seed=10 * batch_index + i) for i, s in enumerate(seconds)]
        before = graphs.replayed
        tokens = analyzer.tokenize(wavs)
        assert graphs.replayed == before + 1  # one replay for the whole batch
        analyzer.tokenizer.graphs = None
        try:
            eager = analyzer.tokenize(wavs)
        finally:
            analyzer.tokenizer.graphs = graphs
        for got, want, wav in zip(tokens, eager, wavs, strict=True):
            assert torch.equal(got, onnx_tokenizer.tokenize(wav))
            assert torch.equal(got, want)
    assert set(graphs.replays) == set(capture_shapes(GRAPH_ROWS, longest))  # nothing captured after the load


def _profiled(fn) -> tuple[int, int]:
    """(kernel launches, graph launches) the host made in `fn`."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [event.name for event in prof.events()]
    return sum("LaunchKernel" in n for n in names), sum("GraphLaunch" in n for n in names)


def test_a_replay_launches_one_graph_and_waits_for_nothing(tmp_path, checkpoint):
    from cosystream.testing.host_syncs import recorded_host_syncs

    analyzer, _ = _analyzer(tmp_path, "v2", checkpoint)
    batched = analyzer.tokenizer
    graphs = batched.graphs
    assert graphs is not None
    feats = [whisper_log_mel(voiced_signal(s, 16000, seed=i).cuda()) for i, s in enumerate((5.87, 3.1))]
    with analyzer._exact():
        batched.run(feats)  # warm-up: pinned host blocks
        replay_kernels, replay_graphs = _profiled(lambda: batched.run(feats))
        batched.graphs = None
        try:
            eager_kernels, eager_graphs = _profiled(lambda: batched.run(feats))
        finally:
            batched.graphs = graphs
        with recorded_host_syncs() as syncs:
            batched.run(feats)
    assert replay_graphs == 1 and eager_graphs == 0
    # the replay's own launches: the buffers' fill and the copy of the rows out
    assert replay_kernels * 10 <= eager_kernels, (replay_kernels, eager_kernels)
    assert [str(w.message) for w in syncs] == []


def test_a_capture_the_device_refuses_leaves_the_eager_calls_exact(tmp_path, checkpoint):
    """A call that reads a device value back (a synchronisation) cannot be captured: the capture fails, the replays
    switch off, and the device and the eager tokenizer go on as before."""
    from cosystream.frontend.padded_graphs import PaddedGraphs

    analyzer, path = _analyzer(tmp_path, "v2", checkpoint, tokenizer_graphs=False)
    assert analyzer.tokenizer.graphs is None and "switched off" in (analyzer.tokenizer_fallback or "")
    graphs = PaddedGraphs(analyzer.tokenizer, 128)
    real_capture = graphs._cuda_capture

    def reads_back(forward):
        return real_capture(lambda: forward() + int(graphs._lengths[0].item()) * 0)

    graphs.capture_fn = reads_back
    with analyzer._exact():
        assert graphs.capture([(1, 100), (2, 100)]) == 0
    assert graphs.disabled is not None and "capturing" in graphs.disabled
    analyzer.tokenizer.graphs = graphs
    wav = voiced_signal(0.93, 16000, seed=3)
    assert torch.equal(analyzer.tokenize([wav])[0], SpeechTokenizer(path).tokenize(wav))
    assert graphs.replayed == 0
