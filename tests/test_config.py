"""EngineConfig from command-line FIELD=VALUE items (`cosystream serve --config`, benchmarks)."""

from __future__ import annotations

import pytest

from cosystream.cli import main
from cosystream.config import EngineConfig, config_overrides


def test_values_take_their_fields_types():
    got = config_overrides(["open_ahead=false", "overlap_token2wav=ON", "chunk_slack_s=0.25", "flow_slots=28",
                            "final_attention=chunk", "gil_switch_interval_s=none", "rider_streams=-1"])
    assert got == {"open_ahead": False, "overlap_token2wav": True, "chunk_slack_s": 0.25, "flow_slots": 28,
                   "final_attention": "chunk", "gil_switch_interval_s": None, "rider_streams": -1}
    assert type(got["chunk_slack_s"]) is float and type(got["flow_slots"]) is int
    assert config_overrides(["chunk_slack_s=1"])["chunk_slack_s"] == 1.0
    with pytest.raises(ValueError, match="rider_streams: must be >= 0"):
        EngineConfig(**config_overrides(["rider_streams=-1"]))  # the record still validates the value
    with pytest.raises(ValueError, match="max_voice_cache_gb: must be >= 0"):
        EngineConfig(**config_overrides(["max_voice_cache_gb=-2"]))
    assert EngineConfig(**config_overrides(["max_voice_cache_gb=0.5"])).max_voice_cache_gb == 0.5
    with pytest.raises(ValueError, match="final_slack_s: must be >= 0"):
        EngineConfig(**config_overrides(["final_slack_s=-0.5"]))
    assert EngineConfig(**config_overrides(["final_slack_s=0", "pause_final_passes=off"])).final_slack_s == 0
    with pytest.raises(ValueError, match="final_phase_streams: must be >= 0"):
        EngineConfig(**config_overrides(["final_phase_streams=-2"]))
    with pytest.raises(ValueError, match="later_chunk_hold_s: must be >= 0"):
        EngineConfig(**config_overrides(["later_chunk_hold_s=-1"]))
    assert EngineConfig(**config_overrides(["later_chunk_hold_s=1.5"])).later_chunk_hold_s == 1.5


@pytest.mark.parametrize(("item", "message"), [
    ("open_ahead=maybe", "open_ahead=maybe: expected true or false"),
    ("flow_slots=1.5", "flow_slots=1.5: expected an integer"),
    ("chunk_slack_s=fast", "chunk_slack_s=fast: expected a number"),
    ("flow_frames=none", "flow_frames=none: expected an integer"),  # a field that may not be None
    ("no_such_field=1", "EngineConfig has no field 'no_such_field'"),
    ("schedule=1", "schedule: not settable from the command line"),
    ("open_ahead", "expected FIELD=VALUE"),
])
def test_a_bad_item_is_named_in_the_error(item, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        config_overrides([item])


def test_serve_refuses_a_bad_config_value_with_one_line(tmp_path, capsys):
    assert main(["serve", "--model-dir", str(tmp_path), "--config", "open_ahead=maybe"]) == 2
    assert "cosystream serve: error: --config open_ahead=maybe: expected true or false" in capsys.readouterr().err
