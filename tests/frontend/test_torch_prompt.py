"""Torch prompt analysis (frontend/torch_prompt.py) against the official ONNX path and the fixtures.

Both families: the CosyVoice2 set under test (COSYSTREAM_FIXTURES) with its v2 tokenizer, and the
CosyVoice3 set (COSYSTREAM_FIXTURES_CV3, default the shipped tests/fixtures/cosyvoice3-tiny) with its v3
tokenizer. Sizes, keys and fmax are read from each set; only stored files are used.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cosystream.checkpoint import MelDims
from cosystream.checkpoint.hparams import _mel_dims, _Reader, read_hyperpyyaml
from cosystream.frontend.audio import PromptAudio, prepare_prompt_audio
from cosystream.frontend.speaker import SpeakerEncoder
from cosystream.frontend.speech_tokenizer import SpeechTokenizer
from cosystream.frontend.torch_prompt import TorchPromptAnalyzer

# Suggested tolerances of the fixtures README (§3 for CosyVoice2, C3 for CosyVoice3).
MATCHA_ATOL = {"cosyvoice2": 2e-4, "cosyvoice3": 5e-3}  # fmax null: near-Nyquist bins carry little energy
XVECTOR_ATOL = 1e-4  # as tests/frontend/test_speaker.py: the fbank error (2e-3, low-energy bins) shrinks
BATCH_XVECTOR_RTOL = 1e-5  # one prompt batched vs alone: only the GEMM blocking may differ


@dataclass(frozen=True)
class FixtureSet:
    family: str
    root: Path
    tokenizer: Path
    campplus: Path
    mel_dims: MelDims
    frontend: dict[str, torch.Tensor]

    def tensor(self, *keys: str) -> torch.Tensor:
        """The first of `keys` the set stores (the two families name their frontend tensors differently)."""
        for key in keys:
            if key in self.frontend:
                return self.frontend[key]
        raise KeyError(f"{self.root.name}/frontend.safetensors has none of {keys}")


def _load_set(root: Path, family: str) -> FixtureSet:
    model = root / "model"
    yaml_path = next(model.glob("cosyvoice*.yaml"))
    hparams = read_hyperpyyaml(yaml_path, overrides={"qwen_pretrain_path": str(model / "CosyVoice-BlankEN")})
    tokenizer = next(model.glob("speech_tokenizer_v*.onnx"))
    return FixtureSet(family, root, tokenizer, model / "campplus.onnx", _mel_dims(_Reader(yaml_path.name, hparams)),
                      load_file(str(root / "frontend.safetensors")))


def _cv3_root(fixture_dir: Path) -> Path:
    default = Path(__file__).resolve().parents[1] / "fixtures" / "cosyvoice3-tiny"
    return Path(os.environ.get("COSYSTREAM_FIXTURES_CV3", str(default))).resolve()


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def fixture_set(request, fixture_dir: Path) -> FixtureSet:
    root = fixture_dir if request.param == "cosyvoice2" else _cv3_root(fixture_dir)
    if not (root / "frontend.safetensors").is_file():
        pytest.fail(f"{request.param} fixture set not found at {root} (set COSYSTREAM_FIXTURES_CV3)")
    return _load_set(root, request.param)


@pytest.fixture(scope="module")
def analyzer(fixture_set: FixtureSet) -> TorchPromptAnalyzer:
    return TorchPromptAnalyzer(fixture_set.tokenizer, fixture_set.campplus, fixture_set.mel_dims)


@pytest.fixture(scope="module")
def prompts(fixture_set: FixtureSet, speech_like) -> list[PromptAudio]:
    """The set's prompt (what the official frontend was given) and synthetic prompts of other lengths and rates:
    two of equal length (batched together in every mode), one at 22.05 kHz, one barely over the minimum."""
    rate = fixture_set.mel_dims.sampling_rate
    wav = fixture_set.root / json.loads((fixture_set.root / "manifest.json").read_text())["frontend"].get(
        "prompt_wav_passed", "prompt_24k.wav")
    synthetic = [(speech_like(1.7, 16000, seed=3), 16000), (speech_like(1.7, 16000, seed=4), 16000),
                 (speech_like(2.93, 22050, seed=5), 22050), (speech_like(0.61, 24000, seed=6), 24000)]
    return [prepare_prompt_audio(wav, rate)] + [prepare_prompt_audio(s, rate) for s in synthetic]


@pytest.fixture(scope="module")
def batched(analyzer: TorchPromptAnalyzer, prompts: list[PromptAudio]):
    return analyzer.analyse(prompts)


@pytest.mark.parity
def test_tokens_equal_the_official_tokens(fixture_set, batched):
    expected = fixture_set.tensor("speech_token_raw_from_24k", "speech_token_raw")[0]
    assert batched[0].tokens.dtype == torch.int32
    assert torch.equal(batched[0].tokens, expected)


@pytest.mark.parity
def test_tokens_equal_onnxruntime_on_every_prompt(fixture_set, prompts, batched):
    onnx_tokenizer = SpeechTokenizer(fixture_set.tokenizer)
    for prompt, result in zip(prompts, batched, strict=True):
        assert torch.equal(result.tokens, onnx_tokenizer.tokenize(prompt.wav_16k))


@pytest.mark.parity
def test_xvector_matches_the_official_embedding_and_onnxruntime(fixture_set, prompts, batched):
    expected = fixture_set.tensor("spk_embedding_from_24k", "spk_embedding")[0]
    torch.testing.assert_close(batched[0].xvector, expected, atol=XVECTOR_ATOL, rtol=XVECTOR_ATOL)
    onnx_speaker = SpeakerEncoder(fixture_set.campplus)
    for prompt, result in zip(prompts, batched, strict=True):
        assert result.xvector.shape == expected.shape
        torch.testing.assert_close(result.xvector, onnx_speaker.embed(prompt.wav_16k), atol=XVECTOR_ATOL,
                                   rtol=XVECTOR_ATOL)


@pytest.mark.parity
def test_prompt_mel_matches_the_official_mel(fixture_set, batched):
    expected = fixture_set.tensor("speech_feat_24k_matcha", "speech_feat_24k_fmax_null")[0]
    if expected.shape[0] == fixture_set.mel_dims.num_mels:  # stored [num_mels, frames]
        expected = expected.T
    assert batched[0].mel.shape == expected.shape
    torch.testing.assert_close(batched[0].mel, expected, atol=MATCHA_ATOL[fixture_set.family], rtol=0)


def test_batched_results_equal_the_unbatched_ones(analyzer, prompts, batched):
    for prompt, result in zip(prompts, batched, strict=True):
        alone = analyzer.analyse([prompt])[0]
        assert torch.equal(result.tokens, alone.tokens)
        assert torch.equal(result.mel, alone.mel)
        torch.testing.assert_close(result.xvector, alone.xvector, rtol=BATCH_XVECTOR_RTOL, atol=1e-6)


def test_lengths_follow_the_prompt(prompts, batched, fixture_set):
    for prompt, result in zip(prompts, batched, strict=True):
        frames = prompt.wav_16k.numel() // 160
        assert result.tokens.numel() == -(-frames // 4)  # 25 Hz tokens from 100 Hz features
        assert result.mel.shape == (prompt.wav_24k.numel() // fixture_set.mel_dims.hop_size,
                                    fixture_set.mel_dims.num_mels)
        assert result.xvector.dtype == torch.float32 and result.tokens.min() >= 0


def test_graph_calls_on_several_threads_give_the_same_results(fixture_set, prompts, batched):
    """graph_threads: CAM++'s calls (one per distinct length) run at once; every result equals the serial one."""
    threaded = TorchPromptAnalyzer(fixture_set.tokenizer, fixture_set.campplus, fixture_set.mel_dims,
                                   graph_threads=3)
    try:
        assert threaded.speaker is not None and threaded.speaker.threads == 3
        assert threaded.speaker_mode in ("same_length", "single")  # several calls for these prompts
        for _ in range(2):  # new shapes, then cached ones
            for result, serial in zip(threaded.analyse(prompts), batched, strict=True):
                assert torch.equal(result.xvector, serial.xvector) and torch.equal(result.tokens, serial.tokens)
    finally:
        threaded.close()


def test_empty_batch(analyzer):
    assert analyzer.analyse([]) == []


def test_distinct_prompts_give_distinct_results(batched):
    first, second = batched[1], batched[2]  # same length, different recordings
    assert first.tokens.shape == second.tokens.shape
    assert not torch.equal(first.tokens, second.tokens)
    assert not torch.allclose(first.xvector, second.xvector)
    assert np.isfinite(first.mel.numpy()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_official_graphs_run_on_another_device(fixture_set, dtype):
    """The set's tokenizer and CAM++ graphs on "meta" (a device with shapes but no data, standing in for CUDA):
    nothing reads a device value back for shape arithmetic, and the x-vector stays in the compute dtype."""
    from cosystream.frontend.onnx_torch import TorchOnnxGraph

    tokenizer = TorchOnnxGraph(fixture_set.tokenizer, "meta", dtype)
    frames = 301
    feats_name, length_name = tokenizer.input_names
    out = tokenizer({feats_name: torch.randn(2, 128, frames),
                     length_name: torch.tensor([frames, frames], dtype=torch.int32)})
    assert tuple(out[tokenizer.output_names[0]].shape) == (2, -(-frames // 4))
    speaker = TorchOnnxGraph(fixture_set.campplus, "meta", dtype)
    xvector = speaker({speaker.input_names[0]: torch.randn(2, 200, 80)})[speaker.output_names[0]]
    assert xvector.device.type == "meta" and xvector.dtype == dtype and xvector.shape[0] == 2


def test_campplus_on_cpu_threads_beside_the_device_work(fixture_set, prompts, batched):
    """speaker_threads > 0: CAM++ on onnxruntime (the official path) in parallel; tokens and mels unchanged."""
    hybrid = TorchPromptAnalyzer(fixture_set.tokenizer, fixture_set.campplus, fixture_set.mel_dims, speaker_threads=2)
    try:
        assert hybrid.speaker_mode == "onnxruntime_cpu"
        onnx_speaker = SpeakerEncoder(fixture_set.campplus)
        for prompt, result, reference in zip(prompts, hybrid.analyse(prompts), batched, strict=True):
            assert torch.equal(result.xvector, onnx_speaker.embed(prompt.wav_16k))
            assert torch.equal(result.tokens, reference.tokens) and torch.equal(result.mel, reference.mel)
    finally:
        hybrid.close()


def test_float32_analysis_runs_without_tf32_and_restores_the_flags():
    from cosystream.frontend.torch_prompt import ieee_float32

    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with ieee_float32(True):
            assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
        with ieee_float32(False):
            assert torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
