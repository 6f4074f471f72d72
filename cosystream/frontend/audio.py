"""Prompt audio in, prompt features out: loading, checks, and the three spectral front ends.

Implements spec/frontend.md §1 (loading), §4 (whisper 128-bin log-mel for the speech tokenizer),
§5 (Kaldi fbank for CAM++), §6 (the 24 kHz Matcha mel of the flow prompt) and §7 (token/mel
alignment). Mel filterbanks are computed here, never shipped.
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from cosystream.checkpoint import MelDims
from cosystream.errors import BadInput
from cosystream.frontend.resample import resample

# Rates (spec/frontend.md §1).
TOKENIZER_SAMPLE_RATE = 16000  # speech tokenizer and CAM++ input
FLOW_SAMPLE_RATE = 24000  # flow prompt mel and output audio
MIN_INPUT_SAMPLE_RATE = 8000  # lower rates are upsampled; the official code rejects < 16 kHz

# Prompt limits.
MAX_PROMPT_S = 30.0  # the speech tokenizer refuses longer input (spec/frontend.md §4)
MIN_PROMPT_S = 0.5  # ~12 speech tokens; shorter prompts carry too little voice to clone
SILENCE_PEAK = 1e-4  # -80 dBFS: below this peak the file holds no usable speech

# Whisper log-mel (spec/frontend.md §4).
WHISPER_N_FFT = 400  # 25 ms at 16 kHz
WHISPER_HOP = 160  # 10 ms -> 100 frames/s
WHISPER_N_MELS = 128
WHISPER_DYNAMIC_RANGE = 8.0  # log10 units kept below the utterance maximum

# Kaldi fbank for CAM++ (spec/frontend.md §5).
FBANK_FRAME = 400  # 25 ms at 16 kHz
FBANK_SHIFT = 160  # 10 ms
FBANK_N_FFT = 512  # the frame zero-padded to a power of two
FBANK_N_MELS = 80
FBANK_LOW_HZ = 20.0
FBANK_PREEMPHASIS = 0.97
FBANK_POVEY_POWER = 0.85

MATCHA_MAG_EPS = 1e-9  # added under the sqrt of the magnitude
MATCHA_LOG_FLOOR = 1e-5

AudioInput = str | Path | bytes | tuple[np.ndarray | torch.Tensor, int]  # path, file bytes, (samples, rate)


@dataclass(frozen=True)
class PromptAudio:
    """A checked prompt, mono float32 in [-1, 1] at its own rate, and at the two rates the frontend needs.

    The resampled waveforms are made on the CPU when first read; the engine's GPU analysis instead resamples
    `samples` where it analyses them (`at_rates` on a device copy), sparing its frontend threads the work."""

    samples: torch.Tensor  # [N] at sample_rate
    sample_rate: int
    flow_sample_rate: int = FLOW_SAMPLE_RATE

    @cached_property
    def wav_16k(self) -> torch.Tensor:  # [N16]
        return to_16k(self.samples, self.sample_rate)

    @cached_property
    def wav_24k(self) -> torch.Tensor:  # [N24] at flow_sample_rate
        return resample(self.samples, self.sample_rate, self.flow_sample_rate)

    def at_rates(self, samples: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(16 kHz, flow rate) waveforms of `samples` (by default this prompt's own), on their device."""
        samples = self.samples if samples is None else samples
        return to_16k(samples, self.sample_rate), resample(samples, self.sample_rate, self.flow_sample_rate)


def load_audio(source: AudioInput, field: str = "prompt_wav",
               max_seconds: float | None = None) -> tuple[torch.Tensor, int]:
    """Decode a file path, file bytes or (samples, sample_rate) to mono float32 [N] and its rate.

    Samples may be [N], [N, C] (soundfile's layout) or [C, N] (torchaudio's); channels are
    averaged (PARITY: spec/frontend.md §1). A file longer than `max_seconds` is refused before
    it is decoded. Errors are `BadInput("field: reason")`.
    """
    if isinstance(source, tuple):
        samples, sample_rate = source
        data = torch.as_tensor(np.asarray(samples), dtype=torch.float32)
        if data.ndim == 2:  # the channel axis is the short one: even 0.5 s is thousands of samples
            data = data.mean(dim=int(data.shape[0] > data.shape[1]))
        elif data.ndim != 1:
            raise BadInput(f"{field}: expected samples shaped [N] or [N, channels], got {tuple(data.shape)}")
        return _check_decoded(data, int(sample_rate), field)
    frames, sample_rate = _decode_file(source, field, max_seconds)
    if frames.shape[1] == 1:  # mono: the channel itself (its mean over one channel, without the pass)
        return _check_decoded(torch.from_numpy(frames[:, 0].copy()), sample_rate, field)
    return _check_decoded(torch.from_numpy(frames.T.copy()).mean(dim=0), sample_rate, field)


_OPENING = re.compile(r"^Error opening (?:<[^>]*>|'.*'|\".*\"|\S+): ")


def _decode_file(source: str | Path | bytes, field: str, max_seconds: float | None) -> tuple[np.ndarray, int]:
    name = "uploaded audio" if isinstance(source, bytes) else str(source)
    if not isinstance(source, bytes) and not Path(source).is_file():
        raise BadInput(f"{field}: {name}: no such file")
    try:
        with sf.SoundFile(io.BytesIO(source) if isinstance(source, bytes) else str(source)) as audio:
            if max_seconds is not None and audio.frames > max_seconds * audio.samplerate:
                raise BadInput(f"{field}: {audio.frames / audio.samplerate:.1f} s is too long "
                               f"(maximum {max_seconds:.0f} s)")
            return audio.read(dtype="float32", always_2d=True), int(audio.samplerate)
    except (RuntimeError, TypeError) as exc:  # libsndfile errors; TypeError for headerless formats
        raise BadInput(f"{field}: {name}: not a readable audio file (wav/flac/mp3/ogg): {_reason(exc)}") from None


def _reason(exc: Exception) -> str:
    """libsndfile's reason without its "Error opening <what>: " prefix, which names an in-memory upload by its
    object repr (<_io.BytesIO object at 0x...>); the message names the field and file itself."""
    return _OPENING.sub("", str(exc)).strip() or type(exc).__name__


def _check_decoded(data: torch.Tensor, sample_rate: int, field: str) -> tuple[torch.Tensor, int]:
    if data.numel() == 0:
        raise BadInput(f"{field}: the audio is empty (0 samples)")
    if sample_rate < MIN_INPUT_SAMPLE_RATE:
        raise BadInput(f"{field}: sample rate {sample_rate} Hz is below the minimum {MIN_INPUT_SAMPLE_RATE} Hz")
    if not math.isfinite(float(data.abs().max())):  # the peak is NaN or inf where any sample is: one quick pass
        raise BadInput(f"{field}: the audio contains NaN or infinite samples")
    return data, sample_rate


def load_speech(source: AudioInput, field: str = "prompt_wav") -> tuple[torch.Tensor, int]:
    """`load_audio` plus the checks a speech input must pass: 0.5-30 s long and not silent."""
    data, sample_rate = load_audio(source, field, max_seconds=MAX_PROMPT_S)
    duration_s = data.numel() / sample_rate
    if duration_s < MIN_PROMPT_S:
        raise BadInput(f"{field}: {duration_s:.2f} s is too short (minimum {MIN_PROMPT_S} s)")
    if duration_s > MAX_PROMPT_S:
        raise BadInput(f"{field}: {duration_s:.1f} s is too long (maximum {MAX_PROMPT_S:.0f} s)")
    if float(data.abs().max()) < SILENCE_PEAK:
        raise BadInput(f"{field}: the audio is silent (peak below {SILENCE_PEAK:g})")
    return data, sample_rate


def to_16k(data: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """Resample to the tokenizer rate, never past the tokenizer's 30 s (resampling rounds up)."""
    wav_16k = resample(data, sample_rate, TOKENIZER_SAMPLE_RATE)
    return wav_16k[: int(MAX_PROMPT_S * TOKENIZER_SAMPLE_RATE)]


def prepare_prompt_audio(source: AudioInput, flow_sample_rate: int = FLOW_SAMPLE_RATE,
                         field: str = "prompt_wav") -> PromptAudio:
    """Load once and check (the official code decodes three times); resampled when its waveforms are read."""
    data, sample_rate = load_speech(source, field)
    return PromptAudio(data, sample_rate, flow_sample_rate)


# mel filterbanks

_SLANEY_HZ_PER_MEL = 200.0 / 3.0  # linear part, below 1 kHz
_SLANEY_LOG_HZ = 1000.0
_SLANEY_LOG_MEL = _SLANEY_LOG_HZ / _SLANEY_HZ_PER_MEL
_SLANEY_LOG_STEP = math.log(6.4) / 27.0  # 27 mels per factor 6.4 above 1 kHz


def _hz_to_slaney_mel(hz: np.ndarray) -> np.ndarray:
    log_part = _SLANEY_LOG_MEL + np.log(np.maximum(hz, 1e-10) / _SLANEY_LOG_HZ) / _SLANEY_LOG_STEP
    return np.where(hz >= _SLANEY_LOG_HZ, log_part, hz / _SLANEY_HZ_PER_MEL)


def _slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    log_part = _SLANEY_LOG_HZ * np.exp(_SLANEY_LOG_STEP * (mel - _SLANEY_LOG_MEL))
    return np.where(mel >= _SLANEY_LOG_MEL, log_part, mel * _SLANEY_HZ_PER_MEL)


@lru_cache(maxsize=8)
def slaney_mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                          fmax: float | None = None) -> torch.Tensor:
    """Triangular filters on the Slaney mel scale with Slaney area normalisation, [n_mels, n_fft//2+1].

    PARITY: equals librosa `filters.mel(sr, n_fft, n_mels, fmin, fmax)` (htk=False, norm="slaney"),
    which is also whisper's `mel_filters.npz` for (16000, 400, 128).
    """
    fmax = sample_rate / 2.0 if fmax is None else float(fmax)
    fft_hz = np.fft.rfftfreq(n_fft, d=1.0 / sample_rate)
    edges_mel = np.linspace(_hz_to_slaney_mel(np.array(fmin)), _hz_to_slaney_mel(np.array(fmax)), n_mels + 2)
    edges_hz = _slaney_mel_to_hz(edges_mel)
    widths = np.diff(edges_hz)
    ramps = edges_hz[:, None] - fft_hz[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)
    weights *= (2.0 / (edges_hz[2:] - edges_hz[:-2]))[:, None]
    return torch.from_numpy(weights)


def _kaldi_mel(hz: torch.Tensor) -> torch.Tensor:
    return 1127.0 * torch.log(1.0 + hz / 700.0)


@lru_cache(maxsize=2)
def kaldi_mel_banks(n_mels: int = FBANK_N_MELS, sample_rate: int = TOKENIZER_SAMPLE_RATE) -> torch.Tensor:
    """Kaldi's triangular filters, equally spaced on 1127 ln(1 + f/700) from 20 Hz to Nyquist.

    [n_mels, FBANK_N_FFT//2 + 1]; the Nyquist bin gets weight 0, as in Kaldi.
    """
    low = _kaldi_mel(torch.tensor(FBANK_LOW_HZ))
    high = _kaldi_mel(torch.tensor(sample_rate / 2.0))
    delta = (high - low) / (n_mels + 1)
    idx = torch.arange(n_mels, dtype=torch.float32).unsqueeze(1)
    left, center, right = low + idx * delta, low + (idx + 1.0) * delta, low + (idx + 2.0) * delta
    bin_mel = _kaldi_mel((sample_rate / FBANK_N_FFT) * torch.arange(FBANK_N_FFT // 2, dtype=torch.float32))
    up = (bin_mel - left) / (center - left)
    down = (right - bin_mel) / (right - center)
    banks = torch.clamp(torch.minimum(up, down), min=0.0)
    return torch.nn.functional.pad(banks, (0, 1))


# features

@lru_cache(maxsize=16)
def _window(size: int, periodic: bool, power: float, device: torch.device) -> torch.Tensor:
    """A Hann window (raised to `power`) made once per device: the GPU path never copies it per call."""
    window = torch.hann_window(size, periodic=periodic, device=device)
    return window if power == 1.0 else window.pow(power)


@lru_cache(maxsize=16)
def _device_filterbank(device: torch.device, kind: str, *args: float | int | None) -> torch.Tensor:
    bank = slaney_mel_filterbank(*args) if kind == "slaney" else kaldi_mel_banks(*args)  # type: ignore[arg-type]
    return bank.to(device)


def whisper_log_mel(wav_16k: torch.Tensor) -> torch.Tensor:
    """Speech-tokenizer input: [N] 16 kHz samples -> [128, N // 160] scaled log10 mel (on the samples' device)."""
    window = _window(WHISPER_N_FFT, True, 1.0, wav_16k.device)
    stft = torch.stft(wav_16k, WHISPER_N_FFT, WHISPER_HOP, window=window, center=True,
                      pad_mode="reflect", return_complex=True)
    power = stft[..., :-1].abs() ** 2  # PARITY: whisper drops the last frame
    mel = _device_filterbank(wav_16k.device, "slaney", TOKENIZER_SAMPLE_RATE, WHISPER_N_FFT, WHISPER_N_MELS) @ power
    log_mel = torch.clamp(mel, min=1e-10).log10()
    log_mel = torch.maximum(log_mel, log_mel.max() - WHISPER_DYNAMIC_RANGE)
    return (log_mel + 4.0) / 4.0


def kaldi_fbank(wav_16k: torch.Tensor) -> torch.Tensor:
    """CAM++ input before normalisation: [N] 16 kHz samples -> [1 + (N - 400)//160, 80] log mel energies.

    Kaldi defaults with dither 0 and snip_edges (spec/frontend.md §5); the waveform is not
    scaled to the int16 range.
    """
    if wav_16k.numel() < FBANK_FRAME:
        raise BadInput(f"audio: {wav_16k.numel()} samples at 16 kHz is shorter than one 25 ms frame")
    frames = wav_16k.unfold(0, FBANK_FRAME, FBANK_SHIFT)  # [T, 400]
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)  # the first sample is its own predecessor
    frames = frames - FBANK_PREEMPHASIS * previous
    window = _window(FBANK_FRAME, False, FBANK_POVEY_POWER, wav_16k.device)
    frames = torch.nn.functional.pad(frames * window, (0, FBANK_N_FFT - FBANK_FRAME))
    power = torch.fft.rfft(frames).abs().pow(2.0)  # [T, 257]
    energies = power @ _device_filterbank(wav_16k.device, "kaldi", FBANK_N_MELS, TOKENIZER_SAMPLE_RATE).T
    return torch.clamp(energies, min=torch.finfo(torch.float32).eps).log()


def speaker_features(wav_16k: torch.Tensor) -> torch.Tensor:
    """Kaldi fbank minus its mean over time: exactly what CAM++ receives, [T, 80]."""
    feats = kaldi_fbank(wav_16k)
    return feats - feats.mean(dim=0, keepdim=True)


def prompt_mel(wav_24k: torch.Tensor, dims: MelDims) -> torch.Tensor:
    """Flow prompt mel (Matcha `mel_spectrogram`): [M] 24 kHz samples -> [M // hop, num_mels], natural log."""
    pad = (dims.n_fft - dims.hop_size) // 2
    padded = torch.nn.functional.pad(wav_24k[None, None], (pad, pad), mode="reflect")[0, 0]
    window = _window(dims.win_size, True, 1.0, wav_24k.device)
    stft = torch.stft(padded, dims.n_fft, hop_length=dims.hop_size, win_length=dims.win_size, window=window,
                      center=dims.center, pad_mode="reflect", normalized=False, onesided=True,
                      return_complex=True)
    magnitude = torch.sqrt(stft.real.pow(2) + stft.imag.pow(2) + MATCHA_MAG_EPS)
    basis = _device_filterbank(wav_24k.device, "slaney", dims.sampling_rate, dims.n_fft, dims.num_mels,
                               dims.fmin, dims.fmax)
    mel = basis @ magnitude
    return torch.log(torch.clamp(mel, min=MATCHA_LOG_FLOOR)).T.contiguous()


def align_prompt(tokens: torch.Tensor, mel: torch.Tensor, token_mel_ratio: int = 2
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut tokens [P'] and mel [F', 80] to n = min(F' // ratio, P') tokens and ratio*n frames (spec §7)."""
    num_tokens = min(mel.shape[0] // token_mel_ratio, tokens.shape[0])
    return tokens[:num_tokens].contiguous(), mel[: token_mel_ratio * num_tokens].contiguous()


def voiced_signal(seconds: float, rate: int, seed: int) -> torch.Tensor:
    """A speech-like signal (tests, the engine's warm-up): harmonics of a gliding pitch under a syllable-rate
    envelope, plus noise; mono float32 at `rate`."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * rate), dtype=torch.float64) / rate
    pitch = 120 + 40 * torch.sin(2 * math.pi * 0.7 * t) + 20 * torch.rand((), generator=gen, dtype=torch.float64)
    phase = 2 * math.pi * torch.cumsum(pitch, 0) / rate
    voiced = sum(torch.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 * (1 + torch.sin(2 * math.pi * 3.7 * t))
    noise = 0.01 * torch.randn(t.shape, generator=gen, dtype=torch.float64)
    return (0.2 * voiced * envelope + noise).to(torch.float32)
