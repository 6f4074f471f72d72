"""`cosystream serve --replicas N`: bad values are one-line usage errors, before any Ray start."""

from __future__ import annotations

import sys

import pytest

from cosystream.cli import main


@pytest.mark.parametrize(("extra", "message"), [
    (["--replicas", "0"], "--replicas: must be at least 1"),
    (["--replicas", "2", "--config", "no_such_field=1"], "no_such_field"),
])
def test_bad_replica_flags_are_usage_errors(tmp_path, extra, message, capsys) -> None:
    assert main(["serve", "--model-dir", str(tmp_path), *extra]) == 2
    assert message in capsys.readouterr().err
    assert "ray" not in sys.modules or sys.modules["ray"].is_initialized() is False  # no cluster was started


def test_missing_model_dir_is_named(tmp_path, capsys) -> None:
    assert main(["serve", "--model-dir", str(tmp_path / "absent"), "--replicas", "2"]) == 2
    assert "--model-dir: no such directory" in capsys.readouterr().err
