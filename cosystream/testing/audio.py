"""A synthetic prompt recording for tests, benchmarks and soak runs (no real speech is needed: the
fixture model's ONNX front-end models are stand-ins and the 0.5B speed runs use random weights)."""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf


def tone_wav(seconds: float = 2.0, sample_rate: int = 16000, seed: int = 0) -> bytes:
    """A gliding tone with a little noise, as 16-bit PCM WAV bytes."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    wav = 0.3 * np.sin(2 * np.pi * (150 + 50 * t) * t) + 0.02 * rng.standard_normal(t.shape)
    out = io.BytesIO()
    sf.write(out, wav.astype(np.float32), sample_rate, format="WAV", subtype="PCM_16")
    return out.getvalue()
