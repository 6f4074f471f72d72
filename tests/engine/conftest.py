"""Engine fixtures: one CPU engine on the golden fixture model, shared by the engine tests."""

from __future__ import annotations

import pytest

from cosystream.engine.sync_engine import Engine


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    eng = Engine.from_pretrained(model_dir, voices_db=str(tmp_path_factory.mktemp("voices") / "v.db"),
                                 max_streams=16)
    yield eng
    eng.close()
