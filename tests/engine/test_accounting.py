"""Cancellation leaves nothing behind: after an abort in any phase the engine's accounts equal the idle baseline.

Each abort is sent from the engine thread itself, right after a check of the request's phase, so the
request is exactly where the test says when the abort lands (no race with the tiny model's speed).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
from engine_threads import synthesize_together

from cosystream.engine.accounting import EngineAccounts, take_accounts
from cosystream.engine.request import LMStatus, RequestState
from cosystream.engine.sync_engine import Engine
from cosystream.errors import SynthesisFailed
from cosystream.params import SamplingParams, SynthesisParams

PROMPT_TEXT = "Hello there. This is a short synthetic prompt."
LONG = 1500  # forced speech tokens: a request that is still running whenever the test looks


@pytest.fixture(scope="module")
def small(model_dir, fixture_dir, tmp_path_factory):
    """An engine with two LM slots, so a third request has to queue."""
    eng = Engine.from_pretrained(model_dir, voices_db=str(tmp_path_factory.mktemp("voices") / "v.db"),
                                 max_streams=2)
    eng.run(eng.async_engine.add_voice("v", str(fixture_dir / "prompt_24k.wav"), PROMPT_TEXT))
    # warm every lazily created pool thread, so the baseline is the steady state
    _run_together(eng, [_params(seed=i, force_tokens=30) for i in range(3)])
    eng.run(_touch_default_executor())
    _fill_pool(eng.async_engine.pool)
    yield eng
    eng.close()


def _fill_pool(pool) -> None:
    """Start every thread of a ThreadPoolExecutor (it starts them lazily, one per task that finds no
    idle thread: a warm-up that happened to run its tasks one after another leaves it short, and the
    thread it starts later looked like a leak)."""
    barrier = threading.Barrier(pool._max_workers)
    for f in [pool.submit(barrier.wait) for _ in range(pool._max_workers)]:
        f.result(timeout=30)


async def _touch_default_executor() -> None:
    await asyncio.get_running_loop().run_in_executor(None, lambda: None)


def _params(seed: int = 0, force_tokens: int = LONG, **kw) -> SynthesisParams:
    return SynthesisParams(text="a line to say.", voice="v", force_tokens=force_tokens,
                           sampling=SamplingParams(greedy=True, seed=seed), **kw)


def _run_together(eng: Engine, params: list[SynthesisParams]) -> list:
    return synthesize_together(eng, params)


def _accounts(eng: Engine) -> EngineAccounts:
    return take_accounts(eng.async_engine, eng._loop)


def _settled(eng: Engine, baseline: EngineAccounts, timeout_s: float = 30.0) -> dict:
    """Wait until nothing is held beyond the baseline (aborted generators and tasks end a moment later)."""
    deadline = time.monotonic() + timeout_s
    while (growth := _accounts(eng).growth(baseline)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return growth


def _abort_when(eng: Engine, request_id: str, phase: Callable[[RequestState], bool], timeout_s: float = 60) -> None:
    """Abort `request_id` from the engine thread the first time `phase(request)` holds."""
    core = eng.async_engine.core

    def check() -> bool:
        req = core.requests.get(request_id)
        assert req is not None, f"{request_id} ended before reaching the phase"
        if phase(req):
            core.abort(request_id)  # queued behind this call: handled before the next engine step
            return True
        return False

    deadline = time.monotonic() + timeout_s
    while not core.call(check):
        assert time.monotonic() < deadline, "the request never reached the phase"
        time.sleep(0.002)


def _in_background(eng: Engine, params: SynthesisParams) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def consume() -> None:
        try:
            out["chunks"] = list(eng.stream(params))
        except Exception as exc:
            out["error"] = exc

    thread = threading.Thread(target=consume)
    thread.start()
    return thread, out


def _was_aborted(out: dict) -> bool:
    """A reader whose request was aborted by someone else is told so (it would otherwise wait forever)."""
    error = out.get("error")
    return isinstance(error, SynthesisFailed) and error.code == "aborted"


def _wait_submitted(eng: Engine, request_id: str) -> None:
    core = eng.async_engine.core
    deadline = time.monotonic() + 60
    while not core.call(lambda: request_id in core.requests):
        assert time.monotonic() < deadline
        time.sleep(0.002)


def _decoding_before_audio(req: RequestState) -> bool:
    seg = req.lm_segment
    return seg is not None and seg.lm_status == LMStatus.decoding and req.chunks_emitted == 0 and len(seg.tokens) > 20


def _voicing(req: RequestState) -> bool:
    """Holding a token-to-wave stream, with audio sent already (the LM keeps decoding meanwhile)."""
    seg = req.audio_segment
    return seg is not None and seg.t2w is not None and req.chunks_emitted >= 1


@pytest.mark.parametrize(("phase", "stream"), [(_decoding_before_audio, False), (_voicing, True)],
                         ids=["mid_lm", "mid_voicing"])
def test_abort_in_any_phase_returns_to_the_idle_baseline(small, phase, stream):
    baseline = _accounts(small)
    assert baseline.is_idle
    params = _params(request_id=f"abort-{phase.__name__}", stream=stream, force_tokens=300)
    thread, out = _in_background(small, params)
    _wait_submitted(small, params.request_id)
    _abort_when(small, params.request_id, phase)
    thread.join(timeout=60)
    assert _settled(small, baseline) == {}
    assert not thread.is_alive() and _was_aborted(out)


def test_abort_while_queued_frees_nothing_it_never_held_and_others_finish(small):
    baseline = _accounts(small)
    holders = [_in_background(small, _params(seed=i, request_id=f"holder-{i}")) for i in range(2)]
    for i in range(2):
        _wait_submitted(small, f"holder-{i}")
    queued = _params(request_id="queued", force_tokens=40)
    thread, out = _in_background(small, queued)
    _wait_submitted(small, "queued")
    core = small.async_engine.core
    _abort_when(small, "queued", lambda req: req in core.waiting and all(s.slot < 0 for s in req.segments))
    thread.join(timeout=60)
    assert _was_aborted(out) and not thread.is_alive()
    for i in range(2):
        _abort_when(small, f"holder-{i}", lambda req: True)
    for t, _ in holders:
        t.join(timeout=60)
    assert _settled(small, baseline) == {}
    after = small.synthesize(_params(seed=3, force_tokens=40))  # both slots serve again
    assert after.pcm.shape[0] == 960 * 40


def test_closing_the_iterator_mid_stream_returns_to_the_baseline(small):
    baseline = _accounts(small)
    streams = [small.stream(_params(seed=i)) for i in range(2)]
    for s in streams:
        assert next(s).pcm.shape[0] > 0
    for s in streams:
        s.close()  # the client goes away
    assert _settled(small, baseline) == {}


def test_a_request_whose_event_loop_closed_is_dropped_and_the_engine_lives(small):
    baseline = _accounts(small)
    loop = asyncio.new_event_loop()
    agen = small.async_engine.synthesize(_params(seed=4))
    first = loop.run_until_complete(agen.__anext__())
    loop.close()  # no aclose, no abort: the engine's next chunk finds nobody to take it
    assert first.pcm.shape[0] > 0
    assert _settled(small, baseline) == {}
    assert small.async_engine.stats()["alive"] == 1.0
    assert small.synthesize(_params(seed=5, force_tokens=30)).pcm.shape[0] == 960 * 30
