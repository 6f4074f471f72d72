"""The engine moves the objects alive after its start out of the cyclic collector's reach and back on close."""

from __future__ import annotations

import gc

from cosystream.engine.sync_engine import Engine


def test_the_engine_freezes_the_heap_and_unfreezes_it_on_close(model_dir, tmp_path) -> None:
    engine = Engine.from_pretrained(model_dir, voices_db=str(tmp_path / "v.db"), max_streams=2)
    try:
        frozen = gc.get_freeze_count()
        # the engine's own objects are among the frozen ones: a full collection no longer walks them
        assert frozen > 1000 and not any(obj is engine.async_engine for obj in gc.get_objects())
    finally:
        engine.close()
    assert gc.get_freeze_count() == 0
    assert any(obj is engine.async_engine for obj in gc.get_objects())  # collectable again


def test_gc_freeze_can_be_switched_off(model_dir, tmp_path) -> None:
    before = gc.get_freeze_count()
    engine = Engine.from_pretrained(model_dir, voices_db=str(tmp_path / "v.db"), max_streams=2, gc_freeze=False)
    try:
        assert gc.get_freeze_count() == before
    finally:
        engine.close()
