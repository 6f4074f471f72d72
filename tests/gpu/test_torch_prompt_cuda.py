"""On a GPU: the torch prompt analysis (frontend/torch_prompt.py) against the official ONNX path and the fixtures,
and the engine's batched analysis of recordings sent with requests. Needs CUDA; CI (CPU only) does not run it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cosystream.engine.sync_engine import Engine
from cosystream.frontend.audio import prepare_prompt_audio
from cosystream.frontend.speaker import SpeakerEncoder
from cosystream.frontend.speech_tokenizer import SpeechTokenizer
from cosystream.frontend.torch_prompt import TorchPromptAnalyzer, ieee_float32
from cosystream.params import SamplingParams, SynthesisParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MATCHA_ATOL = 2e-4  # fixtures README §3 (CosyVoice2 set)
XVECTOR_ATOL = 1e-4  # as tests/frontend/test_speaker.py


def _recordings(count: int, rate: int = 24000) -> list[tuple[np.ndarray, int]]:
    """Voiced signals of distinct lengths and pitch."""
    out = []
    for i in range(count):
        t = np.arange(int((1.2 + 0.37 * i) * rate)) / rate
        phase = 2 * np.pi * np.cumsum(110 + 13 * i + 25 * np.sin(2 * np.pi * 0.8 * t)) / rate
        wav = 0.2 * sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))
        out.append(((wav + np.random.default_rng(i).normal(0, 0.01, t.shape)).astype(np.float32), rate))
    return out


def test_cuda_analysis_matches_the_official_path(checkpoint, fixture_dir):
    fx = load_file(str(fixture_dir / "frontend.safetensors"))
    files, mel_dims = checkpoint.files, checkpoint.hparams.mel
    analyzer = TorchPromptAnalyzer.from_checkpoint(checkpoint, "cuda", torch.float32)
    prompts = [prepare_prompt_audio(fixture_dir / "prompt_24k.wav", mel_dims.sampling_rate)]
    prompts += [prepare_prompt_audio(r, mel_dims.sampling_rate) for r in _recordings(5)]
    batched = analyzer.analyse(prompts)
    assert torch.equal(batched[0].tokens, fx["speech_token_raw_from_24k"][0])
    torch.testing.assert_close(batched[0].mel, fx["speech_feat_24k_matcha"][0].T, atol=MATCHA_ATOL, rtol=0)
    torch.testing.assert_close(batched[0].xvector, fx["spk_embedding_from_24k"][0], atol=XVECTOR_ATOL,
                               rtol=XVECTOR_ATOL)
    tokenizer, speaker = SpeechTokenizer(files.speech_tokenizer), SpeakerEncoder(files.campplus)
    for prompt, result in zip(prompts, batched, strict=True):
        assert torch.equal(result.tokens, tokenizer.tokenize(prompt.wav_16k))
        torch.testing.assert_close(result.xvector, speaker.embed(prompt.wav_16k), atol=XVECTOR_ATOL,
                                   rtol=XVECTOR_ATOL)
        alone = analyzer.analyse([prompt])[0]
        assert torch.equal(result.tokens, alone.tokens)


@pytest.mark.parametrize("rate", [16000, 24000, 44100, 48000])
def test_a_recording_resampled_on_the_device_matches_the_cpu(rate):
    prompt = prepare_prompt_audio(_recordings(1, rate)[0], 24000)
    with ieee_float32(True):
        on_device = prompt.at_rates(prompt.samples.cuda())
    for resampled, on_cpu in zip(on_device, (prompt.wav_16k, prompt.wav_24k), strict=True):
        assert resampled.is_cuda
        torch.testing.assert_close(resampled.cpu(), on_cpu, atol=1e-6, rtol=0)


def test_engine_on_cuda_analyses_recordings_sent_together_in_batches(model_dir, tmp_path):
    eng = Engine.from_pretrained(model_dir, device="cuda", voices_db=str(tmp_path / "v.db"), max_streams=8)
    try:
        batcher = eng.async_engine.prompt_batcher
        assert batcher.batched
        recordings = _recordings(6)

        def say(index: int):
            return eng.synthesize(SynthesisParams(text="a short line.", prompt_audio=recordings[index],
                                                  prompt_text="hello there.", force_tokens=30,
                                                  sampling=SamplingParams(greedy=True, seed=index)))

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(say, range(6)))
        assert all(r.pcm.size > 0 for r in results)
        assert batcher.stats.prompts == 6  # every recording went through the batched torch analysis
        want = eng.async_engine.frontend.make_voice_prompt(recordings[0], "hello there.")
        got = batcher.make_voice_prompt(recordings[0], "hello there.")
        assert torch.equal(got.prompt_speech_tokens, want.prompt_speech_tokens)
        # submitted directly, one after another: those that arrive while the first is analysed meet in one batch
        rate = eng.async_engine.hparams.mel.sampling_rate
        before = batcher.stats.largest_batch
        futures = [batcher.submit(prepare_prompt_audio(r, rate)) for r in recordings]
        assert all(f.result(timeout=60).tokens.numel() > 0 for f in futures)
        assert batcher.stats.largest_batch >= max(before, 2)
    finally:
        eng.close()


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_cuda_runs_realistic_side_model_graphs_as_onnxruntime(checkpoint, tmp_path, version):
    """Graphs with the released architectures (reduced width, random weights; cosystream/testing/
    realistic_side_models.py): float32 on the GPU, batched, gives onnxruntime's tokens and x-vectors."""
    from cosystream.testing.realistic_side_models import write_campplus, write_speech_tokenizer

    tokenizer = write_speech_tokenizer(tmp_path / f"speech_tokenizer_{version}.onnx", version, "small", seed=5)
    campplus = write_campplus(tmp_path / "campplus.onnx", "small", seed=6)
    mel_dims = checkpoint.hparams.mel
    analyzer = TorchPromptAnalyzer(tokenizer, campplus, mel_dims, "cuda", torch.float32)
    assert analyzer.tokenizer.mode == "padded"
    prompts = [prepare_prompt_audio(r, mel_dims.sampling_rate) for r in _recordings(5)]
    onnx_tokenizer, onnx_speaker = SpeechTokenizer(tokenizer), SpeakerEncoder(campplus)
    for prompt, result in zip(prompts, analyzer.analyse(prompts), strict=True):
        assert torch.equal(result.tokens, onnx_tokenizer.tokenize(prompt.wav_16k))
        torch.testing.assert_close(result.xvector, onnx_speaker.embed(prompt.wav_16k), atol=XVECTOR_ATOL,
                                   rtol=XVECTOR_ATOL)


def test_cuda_analysis_waits_for_the_device_only_to_copy_its_results_back(checkpoint, tmp_path):
    """The released architectures (reduced width): on prompts of lengths not seen before (the shape arithmetic
    folded anew), the host synchronises with the device only in the copies of the results back (tokens, mel and
    x-vector per prompt), so it launches the whole analysis while the device runs it; and the results are those
    of onnxruntime and of each prompt alone."""
    from cosystream.testing.host_syncs import recorded_host_syncs
    from cosystream.testing.realistic_side_models import write_campplus, write_speech_tokenizer

    tokenizer = write_speech_tokenizer(tmp_path / "speech_tokenizer_v2.onnx", "v2", "small", seed=7)
    campplus = write_campplus(tmp_path / "campplus.onnx", "small", seed=8)
    mel_dims = checkpoint.hparams.mel
    analyzer = TorchPromptAnalyzer(tokenizer, campplus, mel_dims, "cuda", torch.float32)
    prompts = [prepare_prompt_audio(r, mel_dims.sampling_rate) for r in _recordings(4)]
    analyzer.analyse(prompts[:1])  # warm-up: kernels, cuFFT plans, pinned host blocks
    for batch in (prompts[1:2], prompts[2:]):
        with recorded_host_syncs() as syncs:
            results = analyzer.analyse(batch)
        assert len(syncs) <= 3 * len(batch), [str(w.message) for w in syncs]
        onnx_tokenizer, onnx_speaker = SpeechTokenizer(tokenizer), SpeakerEncoder(campplus)
        for prompt, result in zip(batch, results, strict=True):
            assert torch.equal(result.tokens, onnx_tokenizer.tokenize(prompt.wav_16k))
            torch.testing.assert_close(result.xvector, onnx_speaker.embed(prompt.wav_16k), atol=XVECTOR_ATOL,
                                       rtol=XVECTOR_ATOL)
            # the mel computed beside the tokenizer is the one computed alone
            torch.testing.assert_close(result.mel, analyzer.mels([prompt.wav_24k])[0], atol=MATCHA_ATOL / 100,
                                       rtol=0)
