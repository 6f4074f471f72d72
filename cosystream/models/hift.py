"""The CosyVoice2 vocoder (HiFTGenerator): F0 predictor, NSF source and the iSTFTNet decoder.

spec/hift.md §1-6 (CV2, non-causal). State-dict keys equal the official hift.pt keys after
weight-norm folding (spec/checkpoints.md §3.5, §5); the weights arrive folded, nothing is folded here.
`VocoderStream` is the per-request streaming cache and Hamming cross-fade of spec/streaming.md §3.
"""

from __future__ import annotations

import itertools
import math
import operator
import re

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cosystream.checkpoint.hparams import HiftDims

# Stems whose `weight` is weight-normalised (a g/v pair) in the official hift.pt (spec/checkpoints.md §3.5).
_WEIGHT_NORM_STEM = re.compile(
    r"(conv_pre|conv_post|ups\.\d+|(source_)?resblocks\.\d+\.convs[12]\.\d+|f0_predictor\.condnet\.\d+)"
)
SNAKE_EPS = 1e-9  # PARITY: the official Snake's `no_div_by_zero`
MEL_CACHE_FRAMES = 8  # PARITY: CosyVoice2Model.mel_cache_len (spec/streaming.md §3)


def is_weight_norm_key(key: str) -> bool:
    """True when the folded key `<stem>.weight` is stored as a weight-norm pair in the official hift.pt.

    The norm is always taken over every axis but 0 (for `ups.*` axis 0 is the input channel).
    """
    stem, _, leaf = key.rpartition(".")
    return leaf == "weight" and _WEIGHT_NORM_STEM.fullmatch(stem) is not None


class Snake(nn.Module):
    """Snake(α)(x) = x + sin²(αx)/(α + 1e-9), α per channel in linear scale (spec/hift.md §4)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha[None, :, None]
        # PARITY: same operation order as the official Snake.
        return x + (1.0 / (alpha + SNAKE_EPS)) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    """Three residual units x += B_j(Snake(A_j(Snake(x)))), "same" padding (spec/hift.md §4)."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=(kernel_size - 1) * d // 2)
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2) for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        units = zip(self.activations1, self.convs1, self.activations2, self.convs2, strict=True)
        for act1, conv1, act2, conv2 in units:
            x = conv2(act2(conv1(act1(x)))) + x
        return x


class F0Predictor(nn.Module):
    """`ConvRNNF0Predictor` (no RNN): 5 × (Conv1d k3 + ELU), then |Linear| (spec/hift.md §2)."""

    def __init__(self, in_channels: int, cond_channels: int, num_convs: int = 5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(num_convs):
            conv_in = in_channels if i == 0 else cond_channels
            layers += [nn.Conv1d(conv_in, cond_channels, 3, padding=1), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [B, in, T] → f0 [B, T] in Hz (float32)."""
        hidden = self.condnet(mel.to(self.classifier.weight.dtype))  # [B, C, T]
        return self.classifier(hidden.transpose(1, 2)).squeeze(-1).abs().float()


class SourceModule(nn.Module):
    """NSF excitation: `SineGen2` harmonics + noise merged by Linear(H→1) and tanh (spec/hift.md §3).

    Everything here runs in float32 whatever the module dtype: the phase reaches ~1e4 rad.
    """

    def __init__(self, dims: HiftDims, upsample_scale: int) -> None:
        super().__init__()
        if dims.sampling_rate == 22050:
            raise ValueError("HiftDims: sampling rate 22050 selects the original SineGen (CosyVoice1), "
                             "which is not implemented; CosyVoice2 uses SineGen2")
        self.num_harmonics = dims.nb_harmonics + 1
        self.sampling_rate = dims.sampling_rate
        self.upsample_scale = upsample_scale
        self.sine_amp = dims.nsf_alpha
        self.noise_std = dims.nsf_sigma
        self.voiced_threshold = dims.nsf_voiced_threshold
        self.l_linear = nn.Linear(self.num_harmonics, 1)

    def harmonic_phase(self, f0: torch.Tensor) -> torch.Tensor:
        """f0 [B, T] Hz → per-sample phase [B, U·T, H] (rad, float32), CV2 linear interpolation."""
        harmonics = torch.arange(1, self.num_harmonics + 1, dtype=torch.float32, device=f0.device)
        # PARITY: the official linear ×1/U downsample of per-sample increments reads the average of
        # samples Uk+U/2−1 and Uk+U/2, which equals the frame's own increment (f0 is piecewise
        # constant), so the random initial phase added at sample 0 never reaches the output (§3.2).
        rad = torch.remainder(f0.float()[:, :, None] * harmonics / self.sampling_rate, 1.0)  # [B, T, H]
        phase = torch.cumsum(rad, dim=1) * 2 * math.pi  # [B, T, H]
        phase = F.interpolate(phase.transpose(1, 2) * self.upsample_scale,
                              scale_factor=self.upsample_scale, mode="linear")  # [B, H, U·T]
        return phase.transpose(1, 2)

    def forward(self, f0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """f0 [B, T] Hz, noise [B, U·T, H] standard normal → source [B, 1, U·T] (float32)."""
        batch, num_frames = f0.shape
        sine = torch.sin(self.harmonic_phase(f0)) * self.sine_amp  # [B, U·T, H]
        uv = (f0.float() > self.voiced_threshold).float()  # [B, T]
        uv = uv[:, :, None, None].expand(batch, num_frames, self.upsample_scale, 1)
        uv = uv.reshape(batch, num_frames * self.upsample_scale, 1)  # nearest ×U
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        excitation = sine * uv + noise_amp * noise.float()  # [B, U·T, H]
        merged = F.linear(excitation, self.l_linear.weight.float(), self.l_linear.bias.float())
        return torch.tanh(merged).transpose(1, 2)


def _hann_window(n_fft: int, device: torch.device) -> torch.Tensor:
    # PARITY: periodic Hann computed in float64 then rounded, bitwise equal to scipy's get_window('hann').
    # Built per call rather than kept as a buffer so that `.to(bfloat16)` cannot round it.
    return torch.hann_window(n_fft, periodic=True, dtype=torch.float64, device=device).float()


def _overlap_add(frames: torch.Tensor, hop: int) -> torch.Tensor:
    """frames [B, F, N] → [B, N + hop·(F−1)]: frame f added at offset hop·f."""
    batch, num_frames, n = frames.shape
    length = n + hop * (num_frames - 1)
    out = F.fold(frames.transpose(1, 2), output_size=(1, length), kernel_size=(1, n), stride=(1, hop))
    return out.reshape(batch, length)


def stft(wav: torch.Tensor, n_fft: int, hop: int) -> torch.Tensor:
    """Centered STFT (reflect pad n_fft/2), periodic Hann: wav [B, L] → [B, n_fft + 2, L/hop + 1].

    Channels are the n_fft/2+1 real parts then the imaginary parts (spec/hift.md §1). float32.
    """
    padded = F.pad(wav.float()[:, None], (n_fft // 2, n_fft // 2), mode="reflect")[:, 0]
    frames = padded.unfold(-1, n_fft, hop) * _hann_window(n_fft, wav.device)  # [B, F, n_fft]
    spec = torch.fft.rfft(frames, dim=-1).transpose(1, 2)  # [B, n_fft/2+1, F]
    return torch.cat([spec.real, spec.imag], dim=1)


def istft(magnitude: torch.Tensor, phase: torch.Tensor, n_fft: int, hop: int) -> torch.Tensor:
    """Centered one-sided inverse STFT: magnitude, phase [B, n_fft/2+1, F] → wav [B, hop·(F−1)].

    Same maths as torch.istft (C2R per frame, window, overlap-add, divide by the summed squared
    window, drop n_fft/2 at each end) without its host-synchronising window check.
    """
    # PERF: torch.istft reads the envelope minimum on the host (a sync that breaks graph capture).
    spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
    window = _hann_window(n_fft, magnitude.device)
    frames = torch.fft.irfft(spec.transpose(1, 2), n=n_fft, dim=-1) * window  # [B, F, n_fft]
    wav = _overlap_add(frames, hop)
    envelope = _overlap_add(window.square().expand(1, frames.shape[1], n_fft), hop)
    trim = slice(n_fft // 2, wav.shape[1] - n_fft // 2)
    return wav[:, trim] / envelope[:, trim]


class HiFTGenerator(nn.Module):
    """CosyVoice2 HiFT: mel [B, 80, T] (natural-log mel, 50 Hz) → wav [B, U·T] at 24 kHz, U = 480.

    Convolutions run in the module dtype; the source, its STFT, the output head and the iSTFT stay in
    float32. Batches of equal-length rows are supported everywhere; nothing syncs with the host.
    """

    def __init__(self, dims: HiftDims) -> None:
        super().__init__()
        rates, kernels = dims.upsample_rates, dims.upsample_kernel_sizes
        base, n_fft = dims.base_channels, dims.istft_n_fft
        self.n_fft, self.hop = n_fft, dims.istft_hop_len
        self.upsample_scale = math.prod(rates) * dims.istft_hop_len
        self.lrelu_slope, self.audio_limit = dims.lrelu_slope, dims.audio_limit
        self.num_kernels = len(dims.resblock_kernel_sizes)
        self.m_source = SourceModule(dims, self.upsample_scale)
        self.f0_predictor = F0Predictor(dims.in_channels, dims.f0_cond_channels)
        self.conv_pre = nn.Conv1d(dims.in_channels, base, 7, padding=3)
        self.ups = nn.ModuleList(
            nn.ConvTranspose1d(base // 2**i, base // 2 ** (i + 1), k, u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(rates, kernels, strict=True))
        )
        self.source_downs, self.source_resblocks = self._build_source_path(dims)
        self.resblocks = nn.ModuleList(
            ResBlock(base // 2 ** (i + 1), k, tuple(d))
            for i in range(len(rates))
            for k, d in zip(dims.resblock_kernel_sizes, dims.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = nn.Conv1d(base // 2 ** len(rates), n_fft + 2, 7, padding=3)

    @staticmethod
    def _build_source_path(dims: HiftDims) -> tuple[nn.ModuleList, nn.ModuleList]:
        # Stage i sees the source STFT downsampled to its own frame rate: strides (5·3, 3, 1) for CV2.
        down_rates = [1, *dims.upsample_rates[::-1][:-1]]
        strides = list(itertools.accumulate(down_rates, operator.mul))[::-1]
        downs, blocks = nn.ModuleList(), nn.ModuleList()
        kernels, dilations = dims.source_resblock_kernel_sizes, dims.source_resblock_dilation_sizes
        specs = zip(strides, kernels, dilations, strict=True)
        for i, (stride, kernel, dilation) in enumerate(specs):
            channels, spec_channels = dims.base_channels // 2 ** (i + 1), dims.istft_n_fft + 2
            if stride == 1:
                downs.append(nn.Conv1d(spec_channels, channels, 1))
            else:
                downs.append(nn.Conv1d(spec_channels, channels, 2 * stride, stride, padding=stride // 2))
            blocks.append(ResBlock(channels, kernel, tuple(dilation)))
        return downs, blocks

    def predict_f0(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [B, 80, T] → f0 [B, T] in Hz (float32)."""
        return self.f0_predictor(mel)

    def make_source(self, f0: torch.Tensor, noise: torch.Tensor | None = None,
                    generator: torch.Generator | None = None) -> torch.Tensor:
        """f0 [B, T] → source [B, 1, U·T] (float32).

        `noise` [B, U·T, H] (standard normal) makes it deterministic; otherwise it is drawn with
        `generator`. The initial random phase of SineGen2 is not drawn: it never reaches the output.
        """
        if noise is None:
            shape = (f0.shape[0], f0.shape[1] * self.upsample_scale, self.m_source.num_harmonics)
            noise = torch.randn(shape, generator=generator, device=f0.device, dtype=torch.float32)
        return self.m_source(f0, noise)

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """mel [B, 80, T], source [B, 1, U·T] → wav [B, U·T] (float32, clamped to ±audio_limit)."""
        dtype = self.conv_pre.weight.dtype
        source_spec = stft(source[:, 0], self.n_fft, self.hop).to(dtype)  # [B, n_fft+2, U·T/hop+1]
        x = self.conv_pre(mel.to(dtype))  # [B, base, T]
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, self.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # PARITY: 1 sample on the left (spec/hift.md §1)
            x = x + self.source_resblocks[i](self.source_downs[i](source_spec))
            x = self._mean_of_resblocks(i, x)
        x = self.conv_post(F.leaky_relu(x)).float()  # PARITY: default slope 0.01 before conv_post
        num_bins = self.n_fft // 2 + 1
        magnitude = torch.exp(x[:, :num_bins]).clamp(max=1e2)
        phase = torch.sin(x[:, num_bins:])  # PARITY: sin of the channel is the angle (spec/hift.md §5)
        wav = istft(magnitude, phase, self.n_fft, self.hop)
        return wav.clamp(-self.audio_limit, self.audio_limit)

    def _mean_of_resblocks(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        blocks = self.resblocks[stage * self.num_kernels:(stage + 1) * self.num_kernels]
        total = blocks[0](x)
        for block in blocks[1:]:
            total = total + block(x)
        return total / self.num_kernels

    def inference(self, mel: torch.Tensor, cache_source: torch.Tensor | None = None,
                  generator: torch.Generator | None = None,
                  noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """mel [B, 80, T] → (wav [B, U·T], source [B, 1, U·T]) (spec/hift.md §6).

        The first L samples of the fresh source are replaced by `cache_source` [B, 1, L] so that the
        excitation of a re-vocoded overlap matches the previous call.
        """
        source = self.make_source(self.predict_f0(mel), noise, generator)
        if cache_source is not None and cache_source.shape[-1] > 0:
            source = torch.cat([cache_source.float(), source[:, :, cache_source.shape[-1]:]], dim=-1)
        return self.decode(mel, source), source


def fade_window(num_overlap_samples: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The symmetric Hamming window of 2·N samples, float64 [2N] (np.hamming)."""
    return torch.from_numpy(np.hamming(2 * num_overlap_samples)).to(device)


def crossfade(wav: torch.Tensor, cached_wav: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """wav [B, L], cached_wav [B, N], window float64 [2N] → wav with its first N samples faded.

    head = wav[:N]·w[:N] + cached·w[N:] (not amplitude-complementary: the sum peaks at ≈1.08).
    """
    n = cached_wav.shape[-1]
    # PARITY: the official multiplies float32 audio by the float64 window, so the fade is computed
    # in float64 and rounded once to float32 (spec/streaming.md §3).
    head = wav[:, :n].double() * window[:n] + cached_wav.double() * window[n:]
    return torch.cat([head.to(wav.dtype), wav[:, n:]], dim=1)


class VocoderStream:
    """The vocoder side of one streaming request (spec/streaming.md §3).

    `push(mel [1, 80, F], final)` returns the next wav chunk [n] (float32, on the model's device):
    n = 480·F − 3840 for the first non-final call, 480·F for later ones, and the final call also
    releases the withheld 3840 samples, so the total is 480 × (total mel frames).
    """

    def __init__(self, hift: HiFTGenerator, mel_cache_frames: int = MEL_CACHE_FRAMES) -> None:
        self.hift = hift
        self.mel_cache_frames = mel_cache_frames
        self.num_overlap_samples = mel_cache_frames * hift.upsample_scale  # 3840
        self.window = fade_window(self.num_overlap_samples, hift.conv_pre.weight.device)
        self.mel_cache: torch.Tensor | None = None  # [1, 80, 8]
        self.source_cache: torch.Tensor | None = None  # [1, 1, 3840]
        self.wav_cache: torch.Tensor | None = None  # [1, 3840], already faded, not yet returned
        self.is_finished = False

    def push(self, mel: torch.Tensor, final: bool, generator: torch.Generator | None = None,
             source: torch.Tensor | None = None) -> torch.Tensor:
        """Vocode the next mel chunk [1, 80, F] → wav [n].

        `source` [1, 1, 480·(F + cached frames)] replaces the generated excitation entirely (its first
        3840 samples should equal the cached source); it exists to replay recorded sources exactly.
        """
        if self.is_finished:
            raise RuntimeError("VocoderStream: push after the final chunk")
        if mel.shape[0] != 1:
            raise ValueError(f"VocoderStream holds one request; got a batch of {mel.shape[0]}")
        if self.mel_cache is not None:
            mel = torch.cat([self.mel_cache, mel.to(self.mel_cache.dtype)], dim=2)
        if source is None:
            wav, source = self.hift.inference(mel, self.source_cache, generator)
        else:
            wav = self.hift.decode(mel, source)
        if self.wav_cache is not None:
            wav = crossfade(wav, self.wav_cache, self.window)
        if final:
            self.is_finished = True
            self.mel_cache = self.source_cache = self.wav_cache = None
            return wav[0]
        self.mel_cache = mel[:, :, -self.mel_cache_frames:]
        self.source_cache = source[:, :, -self.num_overlap_samples:]
        self.wav_cache = wav[:, -self.num_overlap_samples:]
        return wav[0, :-self.num_overlap_samples]
