"""Shared pytest fixtures: the golden fixture set (COSYSTREAM_FIXTURES) and its materialised model dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

if not torch.cuda.is_available():
    # Triton kernels run in its CPU interpreter in tests without a GPU; Triton reads this when it is first
    # imported, which any test may cause, so it is set before every test module is collected.
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SET = REPO.parent / "shared" / "fixtures" / "cosyvoice2-tiny"


def fixture_set_dir() -> Path:
    return Path(os.environ.get("COSYSTREAM_FIXTURES", str(DEFAULT_SET))).resolve()


def _materialize_script(set_dir: Path) -> Path:
    for candidate in (set_dir.parent / "materialize.py", REPO.parent / "shared" / "fixtures" / "materialize.py"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"materialize.py not found beside {set_dir} or in ../shared/fixtures")


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    """The fixture set directory (read-only); fails loudly when it is absent."""
    d = fixture_set_dir()
    if not (d / "weights.json").is_file():
        pytest.fail(f"fixture set not found at {d} (set COSYSTREAM_FIXTURES)")
    return d


@pytest.fixture(scope="session")
def materialized(fixture_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the fixture set with its weight files written (once per session)."""
    out = tmp_path_factory.mktemp("fixture_set")
    subprocess.run([sys.executable, str(_materialize_script(fixture_dir)), str(fixture_dir), str(out)],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def model_dir(materialized: Path) -> Path:
    return materialized / "model"


@pytest.fixture(scope="session")
def manifest(fixture_dir: Path) -> dict:
    return json.loads((fixture_dir / "manifest.json").read_text())


@pytest.fixture(scope="session")
def load_fixture(fixture_dir: Path):
    """load_fixture("flow") -> dict of tensors from flow.safetensors."""
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def load(name: str) -> dict[str, torch.Tensor]:
        if name not in cache:
            cache[name] = load_file(str(fixture_dir / f"{name}.safetensors"))
        return cache[name]

    return load


@pytest.fixture(scope="session")
def checkpoint(model_dir: Path):
    from cosystream.checkpoint import load_checkpoint

    return load_checkpoint(model_dir)


@pytest.fixture(scope="session")
def cfm_noise(fixture_dir: Path) -> torch.Tensor:
    """The stored exact prefix of the official CFM noise table (spec/flow.md §4)."""
    return load_file(str(fixture_dir / "cfm_rand_noise_prefix.safetensors"))["rand_noise_prefix"]
