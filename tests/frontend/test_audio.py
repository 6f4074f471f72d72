"""Audio loading, the checks on prompt audio, and the three spectral front ends (spec/frontend.md §1, §4-§7)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosystream.errors import BadInput
from cosystream.frontend.audio import (
    MAX_PROMPT_S,
    MIN_PROMPT_S,
    align_prompt,
    kaldi_fbank,
    load_audio,
    prepare_prompt_audio,
    prompt_mel,
    slaney_mel_filterbank,
    speaker_features,
    whisper_log_mel,
)

# Suggested tolerances of the fixture set (fixtures README §3).
WHISPER_ATOL = 1e-4
FBANK_ATOL = 2e-3
MATCHA_ATOL = 2e-4


@pytest.fixture(scope="module")
def fx(load_fixture):
    return load_fixture("frontend")


# parity

@pytest.mark.parity
def test_loading_matches_official(fx, prompt_wav, prompt_wav_at):
    direct, sample_rate = load_audio(prompt_wav_at(16000))
    assert sample_rate == 16000
    torch.testing.assert_close(direct, fx["speech_16k_direct"][0], atol=0, rtol=0)
    prompt = prepare_prompt_audio(prompt_wav)
    torch.testing.assert_close(prompt.wav_24k, fx["speech_24k"][0], atol=0, rtol=0)
    torch.testing.assert_close(prompt.wav_16k, fx["speech_16k_from_24k"][0], atol=1e-5, rtol=0)


@pytest.mark.parity
@pytest.mark.parametrize(("wav_key", "mel_key"), [("speech_16k_direct", "whisper_logmel128_16k_direct"),
                                                  ("speech_16k_from_24k", "whisper_logmel128_from_24k")])
def test_whisper_log_mel_matches_official(fx, wav_key, mel_key):
    out = whisper_log_mel(fx[wav_key][0])
    assert out.shape == fx[mel_key][0].shape
    torch.testing.assert_close(out, fx[mel_key][0], atol=WHISPER_ATOL, rtol=0)


@pytest.mark.parity
@pytest.mark.parametrize(("wav_key", "fbank_key"), [("speech_16k_direct", "fbank80_16k_direct_raw"),
                                                    ("speech_16k_from_24k", "fbank80_from_24k_raw")])
def test_kaldi_fbank_matches_official(fx, wav_key, fbank_key):
    out = kaldi_fbank(fx[wav_key][0])
    assert out.shape == fx[fbank_key].shape
    torch.testing.assert_close(out, fx[fbank_key], atol=FBANK_ATOL, rtol=0)


@pytest.mark.parity
def test_speaker_features_match_official(fx):
    out = speaker_features(fx["speech_16k_direct"][0])
    torch.testing.assert_close(out, fx["fbank80_16k_direct_meannorm"], atol=FBANK_ATOL, rtol=0)
    assert out.mean(dim=0).abs().max() < 1e-4


@pytest.mark.parity
def test_prompt_mel_matches_official(fx, checkpoint):
    out = prompt_mel(fx["speech_24k"][0], checkpoint.hparams.mel)
    expected = fx["speech_feat_24k_matcha"][0].T  # official [1, 80, T] -> ours [T, 80]
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=MATCHA_ATOL, rtol=0)


# filterbanks and alignment

def test_slaney_filterbank_shape_and_area_normalisation():
    basis = slaney_mel_filterbank(24000, 1920, 80, 0.0, 8000.0)
    assert basis.shape == (80, 961) and basis.dtype == torch.float32
    assert (basis >= 0).all()
    # Slaney normalisation scales each triangle by 2 / bandwidth, so its area is 1 (in Hz units);
    # with 12.5 Hz bins every triangle is sampled finely enough to see it.
    area = basis.sum(dim=1) * (24000 / 1920)
    torch.testing.assert_close(area, torch.ones(80), atol=2e-2, rtol=0)
    assert slaney_mel_filterbank(16000, 400, 128).shape == (128, 201)


def test_prompt_mel_respects_fmax(checkpoint):
    dims = checkpoint.hparams.mel
    basis = slaney_mel_filterbank(dims.sampling_rate, dims.n_fft, dims.num_mels, dims.fmin, dims.fmax)
    fmax = dims.fmax if dims.fmax is not None else dims.sampling_rate / 2
    top_bin = int(np.ceil(fmax * dims.n_fft / dims.sampling_rate)) + 1
    assert basis[:, top_bin:].abs().max() == 0


@pytest.mark.parametrize(("num_tokens", "num_frames", "expected"), [(119, 236, 118), (100, 201, 100), (50, 99, 49)])
def test_alignment_keeps_two_frames_per_token(num_tokens, num_frames, expected):
    tokens, mel = align_prompt(torch.arange(num_tokens, dtype=torch.int32), torch.zeros(num_frames, 80))
    assert tokens.shape[0] == expected and mel.shape[0] == 2 * expected
    assert tokens[-1] == expected - 1


# inputs the loader accepts

def test_8k_stereo_is_upsampled_and_mixed(write_audio, speech_like):
    path = write_audio("phone.wav", speech_like(2.0, 8000, channels=2), 8000)
    prompt = prepare_prompt_audio(path)
    assert prompt.wav_16k.shape == (32000,) and prompt.wav_24k.shape == (48000,)
    assert prompt.wav_16k.dtype == torch.float32 and torch.isfinite(prompt.wav_16k).all()


def test_a_prompt_keeps_its_own_rate_and_resamples_a_copy_as_it_resamples_itself(write_audio, speech_like):
    """The engine's GPU analysis resamples a device copy of the samples (`at_rates`): the same waveforms as the
    CPU path's `wav_16k` / `wav_24k`."""
    path = write_audio("cd.wav", speech_like(1.5, 44100), 44100)
    prompt = prepare_prompt_audio(path)
    assert prompt.sample_rate == 44100 and prompt.samples.shape == (66150,)
    wav_16k, wav_24k = prompt.at_rates(prompt.samples.clone())
    assert torch.equal(wav_16k, prompt.wav_16k) and torch.equal(wav_24k, prompt.wav_24k)
    assert prompt.wav_16k.shape == (24000,) and prompt.wav_24k.shape == (36000,)


@pytest.mark.parametrize(("name", "kwargs"), [("p.flac", {}), ("p.ogg", {"subtype": "VORBIS"}),
                                              ("p.mp3", {"format": "MP3"}), ("p.wav", {"subtype": "PCM_24"})])
def test_compressed_and_lossless_formats_load(write_audio, speech_like, name, kwargs):
    path = write_audio(name, speech_like(1.5, 44100), 44100, **kwargs)
    data, sample_rate = load_audio(path)
    assert sample_rate == 44100 and abs(data.numel() - 1.5 * 44100) < 0.1 * 44100
    assert float(data.abs().max()) > 0.05


def test_bytes_and_arrays_load_like_files(write_audio, speech_like):
    samples = speech_like(1.0, 16000, channels=2)
    path = write_audio("p.wav", samples, 16000, subtype="FLOAT")
    from_file, _ = load_audio(path)
    from_bytes, _ = load_audio(path.read_bytes())
    from_array, _ = load_audio((samples, 16000))
    torch.testing.assert_close(from_bytes, from_file)
    torch.testing.assert_close(from_array, from_file)


# inputs the loader rejects

def test_empty_file_is_rejected(write_audio):
    path = write_audio("empty.wav", np.zeros(0, dtype=np.float32), 16000)
    with pytest.raises(BadInput, match="prompt_wav: .*empty"):
        prepare_prompt_audio(path)


def test_silence_is_rejected(write_audio):
    path = write_audio("silence.wav", np.zeros(32000, dtype=np.float32), 16000)
    with pytest.raises(BadInput, match="prompt_wav: .*silent"):
        prepare_prompt_audio(path)


def test_too_short_is_rejected(write_audio, speech_like):
    path = write_audio("short.wav", speech_like(0.1, 16000), 16000)
    with pytest.raises(BadInput, match=f"too short.*{MIN_PROMPT_S}"):
        prepare_prompt_audio(path)


def test_too_long_is_rejected(write_audio, speech_like):
    path = write_audio("long.wav", speech_like(45.0, 16000), 16000)
    with pytest.raises(BadInput, match=f"too long.*{MAX_PROMPT_S:.0f} s"):
        prepare_prompt_audio(path)


def test_text_renamed_to_wav_is_rejected(tmp_path):
    path = tmp_path / "notes.wav"
    path.write_text("these are meeting notes, not audio\n" * 20)
    with pytest.raises(BadInput, match="notes.wav: not a readable audio file"):
        prepare_prompt_audio(path)


def test_an_unreadable_upload_is_named_as_an_upload_not_by_its_object_repr():
    with pytest.raises(BadInput) as info:
        load_audio(b"these are meeting notes, not audio\n" * 20, "prompt_wav")
    message = str(info.value)
    assert message.startswith("prompt_wav: uploaded audio: not a readable audio file")
    assert "BytesIO" not in message and "0x" not in message and "Error opening" not in message


def test_missing_file_is_rejected(tmp_path):
    with pytest.raises(BadInput, match="no such file"):
        load_audio(tmp_path / "absent.wav")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 5, 15999])
def test_non_finite_samples_are_rejected(bad, where):
    samples = np.ones(16000, dtype=np.float32)
    samples[where] = bad
    with pytest.raises(BadInput, match="NaN"):
        load_audio((samples, 16000))


@pytest.mark.parametrize("channels", [1, 2])
def test_a_float_file_with_a_non_finite_sample_is_rejected(channels):
    import io

    import soundfile as sf

    samples = np.full((16000, channels), 0.25, dtype=np.float32)
    samples[123, channels - 1] = np.nan
    buffer = io.BytesIO()
    sf.write(buffer, samples, 16000, format="WAV", subtype="FLOAT")
    with pytest.raises(BadInput, match="prompt_wav: the audio contains NaN"):
        load_audio(buffer.getvalue())


@pytest.mark.parametrize("channels", [1, 3])
def test_decoded_files_are_the_mean_of_their_channels(channels):
    import io

    import soundfile as sf

    rng = np.random.default_rng(channels)
    samples = rng.uniform(-0.5, 0.5, (8000, channels)).astype(np.float32)
    buffer = io.BytesIO()
    sf.write(buffer, samples, 16000, format="WAV", subtype="FLOAT")
    data, rate = load_audio(buffer.getvalue())
    assert rate == 16000
    assert torch.equal(data, torch.from_numpy(samples).mean(dim=1))


def test_too_low_sample_rate_is_rejected(write_audio, speech_like):
    path = write_audio("4k.wav", speech_like(1.0, 4000), 4000)
    with pytest.raises(BadInput, match="4000 Hz is below"):
        load_audio(path)


def test_the_error_names_the_field(write_audio):
    path = write_audio("silence.wav", np.zeros(32000, dtype=np.float32), 16000)
    with pytest.raises(BadInput, match="^source_wav: "):
        prepare_prompt_audio(path, field="source_wav")


def test_channels_first_arrays_are_mixed_too(speech_like):
    samples = speech_like(1.0, 16000, channels=2)
    channels_last, _ = load_audio((samples, 16000))
    channels_first, _ = load_audio((torch.from_numpy(samples.T.copy()), 16000))
    torch.testing.assert_close(channels_first, channels_last)
    assert channels_first.shape == (16000,)


def test_overlong_files_are_refused_before_decoding(write_audio, speech_like):
    path = write_audio("long.flac", speech_like(40.0, 8000), 8000)
    with pytest.raises(BadInput, match="40.0 s is too long"):
        load_audio(path, max_seconds=30)
