"""Band-limited resampling with a windowed-sinc polyphase kernel (spec/frontend.md §1).

PARITY: reproduces torchaudio's `transforms.Resample` defaults (Hann-windowed sinc, 6 zero
crossings, rolloff 0.99, kernel built in float64 and stored as float32), which the official
`load_wav` uses, without depending on torchaudio.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

LOWPASS_FILTER_WIDTH = 6  # zero crossings of the sinc on each side
ROLLOFF = 0.99  # cutoff as a fraction of the lower Nyquist rate

# A rate pair with no large common divisor (e.g. 44101 -> 16000) would need one kernel row per
# output phase; above this many kernel taps we hand over to soxr instead of allocating gigabytes.
MAX_KERNEL_TAPS = 4_000_000


def _reduced_rates(orig_sr: int, new_sr: int) -> tuple[int, int]:
    gcd = math.gcd(orig_sr, new_sr)
    return orig_sr // gcd, new_sr // gcd


@lru_cache(maxsize=16)
def _sinc_kernel(orig: int, new: int) -> tuple[torch.Tensor, int]:
    """Kernel [new, 1, 2*width + orig] for the reduced rates, and the half-width in input samples."""
    base = min(orig, new) * ROLLOFF
    width = math.ceil(LOWPASS_FILTER_WIDTH * orig / base)
    taps = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    phases = torch.arange(0, -new, -1, dtype=torch.float64)[:, None, None] / new
    t = ((phases + taps) * base).clamp_(-LOWPASS_FILTER_WIDTH, LOWPASS_FILTER_WIDTH)
    window = torch.cos(t * math.pi / LOWPASS_FILTER_WIDTH / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t)
    kernel = (sinc * window * (base / orig)).to(torch.float32)
    return kernel, width


@lru_cache(maxsize=16)
def _kernel_on(orig: int, new: int, device: torch.device) -> torch.Tensor:
    """The kernel on `device`, copied there once (a copy per call would make the host wait for the device)."""
    return _sinc_kernel(orig, new)[0].to(device)


def num_resampled(num_samples: int, orig_sr: int, new_sr: int) -> int:
    """Output length for `num_samples` input samples: ceil(num_samples * new / orig)."""
    orig, new = _reduced_rates(orig_sr, new_sr)
    return -(-num_samples * new // orig)


def resample(wav: torch.Tensor, orig_sr: int, new_sr: int) -> torch.Tensor:
    """Resample a float32 waveform [..., N] from `orig_sr` to `new_sr` Hz, on the waveform's device.

    Returns [..., ceil(N * new_sr / orig_sr)]; the input itself when the rates are equal.
    """
    if orig_sr == new_sr:
        return wav
    orig, new = _reduced_rates(orig_sr, new_sr)
    width = math.ceil(LOWPASS_FILTER_WIDTH * orig / (min(orig, new) * ROLLOFF))
    if new * (2 * width + orig) > MAX_KERNEL_TAPS:
        return _resample_soxr(wav.cpu(), orig_sr, new_sr).to(wav.device)
    kernel = _kernel_on(orig, new, wav.device)
    shape = wav.shape
    flat = wav.reshape(-1, shape[-1]).to(torch.float32)
    padded = torch.nn.functional.pad(flat, (width, width + orig))
    out = torch.nn.functional.conv1d(padded[:, None], kernel, stride=orig)  # [B, new, N/orig + 1]
    out = out.transpose(1, 2).reshape(flat.shape[0], -1)[:, : num_resampled(shape[-1], orig_sr, new_sr)]
    return out.reshape(*shape[:-1], out.shape[-1])


def _resample_soxr(wav: torch.Tensor, orig_sr: int, new_sr: int) -> torch.Tensor:
    import soxr  # only for unusual rate pairs; the official rates never get here

    flat = wav.reshape(-1, wav.shape[-1]).to(torch.float32).numpy()
    rows = [soxr.resample(row, orig_sr, new_sr, quality="VHQ") for row in flat]
    out = torch.from_numpy(np.stack(rows).astype(np.float32))
    return out.reshape(*wav.shape[:-1], out.shape[-1])
