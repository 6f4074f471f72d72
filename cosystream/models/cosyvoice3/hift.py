"""CosyVoice3 vocoder `CausalHiFTGenerator` (spec/cosyvoice3.md §6, spec/hift.md §7).

Every convolution is causal or has a fixed right context, the F0 predictor runs in float64, the
source phase is a per-frame staircase and its noise is a fixed uniform table indexed by absolute
sample. `CausalHiFT.inference` is the official whole-mel call; `HiftStream` vocodes only new frames,
re-running a fixed left context (the receptive field) instead of the whole accumulated mel, with the
phase sum of the frames before that context carried in float64.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cosystream.checkpoint.hparams import CausalHiftDims
from cosystream.models.hift import Snake, istft, stft
from cosystream.transfers import ints_to_device

NOISE_SECONDS = 300  # PARITY: SineGen2 draws rand(1, 300·24000, 9) at construction


class CausalResBlock(nn.Module):
    """Three residual units x += B_j(Snake(A_j(Snake(x)))) with left-only zero padding."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.kernel_size, self.dilations = kernel_size, dilations
        self.convs1 = nn.ModuleList(nn.Conv1d(channels, channels, kernel_size, dilation=d) for d in dilations)
        self.convs2 = nn.ModuleList(nn.Conv1d(channels, channels, kernel_size) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    @property
    def left_context(self) -> int:
        k = self.kernel_size
        return sum((k - 1) * d + (k - 1) for d in self.dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kernel_size
        units = zip(self.activations1, self.convs1, self.activations2, self.convs2, self.dilations, strict=True)
        for act1, conv1, act2, conv2, d in units:
            xt = conv1(F.pad(act1(x), ((k - 1) * d, 0)))
            x = conv2(F.pad(act2(xt), (k - 1, 0))) + x
        return x


class CausalF0Predictor(nn.Module):
    """`CausalConvRNNF0Predictor`: conv k4 with 3 frames of right context, 4 causal convs k3, ELU after
    each, |Linear|. Kept in float64 (the official code casts it, spec/cosyvoice3.md §6)."""

    def __init__(self, in_channels: int, cond_channels: int, look_right: int) -> None:
        super().__init__()
        self.look_right = look_right
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels,
                                 look_right + 1 if i == 0 else 3), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: torch.Tensor, finalize: bool) -> torch.Tensor:
        """mel [B, 80, T] -> f0 [B, T] (finalize) or [B, T − 3] (the last 3 frames are context), float32."""
        x = mel.to(self.classifier.weight.dtype)
        x = F.pad(x, (0, self.look_right)) if finalize else x
        x = self.condnet[1](self.condnet[0](x))
        for i in range(2, len(self.condnet), 2):
            x = self.condnet[i + 1](self.condnet[i](F.pad(x, (2, 0))))
        return self.classifier(x.transpose(1, 2)).squeeze(-1).abs().float()


def noise_rng_state(dims: CausalHiftDims, flow_vocab: int = 6561, flow_input: int = 80, spk_dim: int = 192,
                    mel_bins: int = 80, noise_frames: int = 15000) -> torch.Tensor:
    """torch's CPU RNG state right before the official SineGen2 draws its buffers.

    PARITY: the official construction order: seed 0 (CFM constructor), randn(1, 80, 15000), the flow's
    Embedding(6561, 80) and Linear(192, 80) inits, the F0 predictor's inits (spec/cosyvoice3.md §6).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.randn(1, mel_bins, noise_frames)
        nn.Embedding(flow_vocab, flow_input)
        nn.Linear(spk_dim, mel_bins)
        CausalF0Predictor(dims.in_channels, dims.f0_cond_channels, dims.f0_look_right)
        return torch.get_rng_state()


def sine_noise_table(rng_state: torch.Tensor, num_samples: int, harmonics: int) -> torch.Tensor:
    """The first `num_samples` rows of SineGen2's fixed uniform buffer [1, num_samples, H].

    `rand(1, 9)` (the unused initial phase) is drawn first; torch's CPU uniform draws are sequential, so
    any prefix of `rand(1, 7 200 000, 9)` is the same numbers.
    """
    gen = torch.Generator(device="cpu")
    gen.set_state(rng_state)
    torch.rand(1, harmonics, generator=gen)
    return torch.rand(1, num_samples, harmonics, generator=gen)


class CausalSource(nn.Module):
    """NSF excitation with the CosyVoice3 phase (nearest up-sampling) and fixed noise."""

    def __init__(self, dims: CausalHiftDims, upsample_scale: int) -> None:
        super().__init__()
        self.num_harmonics = dims.nb_harmonics + 1
        self.sampling_rate = dims.sampling_rate
        self.upsample_scale = upsample_scale
        self.sine_amp, self.noise_std = dims.nsf_alpha, dims.nsf_sigma
        self.voiced_threshold = dims.nsf_voiced_threshold
        self.l_linear = nn.Linear(self.num_harmonics, 1)
        self.register_buffer("noise_table", torch.zeros(1, 0, self.num_harmonics), persistent=False)

    def check_noise_range(self, last: int) -> None:
        if last > self.noise_table.shape[1]:
            raise ValueError(f"vocoder input reaches sample {last}; the fixed noise table holds "
                             f"{self.noise_table.shape[1]} ({NOISE_SECONDS} s in the official model)")

    def frame_increments(self, f0: torch.Tensor) -> torch.Tensor:
        """f0 [B, T] -> per-frame phase increments R [B, T, H] (cycles, float32)."""
        harmonics = torch.arange(1, self.num_harmonics + 1, dtype=torch.float32, device=f0.device)
        return torch.remainder(f0.float()[:, :, None] * harmonics / self.sampling_rate, 1.0)

    def forward(self, f0: torch.Tensor, start_frame: int = 0, carry: torch.Tensor | None = None,
                start_sample: torch.Tensor | None = None) -> torch.Tensor:
        """f0 [B, T] of frames [start_frame, start_frame + T) -> source [B, 1, U·T] float32.

        carry [B, H] float64: Σ R over frames [0, start_frame) (None: zeros). start_sample [B] long: each
        row's first sample (U·its start frame), read on the device (a CUDA graph's input), in place of
        `start_frame`; the caller checks the noise table's range then.
        PARITY: the official float32 cumulative sum accumulates in float64 on the CPU; continuing from a
        float64 carry reproduces it, then the phase is rounded to float32 as there.
        """
        batch, frames = f0.shape
        u = self.upsample_scale
        rad = self.frame_increments(f0).double()
        if carry is not None:
            rad = torch.cat([carry.to(rad.device).unsqueeze(1), rad], dim=1)
        phase = torch.cumsum(rad, dim=1)[:, -frames:].float() * 2 * math.pi
        phase = (phase * u).repeat_interleave(u, dim=1)  # [B, U·T, H], nearest
        sine = torch.sin(phase) * self.sine_amp
        uv = (f0.float() > self.voiced_threshold).float().repeat_interleave(u, dim=1).unsqueeze(-1)
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        if start_sample is not None:
            noise = self.noise_table[0][start_sample[:, None] + torch.arange(frames * u, device=f0.device)]
        else:
            self.check_noise_range((start_frame + frames) * u)
            noise = self.noise_table[:, start_frame * u:(start_frame + frames) * u]
        excitation = sine * uv + noise_amp * noise.to(sine.device)
        merged = F.linear(excitation, self.l_linear.weight.float(), self.l_linear.bias.float())
        return torch.tanh(merged).transpose(1, 2)


class CausalHiFT(nn.Module):
    """CausalHiFTGenerator: mel [1, 80, T] -> wav (keys as hift.pt after folding weight norms)."""

    def __init__(self, dims: CausalHiftDims) -> None:
        super().__init__()
        self.dims = dims
        rates, kernels = dims.upsample_rates, dims.upsample_kernel_sizes
        base, n_fft = dims.base_channels, dims.istft_n_fft
        self.n_fft, self.hop = n_fft, dims.istft_hop_len
        self.rates = rates
        self.upsample_scale = math.prod(rates) * dims.istft_hop_len
        self.lrelu_slope, self.audio_limit = dims.lrelu_slope, dims.audio_limit
        self.num_kernels = len(dims.resblock_kernel_sizes)
        self.look_right = dims.conv_pre_look_right
        self.m_source = CausalSource(dims, self.upsample_scale)
        self.f0_predictor = CausalF0Predictor(dims.in_channels, dims.f0_cond_channels, dims.f0_look_right)
        self.conv_pre = nn.Conv1d(dims.in_channels, base, dims.conv_pre_look_right + 1)
        self.ups = nn.ModuleList(nn.Conv1d(base // 2**i, base // 2 ** (i + 1), k)
                                 for i, k in enumerate(kernels))
        down_rates = [1, *rates[::-1][:-1]]
        strides = list(itertools.accumulate(down_rates, operator.mul))[::-1]
        self.down_strides = strides
        self.source_downs = nn.ModuleList(
            nn.Conv1d(n_fft + 2, base // 2 ** (i + 1), 1 if s == 1 else 2 * s, s) for i, s in enumerate(strides))
        self.source_resblocks = nn.ModuleList(
            CausalResBlock(base // 2 ** (i + 1), k, tuple(d))
            for i, (k, d) in enumerate(zip(dims.source_resblock_kernel_sizes, dims.source_resblock_dilation_sizes,
                                           strict=True)))
        self.resblocks = nn.ModuleList(
            CausalResBlock(base // 2 ** (i + 1), k, tuple(d))
            for i in range(len(rates))
            for k, d in zip(dims.resblock_kernel_sizes, dims.resblock_dilation_sizes, strict=True))
        self.conv_post = nn.Conv1d(base // 2 ** len(rates), n_fft + 2, 7)

    # ---------------------------------------------------------------- noise table
    def init_noise(self, num_seconds: float = NOISE_SECONDS, rng_state: torch.Tensor | None = None) -> None:
        """Draw the fixed source noise (the official buffer's first `num_seconds`), from `rng_state` or
        from the official construction recipe."""
        state = noise_rng_state(self.dims) if rng_state is None else rng_state
        samples = int(num_seconds * self.dims.sampling_rate)
        table = sine_noise_table(state, samples, self.m_source.num_harmonics)
        self.m_source.noise_table = table.to(self.conv_pre.weight.device)

    # ---------------------------------------------------------------- pieces
    def predict_f0(self, mel: torch.Tensor, finalize: bool) -> torch.Tensor:
        return self.f0_predictor(mel, finalize)

    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool) -> torch.Tensor:
        """mel [B, 80, T'], source [B, 1, U·T'] -> wav [B, U·T'] (finalize) or [B, U·(T' − 5)]."""
        dtype = self.conv_pre.weight.dtype
        spec = stft(source[:, 0], self.n_fft, self.hop)
        x = mel.to(dtype)
        if finalize:
            x = self.conv_pre(F.pad(x, (0, self.look_right)))
        else:
            x = self.conv_pre(x)
            spec = spec[:, :, :-math.prod(self.rates) * self.look_right]
        spec = spec.to(dtype)
        for i, (up, rate) in enumerate(zip(self.ups, self.rates, strict=True)):
            x = F.leaky_relu(x, self.lrelu_slope).repeat_interleave(rate, dim=2)
            x = up(F.pad(x, (up.kernel_size[0] - 1, 0)))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            stride = self.down_strides[i]
            s = self.source_downs[i](spec if stride == 1 else F.pad(spec, (stride - 1, 0)))
            x = x + self.source_resblocks[i](s)
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            total = blocks[0](x)
            for block in blocks[1:]:
                total = total + block(x)
            x = total / self.num_kernels
        x = self.conv_post(F.pad(F.leaky_relu(x), (6, 0))).float()
        bins = self.n_fft // 2 + 1
        wav = istft(torch.exp(x[:, :bins]).clamp(max=1e2), torch.sin(x[:, bins:]), self.n_fft, self.hop)
        if not finalize:
            wav = wav[:, :-self.upsample_scale]
        return wav.clamp(-self.audio_limit, self.audio_limit)

    def inference(self, mel: torch.Tensor, finalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The official whole-mel call: (wav [1, 480·T] or [1, 480·(T − 8)], source)."""
        f0 = self.predict_f0(mel, finalize)
        source = self.m_source(f0)
        body = mel if finalize else mel[:, :, :-self.f0_predictor.look_right]
        return self.decode(body, source, finalize), source

    def f0_left_context(self) -> int:
        """Frames of left context of the F0 predictor: 2 per causal k3 conv."""
        return 2 * (len(self.f0_predictor.condnet) // 2 - 1)

    def left_context_frames(self) -> int:
        """Mel frames of left context after which a window's output equals the whole-mel output
        (a bound on the receptive field: every causal pad of every path, summed, plus 2 frames)."""
        samples_per_frame = [math.prod(self.rates[:i + 1]) for i in range(len(self.rates))]
        total = self.f0_left_context() + 2  # the causal F0 convs, and a margin of 2 frames
        for i, rate in enumerate(samples_per_frame):
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            left = (self.ups[i].kernel_size[0] - 1 + max(b.left_context for b in blocks)
                    + self.source_resblocks[i].left_context)
            down = self.source_downs[i].kernel_size[0] + self.down_strides[i]
            total += math.ceil(left / rate) + math.ceil(down / samples_per_frame[-1])
        total += math.ceil((6 + self.n_fft) / samples_per_frame[-1])  # conv_post and the STFT/iSTFT frames
        return total


@dataclass
class VocoderWindow:
    """One incremental vocoder call: mel frames [mel_start, total) in, samples from `out_start` of the
    decoded window (which starts at frame `start_frame`) out. Its shape key is (frames, f0_skip,
    out_start, finalize); `mel`, `carry` and the start sample are the per-stream values."""

    mel: torch.Tensor  # [1, 80, frames]
    carry: torch.Tensor  # [1, H] float64: Σ R over frames [0, start_frame)
    start_frame: int
    f0_skip: int  # start_frame − mel_start: F0 left context only
    out_start: int
    finalize: bool
    end_sample: int  # samples emitted after this call

    @property
    def key(self) -> tuple[int, int, int, bool]:
        return self.mel.shape[2], self.f0_skip, self.out_start, self.finalize


def window_audio(hift: CausalHiFT, mel: torch.Tensor, carry: torch.Tensor, start_sample: torch.Tensor,
                 f0_skip: int, out_start: int, finalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of equal key for B streams: mel [B, 80, frames], carry [B, H] float64, start_sample [B] long
    -> (new samples [B, n] float32, f0 [B, f] of the window's frames from its start frame)."""
    f0 = hift.predict_f0(mel, finalize)[:, f0_skip:]
    source = hift.m_source(f0, carry=carry, start_sample=start_sample)
    body = mel[:, :, f0_skip: mel.shape[2] - (0 if finalize else hift.f0_predictor.look_right)]
    return hift.decode(body, source, finalize)[:, out_start:], f0


class HiftStream:
    """Vocode one request incrementally: each push returns exactly the samples the official
    `hift.inference(whole accumulated mel, finalize)` would add after what was already emitted.

    `push` = `window` (bookkeeping: which frames to decode) + `window_audio` (the decode, static in shape
    for a given window key, so a batch of streams' windows can replay one CUDA graph) + `commit`.
    """

    def __init__(self, hift: CausalHiFT) -> None:
        self.hift = hift
        self.context = hift.left_context_frames()
        self.mel: torch.Tensor | None = None  # frames [self.first, total)
        self.first = 0  # absolute frame of self.mel[:, :, 0]
        self.carry: torch.Tensor | None = None  # Σ R over frames [0, self.carry_frames), float64 [1, H]
        self.carry_frames = 0
        self.emitted = 0  # samples
        self.finished = False

    @property
    def total_frames(self) -> int:
        return self.first + (0 if self.mel is None else self.mel.shape[2])

    def push(self, mel: torch.Tensor, finalize: bool) -> torch.Tensor:
        """mel [1, 80, m] new frames -> wav [1, n] new samples (float32)."""
        window = self.window(mel, finalize)
        if window is None:
            return mel.new_zeros(1, 0).float()
        start = ints_to_device([window.start_frame * self.hift.upsample_scale], window.mel.device)
        out, f0 = window_audio(self.hift, window.mel, window.carry, start, window.f0_skip, window.out_start,
                               window.finalize)
        self.commit(window, f0)
        return out

    def window(self, mel: torch.Tensor, finalize: bool) -> VocoderWindow | None:
        """Append the new frames [1, 80, m]; the call that voices them (None: no new samples yet)."""
        if self.finished:
            raise RuntimeError("HiftStream: push after the final chunk")
        h = self.hift
        u = h.upsample_scale
        mel = mel.to(h.conv_pre.weight.dtype)
        self.mel = mel if self.mel is None else torch.cat([self.mel, mel], dim=2)
        total = self.total_frames
        withheld = 0 if finalize else h.f0_predictor.look_right + h.look_right + 1
        end_frame = total - withheld
        if end_frame * u <= self.emitted:
            return None
        ws = self.carry_frames  # the window starts where the carried phase sum ends
        f0_start = max(self.first, ws - h.f0_left_context())
        h.m_source.check_noise_range(total * u)
        carry = self.carry if self.carry is not None else torch.zeros(1, h.m_source.num_harmonics,
                                                                      dtype=torch.float64, device=mel.device)
        return VocoderWindow(mel=self.mel[:, :, f0_start - self.first:], carry=carry, start_frame=ws,
                             f0_skip=ws - f0_start, out_start=self.emitted - ws * u, finalize=finalize,
                             end_sample=end_frame * u)

    def commit(self, window: VocoderWindow, f0: torch.Tensor) -> None:
        """After `window`'s samples are out: fold the carried phase, drop mel no later window reads."""
        self.emitted = window.end_sample
        if window.finalize:
            self.finished = True
        else:
            self._advance(window.start_frame, f0, window.carry)

    def _advance(self, ws: int, f0: torch.Tensor, carry: torch.Tensor) -> None:
        """Fold the increments of frames [ws, next window start) into the carry and drop old mel."""
        next_ws = max(self.emitted // self.hift.upsample_scale - self.context, ws)
        if next_ws > ws:
            rad = self.hift.m_source.frame_increments(f0[:, :next_ws - ws]).double()
            self.carry = torch.cumsum(torch.cat([carry.unsqueeze(1), rad], dim=1), dim=1)[:, -1]
            self.carry_frames = next_ws
        keep_from = max(self.first, next_ws - self.hift.f0_left_context())
        if keep_from > self.first and self.mel is not None:
            self.mel = self.mel[:, :, keep_from - self.first:]
            self.first = keep_from
