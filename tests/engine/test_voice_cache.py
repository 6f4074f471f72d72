"""A registered voice's encoded flow prompt is stored with the voice and reused after a restart."""

from __future__ import annotations

import numpy as np
import torch

from cosystream.engine.sync_engine import Engine
from cosystream.models.flow_stream import FlowStream
from cosystream.params import SamplingParams, SynthesisParams


def test_encoded_prompt_survives_a_restart(model_dir, fixture_dir, tmp_path, monkeypatch):
    db = str(tmp_path / "voices.db")
    params = SynthesisParams(text="hello again.", voice="v", force_tokens=40,
                             sampling=SamplingParams(greedy=True, seed=5))
    first = Engine.from_pretrained(model_dir, voices_db=db)
    first.run(first.async_engine.add_voice("v", str(fixture_dir / "prompt_24k.wav"), "Hello there."))
    before = first.synthesize(params)
    first.async_engine.pool.shutdown(wait=True)  # the record is written by a frontend thread
    extras = first.async_engine.voices.get("v").extras
    first.close()
    assert any(k.startswith("flow_prompt_cache.") for k in extras)

    def must_not_rebuild(*args, **kwargs):
        raise AssertionError("the stored prompt cache should have been used")

    monkeypatch.setattr(FlowStream, "build_prompt_cache", must_not_rebuild)
    second = Engine.from_pretrained(model_dir, voices_db=db)
    after = second.synthesize(params)
    second.close()
    np.testing.assert_allclose(after.pcm, before.pcm, atol=1e-5, rtol=0)


def test_a_cache_from_another_model_is_ignored(model_dir, fixture_dir, tmp_path):
    db = str(tmp_path / "voices.db")
    engine = Engine.from_pretrained(model_dir, voices_db=db)
    engine.run(engine.async_engine.add_voice("v", str(fixture_dir / "prompt_24k.wav"), "Hello there."))
    t2w = engine.async_engine.token2wav
    stored = {"model": torch.tensor(list(b"another model"), dtype=torch.uint8)}
    assert t2w._from_store(stored) is None
    engine.close()


def test_persisting_can_be_switched_off(model_dir, fixture_dir, tmp_path):
    engine = Engine.from_pretrained(model_dir, voices_db=str(tmp_path / "v.db"), persist_voice_caches=False)
    engine.run(engine.async_engine.add_voice("v", str(fixture_dir / "prompt_24k.wav"), "Hello there."))
    engine.synthesize(SynthesisParams(text="hi there.", voice="v", force_tokens=20))
    engine.async_engine.pool.shutdown(wait=True)
    assert not engine.async_engine.voices.get("v").extras
    engine.close()
