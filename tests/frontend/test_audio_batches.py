"""The spectral front ends of a batch of prompts in one set of kernels give each prompt what it gets alone: the
batch pads the prompts to one length, and a prompt's frames must never see another's samples or padding. Checked
against each prompt's features computed independently here, with torch.stft centring the prompt itself."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cosystream.frontend import audio
from cosystream.frontend.audio import kaldi_fbanks, prompt_mels, speaker_features_batch, whisper_log_mels


def _speech_like(seconds: float, rate: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * rate)) / rate
    voiced = torch.sin(2 * math.pi * (110 + 40 * seed) * t) * (0.5 + 0.5 * torch.sin(2 * math.pi * 3 * t))
    return (0.3 * voiced + 0.05 * torch.randn(t.shape[0], generator=gen)).float()


def _lengths(rate: int) -> list[torch.Tensor]:
    # unequal lengths, the longest not first, one a whole number of hops and one not
    return [_speech_like(s, rate, i) for i, s in enumerate((0.61, 1.37, 0.5, 1.0))]


def _whisper_alone(wav: torch.Tensor) -> torch.Tensor:
    window = torch.hann_window(audio.WHISPER_N_FFT, periodic=True)
    stft = torch.stft(wav, audio.WHISPER_N_FFT, audio.WHISPER_HOP, window=window, center=True, pad_mode="reflect",
                      return_complex=True)
    bank = audio.slaney_mel_filterbank(audio.TOKENIZER_SAMPLE_RATE, audio.WHISPER_N_FFT, audio.WHISPER_N_MELS)
    log_mel = torch.clamp(bank @ stft[..., :-1].abs() ** 2, min=1e-10).log10()
    return (torch.maximum(log_mel, log_mel.max() - audio.WHISPER_DYNAMIC_RANGE) + 4.0) / 4.0


def _fbank_alone(wav: torch.Tensor) -> torch.Tensor:
    frames = wav.unfold(0, audio.FBANK_FRAME, audio.FBANK_SHIFT)
    frames = frames - frames.mean(dim=1, keepdim=True)
    frames = frames - audio.FBANK_PREEMPHASIS * torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    window = torch.hann_window(audio.FBANK_FRAME, periodic=False).pow(audio.FBANK_POVEY_POWER)
    frames = torch.nn.functional.pad(frames * window, (0, audio.FBANK_N_FFT - audio.FBANK_FRAME))
    energies = torch.fft.rfft(frames).abs().pow(2.0) @ audio.kaldi_mel_banks().T
    return torch.clamp(energies, min=torch.finfo(torch.float32).eps).log()


def _prompt_mel_alone(wav: torch.Tensor, dims) -> torch.Tensor:
    pad = (dims.n_fft - dims.hop_size) // 2
    padded = torch.nn.functional.pad(wav[None, None], (pad, pad), mode="reflect")[0, 0]
    stft = torch.stft(padded, dims.n_fft, hop_length=dims.hop_size, win_length=dims.win_size,
                      window=torch.hann_window(dims.win_size, periodic=True), center=dims.center, pad_mode="reflect",
                      return_complex=True)
    magnitude = torch.sqrt(stft.real.pow(2) + stft.imag.pow(2) + audio.MATCHA_MAG_EPS)
    basis = audio.slaney_mel_filterbank(dims.sampling_rate, dims.n_fft, dims.num_mels, dims.fmin, dims.fmax)
    return torch.log(torch.clamp(basis @ magnitude, min=audio.MATCHA_LOG_FLOOR)).T


def _assert_each_alone(batch: list[torch.Tensor], alone: list[torch.Tensor]) -> None:
    assert [b.shape for b in batch] == [a.shape for a in alone]
    for got, want in zip(batch, alone, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_whisper_log_mels_of_a_batch_are_each_prompt_s_own():
    wavs = _lengths(audio.TOKENIZER_SAMPLE_RATE)
    _assert_each_alone(whisper_log_mels(wavs), [_whisper_alone(w) for w in wavs])


def test_a_loud_prompt_does_not_lift_a_quiet_one_s_floor():
    """Whisper's floor is 8 log10 units under the prompt's own maximum, not the batch's."""
    quiet, loud = _speech_like(0.5, 16000, 0) * 1e-3, _speech_like(0.8, 16000, 1) * 10.0
    got = whisper_log_mels([quiet, loud])
    _assert_each_alone(got, [_whisper_alone(quiet), _whisper_alone(loud)])
    assert got[0].max() < got[1].max() - 1.0


def test_kaldi_fbanks_and_speaker_features_of_a_batch_are_each_prompt_s_own():
    wavs = _lengths(audio.TOKENIZER_SAMPLE_RATE)
    alone = [_fbank_alone(w) for w in wavs]
    _assert_each_alone(kaldi_fbanks(wavs), alone)
    _assert_each_alone(speaker_features_batch(wavs), [f - f.mean(dim=0, keepdim=True) for f in alone])


@pytest.mark.parametrize("center", [False, True])
def test_prompt_mels_of_a_batch_are_each_prompt_s_own(checkpoint, center):
    dims = dataclasses.replace(checkpoint.hparams.mel, center=center)
    wavs = _lengths(dims.sampling_rate)
    _assert_each_alone(prompt_mels(wavs, dims), [_prompt_mel_alone(w, dims) for w in wavs])


def test_a_prompt_shorter_than_one_fbank_frame_is_named():
    from cosystream.errors import BadInput

    with pytest.raises(BadInput, match="shorter than one 25 ms frame"):
        kaldi_fbanks([_speech_like(0.5, 16000, 0), torch.zeros(100)])
