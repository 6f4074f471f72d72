"""EngineConfig from command-line FIELD=VALUE items (`cosystream serve --config`, benchmarks)."""

from __future__ import annotations

import pytest

from cosystream.cli import main
from cosystream.config import EngineConfig, config_overrides


def test_values_take_their_fields_types():
    got = config_overrides(["open_ahead=false", "overlap_token2wav=ON", "first_audio_budget_s=0.5", "flow_slots=28",
                            "final_attention=chunk", "gil_switch_interval_s=none", "max_text_chars=-1"])
    assert got == {"open_ahead": False, "overlap_token2wav": True, "first_audio_budget_s": 0.5, "flow_slots": 28,
                   "final_attention": "chunk", "gil_switch_interval_s": None, "max_text_chars": -1}
    assert type(got["first_audio_budget_s"]) is float and type(got["flow_slots"]) is int
    assert config_overrides(["first_audio_budget_s=1"])["first_audio_budget_s"] == 1.0
    with pytest.raises(ValueError, match="max_text_chars: must be >= 1"):
        EngineConfig.from_kwargs(**config_overrides(["max_text_chars=-1"]))  # the record still validates the value
    with pytest.raises(ValueError, match="max_voice_cache_gb: must be >= 0"):
        EngineConfig.from_kwargs(**config_overrides(["max_voice_cache_gb=-2"]))
    assert EngineConfig.from_kwargs(**config_overrides(["max_voice_cache_gb=0.5"])).max_voice_cache_gb == 0.5
    with pytest.raises(ValueError, match="first_audio_budget_s: must be > 0"):
        EngineConfig.from_kwargs(first_audio_budget_s=0)


def test_tuning_switches_are_set_like_fields_and_read_through_the_config():
    config = EngineConfig.from_kwargs(device="cpu", open_ahead=False, cuda_graphs=False, gc_freeze=False)
    assert config.tuning.open_ahead is False and config.open_ahead is False and config.cuda_graphs is False
    assert config.tuning.gc_freeze is False and config.device == "cpu"
    with pytest.raises(TypeError, match="unknown EngineConfig field"):
        EngineConfig.from_kwargs(chunk_slack_s=0.6)  # a retired policy knob


def test_engine_config_keeps_at_most_fifteen_fields_each_with_a_docstring():
    import ast
    import inspect
    from dataclasses import fields

    import cosystream.config as config_module

    assert len(fields(EngineConfig)) <= 15
    tree = ast.parse(inspect.getsource(config_module))
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "EngineConfig")
    documented = {prev.target.id for prev, node in zip(cls.body, cls.body[1:], strict=False)
                  if isinstance(prev, ast.AnnAssign) and isinstance(node, ast.Expr)
                  and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}
    assert {f.name for f in fields(EngineConfig)} <= documented


@pytest.mark.parametrize(("item", "message"), [
    ("open_ahead=maybe", "open_ahead=maybe: expected true or false"),
    ("flow_slots=1.5", "flow_slots=1.5: expected an integer"),
    ("first_audio_budget_s=fast", "first_audio_budget_s=fast: expected a number"),
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
