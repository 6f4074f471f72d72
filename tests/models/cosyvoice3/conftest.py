"""Fixtures of the CosyVoice3 golden set (the shipped `tests/fixtures/cosyvoice3-tiny`, or COSYSTREAM_FIXTURES_CV3).

Everything derives sizes from the set itself, so another set that follows the fixtures README (§C)
works unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# `cv3_dir` (the set: tests/fixtures/cosyvoice3-tiny or COSYSTREAM_FIXTURES_CV3) and `cv3_model_dir` (its
# materialised model directory) are in tests/conftest.py: the engine and server tests use them too.


@pytest.fixture(scope="session")
def cv3_manifest(cv3_dir: Path) -> dict:
    return json.loads((cv3_dir / "manifest.json").read_text())


@pytest.fixture(scope="session")
def cv3_tolerances(cv3_dir: Path) -> dict:
    return json.loads((cv3_dir / "tolerances.json").read_text())


@pytest.fixture(scope="session")
def cv3_load(cv3_dir: Path):
    """cv3_load("flow") -> dict of tensors from flow.safetensors."""
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def load(name: str) -> dict[str, torch.Tensor]:
        if name not in cache:
            cache[name] = load_file(str(cv3_dir / f"{name}.safetensors"))
        return cache[name]

    return load


@pytest.fixture(scope="session")
def cv3_checkpoint(cv3_model_dir: Path):
    from cosystream.checkpoint import load_checkpoint

    return load_checkpoint(cv3_model_dir)


@pytest.fixture(scope="session")
def cv3_lm(cv3_checkpoint):
    from cosystream.engine.cv3_loader import load_cv3_llm

    return load_cv3_llm(cv3_checkpoint)


@pytest.fixture(scope="session")
def cv3_noise_table(cv3_dir: Path) -> torch.Tensor | None:
    """The set's stored exact prefix of the seed-0 CFM noise table, or None when the set stores none (the
    generated table is then used; fixtures README: its bits may differ by < 3e-6 across CPU kernels)."""
    path = cv3_dir / "cfm_rand_noise_prefix.safetensors"
    return load_file(str(path))["rand_noise_prefix"] if path.is_file() else None


@pytest.fixture(scope="session")
def cv3_flow(cv3_checkpoint, cv3_noise_table):
    from cosystream.engine.cv3_loader import load_cv3_flow

    flow = load_cv3_flow(cv3_checkpoint)
    if cv3_noise_table is not None:
        flow.decoder.set_noise_table(cv3_noise_table)
    return flow


def longest_vocoder_seconds(manifest: dict) -> float:
    """The longest vocoder input of the set's runs, in seconds (50 Hz mel frames), plus one."""
    frames = [call["hift_in_frames"] for run in manifest["e2e"].values() if isinstance(run, dict)
              for call in run.get("schedule", [])]
    return max(frames, default=0) / 50 + 1.0


@pytest.fixture(scope="session")
def cv3_hift(cv3_checkpoint, cv3_manifest):
    from cosystream.engine.cv3_loader import load_cv3_hift

    return load_cv3_hift(cv3_checkpoint, noise_seconds=longest_vocoder_seconds(cv3_manifest))
