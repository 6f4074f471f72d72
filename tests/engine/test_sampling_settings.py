"""The RAS settings a stream samples with: the checkpoint yaml's `sampling` (win_size, tau_r), or the request's.

The model here is the fixture model with other win_size and tau_r in its yaml, so a value taken from
anywhere else (a constant, a default) shows.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from cosystream.engine.sync_engine import Engine
from cosystream.params import SamplingParams, SynthesisParams

YAML_WIN, YAML_TAU = 13, 0.3  # neither the official 10 / 0.1 nor the loaders' fallbacks


def _set_sampling(yaml: str, win_size: int, tau_r: float) -> str:
    """The yaml with the LM's `sampling` block's win_size and tau_r replaced (exactly one of each)."""
    block = re.search(r"sampling: !name:cosyvoice\.utils\.common\.ras_sampling\n(?:[ \t]+\w+: .*\n)+", yaml)
    assert block, "no ras_sampling block in the yaml"
    new, num_win = re.subn(r"(win_size: )\S+", rf"\g<1>{win_size}", block.group(0))
    new, num_tau = re.subn(r"(tau_r: )\S+", rf"\g<1>{tau_r}", new)
    assert num_win == num_tau == 1
    return yaml.replace(block.group(0), new)


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory):
    copy = tmp_path_factory.mktemp("ras_model")
    for item in model_dir.iterdir():
        if item.name != "cosyvoice2.yaml":
            (copy / item.name).symlink_to(item)
    (copy / "cosyvoice2.yaml").write_text(_set_sampling((model_dir / "cosyvoice2.yaml").read_text(),
                                                        YAML_WIN, YAML_TAU))
    eng = Engine.from_pretrained(copy, voices_db=str(copy / "voices.db"), max_streams=2)
    yield eng
    eng.close()


@pytest.fixture
def row_settings(engine, monkeypatch):
    """(window, repeat threshold) of every row the engine sets up, as the sampler reads them."""
    runner = engine.async_engine.core.lm_runner
    seen: list[tuple[int, float]] = []
    set_row = runner.set_row_sampling

    def spy(slot, rs):
        set_row(slot, rs)
        seen.append((int(runner.sampling.window[slot]), float(runner.sampling.repeat_threshold[slot])))

    monkeypatch.setattr(runner, "set_row_sampling", spy)
    return seen


def _run(engine, fixture_dir: Path, sampling: SamplingParams) -> None:
    params = SynthesisParams(text="Hello there.", prompt_audio=str(fixture_dir / "prompt_24k.wav"),
                             prompt_text="Hello there.", sampling=sampling, force_tokens=3)
    assert list(engine.stream(params))


def test_the_yaml_sampling_settings_reach_the_sampler(engine, fixture_dir, row_settings):
    _run(engine, fixture_dir, SamplingParams(seed=0))
    assert row_settings, "no LM row was set up"
    threshold = float(torch.tensor(YAML_WIN * YAML_TAU, dtype=torch.float32))
    assert set(row_settings) == {(YAML_WIN, threshold)}


def test_a_request_overrides_them(engine, fixture_dir, row_settings):
    _run(engine, fixture_dir, SamplingParams(seed=0, win_size=YAML_WIN - 5, tau_r=0.5))
    threshold = float(torch.tensor((YAML_WIN - 5) * 0.5, dtype=torch.float32))
    assert set(row_settings) == {(YAML_WIN - 5, threshold)}
