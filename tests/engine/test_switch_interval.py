"""The engine shortens Python's thread switch interval while it runs and gives the old one back on close."""

from __future__ import annotations

import sys

import pytest

from cosystream.config import EngineConfig
from cosystream.engine.sync_engine import Engine


def test_engine_sets_the_switch_interval_and_restores_it(model_dir, tmp_path) -> None:
    before = sys.getswitchinterval()
    engine = Engine.from_pretrained(model_dir, voices_db=str(tmp_path / "v.db"), max_streams=2,
                                    gil_switch_interval_s=0.002)
    try:
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        engine.close()
    assert sys.getswitchinterval() == pytest.approx(before)


def test_engine_config_refuses_a_non_positive_switch_interval() -> None:
    with pytest.raises(ValueError, match="gil_switch_interval_s: must be > 0"):
        EngineConfig.from_kwargs(gil_switch_interval_s=0)
    assert EngineConfig.from_kwargs(gil_switch_interval_s=None).gil_switch_interval_s is None
