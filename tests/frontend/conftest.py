"""Frontend test fixtures: one Frontend per session, the fixture set's wavs, and a wav writer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosystream.frontend import Frontend


@pytest.fixture(scope="session")
def frontend(checkpoint) -> Frontend:
    return Frontend(checkpoint)


@pytest.fixture(scope="session")
def prompt_wav(fixture_dir: Path, manifest: dict) -> Path:
    """The prompt file the official zero-shot run was given."""
    return fixture_dir / manifest["frontend"]["prompt_wav_passed"]


@pytest.fixture(scope="session")
def prompt_wav_at(fixture_dir: Path, manifest: dict) -> Callable[[int], Path]:
    """The fixture set's prompt file recorded at a given sample rate."""

    def find(sample_rate: int) -> Path:
        names = [name for name, info in manifest["wav"].items() if isinstance(info, dict)
                 and info.get("sr") == sample_rate]
        assert names, f"the fixture set has no {sample_rate} Hz prompt"
        return fixture_dir / names[0]

    return find


@pytest.fixture
def write_audio(tmp_path: Path) -> Callable[..., Path]:
    """write_audio("x.wav", samples [N] or [N, C], sample_rate, **soundfile kwargs) -> path."""

    def write(name: str, samples: np.ndarray, sample_rate: int, **kwargs) -> Path:
        path = tmp_path / name
        sf.write(str(path), samples, sample_rate, **kwargs)
        return path

    return write


@pytest.fixture(scope="session")
def speech_like() -> Callable[..., np.ndarray]:
    """speech_like(seconds, sample_rate, channels=1) -> float32 [N] or [N, C], a voiced-sounding signal."""
    return _speech_like


def _speech_like(seconds: float, sample_rate: int, channels: int = 1, seed: int = 0) -> np.ndarray:
    # Harmonics of a gliding pitch under a syllable-rate envelope, plus a little noise.
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    pitch = 120.0 + 30.0 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / sample_rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = 0.5 * (1.0 + np.sin(2 * np.pi * 4.0 * t))
    noise = np.random.default_rng(seed).normal(0.0, 0.01, t.shape)
    mono = (0.2 * voiced * envelope + noise).astype(np.float32)
    return mono if channels == 1 else np.stack([mono * (1.0 - 0.2 * c) for c in range(channels)], axis=1)
