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


def test_a_voice_registered_again_under_its_name_never_gets_the_old_state(model_dir, fixture_dir, tmp_path):
    import soundfile as sf

    t = np.arange(int(2.5 * 24000)) / 24000
    other = tmp_path / "other.wav"
    sf.write(str(other), (0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32),
             24000)
    params = SynthesisParams(text="hello again.", voice="v", force_tokens=30,
                             sampling=SamplingParams(greedy=True, seed=5))
    engine = Engine.from_pretrained(model_dir, voices_db=str(tmp_path / "a.db"), persist_voice_caches=True)
    aeng = engine.async_engine
    engine.run(aeng.add_voice("v", str(fixture_dir / "prompt_24k.wav"), "Hello there."))
    engine.synthesize(params)
    aeng.pool.shutdown(wait=True)
    old_key = aeng._voice_keys["v"]
    old_cache = aeng._voice_caches[old_key]
    aeng.pool = type(aeng.pool)(max_workers=2)
    engine.run(aeng.delete_voice("v"))
    engine.run(aeng.add_voice("v", str(other), "Another voice."))
    aeng._write_voice_cache(old_key, old_cache)  # a late write of the deleted voice's cache
    assert not any(k.startswith("flow_prompt_cache.") for k in aeng.voices.get("v").extras)
    again = engine.synthesize(params)
    assert aeng._voice_keys["v"] != old_key and old_key not in aeng.token2wav.voice_caches
    engine.close()

    fresh = Engine.from_pretrained(model_dir, voices_db=str(tmp_path / "b.db"))
    fresh.run(fresh.async_engine.add_voice("v", str(other), "Another voice."))
    want = fresh.synthesize(params)
    fresh.close()
    np.testing.assert_allclose(again.pcm, want.pcm, atol=1e-5, rtol=0)
