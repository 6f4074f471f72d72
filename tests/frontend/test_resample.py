"""Windowed-sinc resampler: parity with torchaudio's Resample as the official load_wav used it."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch

from cosystream.frontend.resample import MAX_KERNEL_TAPS, num_resampled, resample


@pytest.mark.parity
def test_resample_matches_official(load_fixture, prompt_wav):
    expected = load_fixture("frontend")["speech_16k_from_24k"][0]
    samples, sample_rate = sf.read(str(prompt_wav), dtype="float32")
    out = resample(torch.from_numpy(samples), sample_rate, 16000)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_equal_rates_return_the_input_unchanged():
    wav = torch.randn(1000)
    assert resample(wav, 16000, 16000) is wav


@pytest.mark.parametrize(("orig", "new", "n"), [(24000, 16000, 113657), (8000, 16000, 4001), (44100, 24000, 999)])
def test_output_length_is_ceil_of_the_rate_ratio(orig, new, n):
    out = resample(torch.zeros(n), orig, new)
    assert out.shape[-1] == num_resampled(n, orig, new) == -(-n * new // orig)


def test_batch_dims_are_kept_and_rows_are_independent():
    rows = torch.randn(2, 3, 4800)
    out = resample(rows, 48000, 16000)
    assert out.shape == (2, 3, 1600)
    torch.testing.assert_close(out[1, 2], resample(rows[1, 2], 48000, 16000))


@pytest.mark.parametrize(("orig", "new"), [(8000, 16000), (22050, 16000), (44101, 16000)])
def test_a_tone_keeps_its_frequency(orig, new):
    # 44101 -> 16000 has no common divisor: the polyphase kernel would be too big and soxr takes over.
    seconds, tone_hz = 1.0, 440.0
    t = np.arange(int(seconds * orig)) / orig
    out = resample(torch.from_numpy(np.sin(2 * np.pi * tone_hz * t).astype(np.float32)), orig, new).numpy()
    spectrum = np.abs(np.fft.rfft(out[new // 10: -new // 10]))
    peak_hz = np.argmax(spectrum) * new / (2 * (len(spectrum) - 1))
    assert abs(peak_hz - tone_hz) < 3.0
    assert 0.9 < np.abs(out[new // 10: -new // 10]).max() < 1.1


def test_large_kernels_are_avoided():
    orig, new = 44101, 16000
    assert new * orig > MAX_KERNEL_TAPS
    assert resample(torch.zeros(44101), orig, new).shape[-1] == 16000
