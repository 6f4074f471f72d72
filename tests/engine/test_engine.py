"""The engine end to end on the CPU (tiny fixture model): concurrency, cancellation, text streaming."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from cosystream.errors import BadInput
from cosystream.params import Mode, SamplingParams, SynthesisParams
from cosystream.testing.concurrency import synthesize_concurrently

TEXTS = ["hello there.", "good morning to you.", "a short line.", "the quick brown fox.",
         "one more sentence here.", "speech engines batch well.", "tiny model test.", "last one."]


def _params(fixture_dir, text: str, **kw) -> SynthesisParams:
    return SynthesisParams(text=text, prompt_audio=str(fixture_dir / "prompt_24k.wav"),
                           prompt_text="Hello there. This is a short synthetic prompt.",
                           sampling=SamplingParams(greedy=True, seed=7), **kw)


@pytest.fixture(scope="module")
def voice(engine, fixture_dir):
    engine.run(engine.async_engine.add_voice("fixture", str(fixture_dir / "prompt_24k.wav"),
                                             "Hello there. This is a short synthetic prompt."))
    return "fixture"


def test_concurrent_requests_equal_requests_run_alone(engine, voice):
    params = [SynthesisParams(text=t, voice=voice, sampling=SamplingParams(greedy=True, seed=i))
              for i, t in enumerate(TEXTS)]
    alone = [engine.synthesize(p) for p in params]
    results = synthesize_concurrently(engine, params)
    for a, b in zip(alone, results, strict=True):
        assert b is not None and a.num_chunks == b.num_chunks
        assert a.times.num_tokens == b.times.num_tokens > 0
        # batched GEMMs round differently: the same audio up to float32 noise (the mel tolerance is 1e-4)
        np.testing.assert_allclose(b.pcm, a.pcm, atol=5e-4, rtol=0)
    assert len({a.times.num_tokens for a in alone}) > 1  # different texts, different lengths


def test_streamed_audio_length_and_timings(engine, voice):
    chunks = list(engine.stream(SynthesisParams(text=TEXTS[0], voice=voice, force_tokens=80)))
    assert len(chunks) >= 2 and chunks[-1].is_final and not any(c.is_final for c in chunks[:-1])
    assert sum(c.pcm.shape[0] for c in chunks) == 960 * 80
    t = chunks[-1].times
    assert t.num_tokens == 80 and abs(t.audio_s - 3.2) < 1e-6
    assert 0 < t.first_audio_s <= t.total_s and t.first_chunk_flow_s > 0 and t.llm_prefill_s > 0
    # where the first audio's time went: tokens ready (LM), then handed to the flow, then voiced
    assert t.queue_s + t.first_token_s < t.first_chunk_ready_s <= t.first_chunk_start_s < t.first_audio_s
    assert t.first_audio_s - t.first_chunk_start_s >= t.first_chunk_flow_s


def test_non_streaming_is_one_chunk_and_speed_changes_length(engine, voice):
    normal = engine.synthesize(SynthesisParams(text=TEXTS[1], voice=voice, stream=False, force_tokens=50))
    fast = engine.synthesize(SynthesisParams(text=TEXTS[1], voice=voice, stream=False, force_tokens=50,
                                             speed=2.0))
    assert normal.num_chunks == 1 and normal.pcm.shape[0] == 960 * 50
    assert fast.pcm.shape[0] == 480 * 50


def test_cancelled_request_frees_its_slot(engine, voice):
    core = engine.async_engine.core
    stream = engine.stream(SynthesisParams(text=TEXTS[2], voice=voice, force_tokens=1500))
    first = next(stream)
    assert first.pcm.shape[0] > 0
    stream.close()  # the client goes away
    steps = core.call(lambda: core.num_steps)  # runs after the abort message on the engine thread
    assert core.call(lambda: len(core.slot_owner)) == 0 and core.num_active == 0
    assert core.call(lambda: core.num_steps) == steps  # no step was taken for it afterwards


def test_text_streaming_gives_audio_before_the_text_ends(engine, voice):
    async def scenario() -> tuple[bool, int]:
        first_audio = asyncio.Event()
        sent_all = False

        async def pieces():
            nonlocal sent_all
            words = ["this", "sentence", "arrives", "word", "by", "word", "from", "an", "upstream", "model"]
            for word in words:
                yield word + " "
            await asyncio.wait_for(first_audio.wait(), timeout=300)
            yield "and this is the end."
            sent_all = True

        params = SynthesisParams(text=pieces(), voice=voice, sampling=SamplingParams(seed=3))
        audio_before_end, total = False, 0
        async for chunk in engine.async_engine.synthesize(params):
            if not first_audio.is_set():
                audio_before_end = not sent_all
                first_audio.set()
            total += chunk.pcm.shape[0]
        return audio_before_end, total

    audio_before_end, total = engine.run(scenario())
    assert audio_before_end and total > 0


def test_bad_requests_are_refused_with_a_named_field(engine, voice, fixture_dir):
    with pytest.raises(BadInput, match="text"):
        engine.synthesize(SynthesisParams(text="...!?", voice=voice))
    with pytest.raises(BadInput, match="voice"):
        engine.synthesize(SynthesisParams(text="hi", voice="nobody"))
    with pytest.raises(BadInput, match="speed"):
        engine.synthesize(SynthesisParams(text="hi", voice=voice, speed=2.0, stream=True))
    ok = engine.synthesize(SynthesisParams(text="still alive.", voice=voice, force_tokens=30))
    assert ok.pcm.shape[0] == 960 * 30


def test_modes(engine, voice, fixture_dir):
    cross = engine.synthesize(SynthesisParams(text="cross lingual.", voice=voice, mode=Mode.cross_lingual,
                                              force_tokens=30))
    instruct = engine.synthesize(SynthesisParams(text="say it slowly.", voice=voice, mode=Mode.instruct2,
                                                 instruct_text="speak slowly", force_tokens=30))
    vc = engine.synthesize(SynthesisParams(voice=voice, mode=Mode.vc,
                                           source_audio=str(fixture_dir / "prompt_16k.wav")))
    assert cross.pcm.shape[0] == instruct.pcm.shape[0] == 960 * 30
    assert vc.pcm.shape[0] > 0 and vc.times.num_tokens > 0


def test_text_streaming_honours_forced_length(engine, voice):
    async def scenario() -> int:
        async def pieces():
            for word in ["a few words ", "streamed in ", "for a benchmark."]:
                yield word

        params = SynthesisParams(text=pieces(), voice=voice, force_tokens=40)
        return sum([c.pcm.shape[0] async for c in engine.async_engine.synthesize(params)])

    assert engine.run(scenario()) == 960 * 40


def test_a_failing_chunk_fails_only_its_request(engine, voice):
    t2w = engine.async_engine.token2wav
    original = t2w.run

    def broken(jobs, should_stop=None):
        t2w.run = original  # fail once
        raise RuntimeError("simulated device fault")

    t2w.run = broken
    with pytest.raises(RuntimeError, match="simulated device fault"):
        engine.synthesize(SynthesisParams(text="this one breaks.", voice=voice, force_tokens=30))
    ok = engine.synthesize(SynthesisParams(text="this one works.", voice=voice, force_tokens=30))
    assert ok.pcm.shape[0] == 960 * 30
    assert engine.async_engine.stats()["alive"] == 1.0


def test_short_first_hops_stream_every_sample_once(engine, voice):
    for hop in (5, 15):
        chunks = list(engine.stream(SynthesisParams(text="short hop.", voice=voice, first_hop=hop, force_tokens=60)))
        assert sum(c.pcm.shape[0] for c in chunks) == 960 * 60
        assert chunks[0].pcm.shape[0] == 960 * hop - 3840  # the first chunk holds back 8 mel frames
    with pytest.raises(BadInput, match="first_hop"):
        engine.synthesize(SynthesisParams(text="short hop.", voice=voice, first_hop=0))


def test_short_requests_in_a_loaded_voice_are_prepared_on_the_event_loop(engine, voice, fixture_dir, monkeypatch):
    ae = engine.async_engine
    engine.synthesize(SynthesisParams(text=TEXTS[2], voice=voice, force_tokens=10))  # the voice is in memory now
    threads: list[str] = []
    build = ae._build_request

    def recording(params, emit):
        threads.append(threading.current_thread().name)
        return build(params, emit)

    monkeypatch.setattr(ae, "_build_request", recording)
    short = SynthesisParams(text=TEXTS[2], voice=voice, force_tokens=30, sampling=SamplingParams(seed=3))
    inline = engine.synthesize(short)
    import cosystream.engine.async_engine as async_engine_module

    with monkeypatch.context() as patch:
        patch.setattr(async_engine_module, "INLINE_FRONTEND_CHARS", 0)  # 0: always the threads
        threaded = engine.synthesize(short)
    engine.synthesize(SynthesisParams(text="x" * 401 + ".", voice=voice, force_tokens=10))  # too long to inline
    engine.synthesize(_params(fixture_dir, TEXTS[2], force_tokens=10))  # prompt audio to analyse
    with pytest.raises(BadInput, match="text"):  # bad input inline is refused as on a thread
        engine.synthesize(SynthesisParams(text="...!?", voice=voice))
    busy, release = threading.Event(), threading.Event()

    def hold_normalizer() -> None:  # a frontend thread normalising a long text
        with ae.frontend.normalizer_if_free() as free:
            assert free
            busy.set()
            release.wait(timeout=60)

    holder = threading.Thread(target=hold_normalizer)
    holder.start()
    busy.wait(timeout=60)
    waiting = threading.Thread(target=engine.synthesize, args=(short,))
    waiting.start()  # the loop must not wait for the normaliser: this request goes to a frontend thread
    for _ in range(6000):  # until the request is being prepared (at most a minute)
        if len(threads) == 6:
            break
        waiting.join(timeout=0.01)
    release.set()
    holder.join(timeout=60)
    waiting.join(timeout=120)
    assert [name.startswith("frontend") for name in threads] == [False, True, True, True, False, True]
    np.testing.assert_array_equal(inline.pcm, threaded.pcm)
