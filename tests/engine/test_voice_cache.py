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


def test_a_prompt_recording_sent_again_is_reused(model_dir, fixture_dir, tmp_path, monkeypatch):
    """Zero-shot without a registered voice: a client sending the same recording and transcript with every
    request has them analysed and encoded once (keyed by content, whatever form the audio comes in), with
    the audio of a fresh analysis; another transcript or recording is analysed anew; none is stored as a
    voice."""
    engine = Engine.from_pretrained(model_dir, voices_db=str(tmp_path / "v.db"))
    try:
        ae = engine.async_engine
        analysed, built = [], []
        real_analyse, real_build = ae.frontend.make_voice_prompt, ae.token2wav._build_prompt_cache
        monkeypatch.setattr(ae.frontend, "make_voice_prompt",
                            lambda *a, **k: analysed.append(a[1]) or real_analyse(*a, **k))
        monkeypatch.setattr(ae.token2wav, "_build_prompt_cache", lambda inputs: built.append(1) or real_build(inputs))
        path = fixture_dir / "prompt_24k.wav"
        recording = path.read_bytes()

        def say(audio, prompt_text="Hello there."):
            return engine.synthesize(SynthesisParams(text="hello again.", prompt_audio=audio, prompt_text=prompt_text,
                                                     force_tokens=30, sampling=SamplingParams(greedy=True, seed=5)))

        first, again, by_path = say(recording), say(bytes(recording)), say(str(path))
        assert analysed == ["Hello there."] and len(built) == 1
        np.testing.assert_array_equal(again.pcm, first.pcm)
        np.testing.assert_array_equal(by_path.pcm, first.pcm)
        say(recording, "Hello there!")
        say(recording[:44] + recording[44:][::-1])  # the same length, other samples
        assert analysed == ["Hello there.", "Hello there!", "Hello there."] and len(built) == 3
        ae.pool.shutdown(wait=True)  # persisting (on by default on the CPU) runs on a frontend thread
        assert ae.voices.list() == [] and not ae._voice_caches
    finally:
        engine.close()


def test_device_voice_caches_are_bounded_by_bytes_and_count(checkpoint, load_fixture):
    from types import SimpleNamespace

    from cosystream.config import EngineConfig
    from cosystream.engine.loader import load_flow, load_hift
    from cosystream.engine.token2wav import Token2WavRunner

    f = load_fixture("stream")
    inputs = SimpleNamespace(flow_prompt_speech_tokens=f["prompt_token"][0], prompt_mel=f["prompt_feat"][0],
                             xvector=f["embedding"][0])
    t2w = Token2WavRunner(load_flow(checkpoint), load_hift(checkpoint), EngineConfig(), max_voice_caches=3)
    one = t2w.prompt_cache(inputs, "a")
    size = one.kv.numel() * one.kv.element_size()
    assert size > 0
    for key in "bcd":
        t2w.prompt_cache(inputs, key)
    assert list(t2w.voice_caches) == ["b", "c", "d"]  # by count: the least recently used went first
    t2w.max_voice_cache_bytes = 2 * size
    t2w.prompt_cache(inputs, "b")  # used again: now the most recent
    t2w.prompt_cache(inputs, "e")
    assert list(t2w.voice_caches) == ["b", "e"]
    t2w.max_voice_cache_bytes = 0
    t2w.prompt_cache(inputs, "f")
    assert list(t2w.voice_caches) == ["f"]  # alone over the bytes, the voice being opened stays


def test_recordings_sent_with_requests_leave_the_device_before_registered_voices(checkpoint, load_fixture):
    """Over the bounds, the least recently used recording sent with a request goes first; registered voices go
    only when no such recording is left (the one being opened always stays)."""
    from types import SimpleNamespace

    from cosystream.config import EngineConfig
    from cosystream.engine.loader import load_flow, load_hift
    from cosystream.engine.token2wav import Token2WavRunner
    from cosystream.engine.upload_cache import UPLOAD_KEY_PREFIX

    f = load_fixture("stream")
    inputs = SimpleNamespace(flow_prompt_speech_tokens=f["prompt_token"][0], prompt_mel=f["prompt_feat"][0],
                             xvector=f["embedding"][0])
    t2w = Token2WavRunner(load_flow(checkpoint), load_hift(checkpoint), EngineConfig(), max_voice_caches=3)
    up = [UPLOAD_KEY_PREFIX + str(i) for i in range(4)]
    for key in ["voice_a", up[0], "voice_b", up[1]]:
        t2w.prompt_cache(inputs, key)
    assert list(t2w.voice_caches) == ["voice_a", "voice_b", up[1]]  # up[0] went, though voice_a is older
    t2w.prompt_cache(inputs, up[2])
    assert list(t2w.voice_caches) == ["voice_a", "voice_b", up[2]]
    t2w.prompt_cache(inputs, "voice_c")  # the recording goes, not the older voices
    assert list(t2w.voice_caches) == ["voice_a", "voice_b", "voice_c"]
    t2w.prompt_cache(inputs, up[3])  # the newest stays though it is a recording: the oldest voice goes
    assert list(t2w.voice_caches) == ["voice_b", "voice_c", up[3]]
