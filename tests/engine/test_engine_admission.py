"""Admission from the engine's own scheduler, on the fixture model (CPU): a burst's excess is refused at
once, the admitted streams keep their first-audio deadline; and the one text-length limit."""

from __future__ import annotations

import threading
import time

import pytest

from cosystream.engine import scheduler as sched
from cosystream.engine.scheduler import Scheduler
from cosystream.engine.sync_engine import Engine
from cosystream.errors import BadInput, Overloaded
from cosystream.params import SamplingParams, SynthesisParams

LONG = 600  # speech tokens per request: an LM row is held far longer than the budget, even when a loaded CPU
# decodes two rows at half the speed the cost model measured for one


def _params(i: int) -> SynthesisParams:
    return SynthesisParams(text="hello there, a short line.", voice="v", force_tokens=LONG,
                           sampling=SamplingParams(greedy=True, seed=i))


def _first_audio(eng: Engine, params: SynthesisParams, out: dict, key: int) -> None:
    """Record when the request's first chunk came (or its refusal), from the call; then drain it."""
    t0 = time.perf_counter()
    try:
        chunks = eng.stream(params)
        next(chunks)
        out[key] = ("audio", time.perf_counter() - t0)
        for _ in chunks:
            pass
    except Overloaded as exc:
        out[key] = ("refused", time.perf_counter() - t0, exc)


@pytest.fixture(scope="module")
def small(model_dir, fixture_dir, tmp_path_factory):
    eng = Engine.from_pretrained(model_dir, voices_db=str(tmp_path_factory.mktemp("voices") / "v.db"),
                                 max_streams=2, first_audio_budget_s=60.0, max_text_chars=200)
    eng.run(eng.async_engine.add_voice("v", str(fixture_dir / "prompt_24k.wav"), "Hello there."))
    yield eng
    eng.close()


@pytest.mark.slow  # ~10 s: one request alone, then a burst
def test_a_burst_beyond_the_lm_rows_is_refused_at_once_and_the_admitted_keep_their_first_audio(small):
    core = small.async_engine.core
    alone = small.synthesize(_params(0))  # teaches the cost model this machine's decode step, chunk, LM hold
    predicted = small.synthesize(_params(1)).times  # (the first one had no view to predict from)
    assert predicted.predicted_first_chunk_start_s is not None and predicted.predicted_first_audio_s is not None
    assert 0 <= predicted.predicted_first_chunk_start_s <= predicted.predicted_first_audio_s
    budget = 2 * alone.times.first_audio_s
    engine_scheduler, core.scheduler = core.scheduler, Scheduler(core.scheduler.cost, budget_s=budget)
    try:
        _burst(small, core, budget)
    finally:  # the module's engine goes on with its own budget (the burst's long streams may still run)
        core.scheduler = engine_scheduler


def _burst(small, core, budget: float) -> None:
    stats = core.stats()
    out: dict = {}
    threads = [threading.Thread(target=_first_audio, args=(small, _params(i), out, i)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    admitted = [v for v in out.values() if v[0] == "audio"]
    refused = [v for v in out.values() if v[0] == "refused"]
    assert len(out) == 8 and admitted and refused
    # two LM rows, each held for a whole long utterance: a third stream would wait for one far past the budget
    assert len(admitted) <= 3
    # every refusal came before any admitted stream's first audio, with its reason and a retry hint
    assert max(v[1] for v in refused) < min(v[1] for v in admitted)
    assert all("overloaded" in str(v[2]) and v[2].retry_after_s >= 1 for v in refused)
    # the admitted streams' first audio came within the budget, and the engine counted no first-chunk miss
    assert all(v[1] <= budget for v in admitted), (budget, admitted)
    after = core.stats()
    assert after["admission_refused"] - stats["admission_refused"] == len(refused)
    by_rule = {k: after[k] - stats[k] for k in after if k.startswith("admission_refused_")}
    assert set(by_rule) == {"admission_refused_debt", "admission_refused_budget", "admission_refused_deadlines"}
    assert sum(by_rule.values()) == len(refused)  # each refusal counted under the one rule that refused it
    assert after["admission_admitted"] - stats["admission_admitted"] == len(admitted)
    first_misses = sum(v for k, v in after.items() if k.startswith("deadline_misses_first_"))
    assert first_misses == sum(v for k, v in stats.items() if k.startswith("deadline_misses_first_"))
    assert after["first_audio_predictions"] - stats["first_audio_predictions"] == len(admitted)


def test_one_text_limit_for_every_entry_point_of_the_engine(small):
    with pytest.raises(BadInput, match="text: 201 characters, more than the limit of 200"):
        small.synthesize(SynthesisParams(text="a" * 201, voice="v"))
    with pytest.raises(BadInput, match="instruct_text: 201 characters"):
        small.synthesize(SynthesisParams(text="hi.", voice="v", mode="instruct2", instruct_text="b" * 201))

    async def pieces():
        for _ in range(5):
            yield "a" * 50

    with pytest.raises(BadInput, match="more than the limit of 200"):
        small.synthesize(SynthesisParams(text=pieces(), voice="v"))


def test_a_new_recording_is_predicted_to_wait_for_its_analysis(small, fixture_dir):
    """A request that brings a recording the engine has not analysed: admission adds the analysis it waits for
    (measured on this machine by the analyses before it); a recording the engine keeps adds nothing."""
    engine = small.async_engine

    def zero_shot(audio: bytes) -> SynthesisParams:
        return SynthesisParams(text="hello there.", mode="zero_shot", prompt_audio=audio, prompt_text="Hello there.",
                               force_tokens=8, sampling=SamplingParams(greedy=True, seed=1))

    recording = (fixture_dir / "prompt_24k.wav").read_bytes()
    other = recording[:-480]  # 10 ms shorter: another recording
    assert engine.is_new_recording(zero_shot(recording))
    small.synthesize(zero_shot(recording))  # analysed (and measured), then kept
    assert not engine.is_new_recording(zero_shot(recording))
    assert engine.is_new_recording(zero_shot(other))
    assert not engine.is_new_recording(_params(0))  # a registered voice
    analysis_s = engine.core.scheduler.prompt_costs.analysis_s(1)
    assert analysis_s > 0.0
    # the engine idle: the same view, with and without a new recording to analyse first
    tokens = 28
    kept = engine.core.admit(tokens, prompts=engine.prompt_batcher.backlog(new_recording=False))
    new = engine.core.admit(tokens, prompts=engine.prompt_batcher.backlog(new_recording=True))
    assert new.predicted_first_audio_s - kept.predicted_first_audio_s == pytest.approx(analysis_s, rel=0.05)


def test_the_worker_debt_and_its_limit_are_engine_stats(small):
    """What admission's debt rule reads is on /metrics (cosystream_engine_worker_debt_*): the scheduler's limit
    (its rule: test_scheduler.py), and the debt of the view admission reads."""
    small.synthesize(_params(0))
    core = small.async_engine.core
    stats = core.stats()
    # (the burst test before may have given the core a scheduler of another budget)
    assert stats["worker_debt_limit_seconds"] == pytest.approx(core.scheduler.worker_debt_limit_s)
    assert stats["worker_debt_limit_seconds"] <= sched.WORKER_DEBT_BUDGETS * core.scheduler.budget_s
    # the scheduler's reading of the view admission reads (the same view: only the running batch's rest moves)
    expected = core.scheduler.worker_debt_s(core.published, time.perf_counter())
    assert stats["worker_debt_seconds"] == pytest.approx(expected, abs=0.05)
