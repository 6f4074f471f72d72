"""The overlapped token-to-wave worker gives the same audio as the inline path."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from engine_threads import synthesize_together

from cosystream.config import EngineConfig
from cosystream.engine.scheduler import EngineView, Plan, Preempt, Scheduler
from cosystream.engine.sync_engine import Engine
from cosystream.engine.trace import TRACE_ENV
from cosystream.params import SamplingParams, SynthesisParams

TEXTS = ["hello there.", "good morning to you.", "a short line.", "the quick brown fox."]


@pytest.fixture(scope="module")
def overlapped(model_dir, fixture_dir, tmp_path_factory):
    eng = Engine.from_pretrained(model_dir, voices_db=str(tmp_path_factory.mktemp("voices") / "v.db"),
                                 max_streams=8, overlap_token2wav=True)
    eng.run(eng.async_engine.add_voice("fixture", str(fixture_dir / "prompt_24k.wav"),
                                       "Hello there. This is a short synthetic prompt."))
    yield eng
    eng.close()


def test_overlapped_concurrent_requests_equal_inline_ones(overlapped, engine, fixture_dir):
    engine.run(engine.async_engine.add_voice("fixture_inline", str(fixture_dir / "prompt_24k.wav"),
                                             "Hello there. This is a short synthetic prompt."))
    params = [SynthesisParams(text=t, sampling=SamplingParams(greedy=True, seed=i)) for i, t in enumerate(TEXTS)]
    inline = [engine.synthesize(replace(p, voice="fixture_inline")) for p in params]
    results = synthesize_together(overlapped, [replace(p, voice="fixture") for p in params])
    for a, b in zip(inline, results, strict=True):
        assert not isinstance(b, Exception), b
        assert a.num_chunks == b.num_chunks and a.times.num_tokens == b.times.num_tokens
        np.testing.assert_allclose(b.pcm, a.pcm, atol=5e-4, rtol=0)
    assert not overlapped.async_engine.core.batch_in_flight


def test_overlap_is_on_by_default_on_cuda_only():
    assert EngineConfig(device="cuda").overlap and EngineConfig(device="cuda:1").overlap
    assert not EngineConfig(device="cpu").overlap
    assert not EngineConfig.from_kwargs(device="cuda", overlap_token2wav=False).overlap
    assert EngineConfig.from_kwargs(device="cpu", overlap_token2wav=True).overlap


def test_engine_calls_wait_for_the_batch_on_the_worker(overlapped):
    """A call (voice caches, warm-up) uses the flow and HiFT too: it never runs beside a worker batch."""
    core = overlapped.async_engine.core
    seen: list[bool] = []
    params = SynthesisParams(text="the quick brown fox jumps over the lazy dog.", voice="fixture",
                             sampling=SamplingParams(greedy=True))
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            seen.append(core.call(lambda: not core.batch_in_flight))

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        result = overlapped.synthesize(params)
    finally:
        done.set()
        prober.join(timeout=60)
    assert result.num_chunks >= 2 and len(seen) > 10
    assert all(seen)


class _AlwaysPreempt(Scheduler):
    """Voices every chunk in a phase of its own and asks the busy worker to stop after each phase, as for a
    client about to run dry (so phases of official final passes pause after every Euler step, due or not):
    preemption at its most."""

    @staticmethod
    def phases(jobs):
        return [[job] for phase in Scheduler.phases(jobs) for job in phase]

    def preempt(self, view: EngineView) -> Preempt:
        worker = view.worker
        return Preempt.dry if worker is not None and worker.busy and not worker.dry_asked else Preempt.none

    def wake_after_s(self, view: EngineView) -> float | None:
        return 0.001  # the idle engine thread looks again soon, to ask before the worker's next step


@pytest.mark.slow  # ~9 s: every phase
def test_batches_handed_back_after_every_phase_give_the_same_audio(overlapped, engine, fixture_dir, monkeypatch):
    """Preemption at its most: each batch runs one phase and hands the rest back to open the next one.
    No chunk may be lost, run twice or out of order, and the audio stays the inline path's."""
    engine.run(engine.async_engine.add_voice("fixture_inline2", str(fixture_dir / "prompt_24k.wav"),
                                             "Hello there. This is a short synthetic prompt."))
    core = overlapped.async_engine.core
    monkeypatch.setattr(core, "scheduler", _AlwaysPreempt(core.scheduler.cost))
    handed_back = core.stats()["token2wav_handed_back"]
    # forced lengths of several chunks each, different per request: batches mix first, later and final chunks
    params = [SynthesisParams(text=t, sampling=SamplingParams(greedy=True, seed=10 + i), force_tokens=60 + 30 * i)
              for i, t in enumerate(TEXTS)]
    inline = [engine.synthesize(replace(p, voice="fixture_inline2")) for p in params]
    results = synthesize_together(overlapped, [replace(p, voice="fixture") for p in params])
    for a, b in zip(inline, results, strict=True):
        assert not isinstance(b, Exception), b
        assert a.num_chunks == b.num_chunks and a.times.num_tokens == b.times.num_tokens
        # float32 sums over other batch compositions: these lengths differ from the inline path by up to
        # 1.0e-3 without any preemption too; a lost, repeated or misplaced chunk differs by ~0.1-1
        np.testing.assert_allclose(b.pcm, a.pcm, atol=2e-3, rtol=0)
    assert core.stats()["token2wav_handed_back"] > handed_back  # some batch really was cut short
    assert not core.batch_in_flight and core.handed_back == 0


@pytest.mark.slow  # ~7 s: several schedules
def test_streams_opened_ahead_of_their_first_chunk_give_the_same_audio(model_dir, fixture_dir, tmp_path,
                                                                        monkeypatch):
    """Tuning.open_ahead: a stream opened while its LM still decodes voices exactly as one opened with
    its first chunk. The pool exists on CUDA only, so a two-slot CPU pool stands in (three requests: one
    waits for a slot)."""
    from cosystream.engine.flow_runner import FlowRunner

    params = [SynthesisParams(text=t, voice="v", force_tokens=60, sampling=SamplingParams(greedy=True, seed=i))
              for i, t in enumerate(TEXTS[:3])]
    runs = {}
    for ahead in (True, False):
        eng = Engine.from_pretrained(model_dir, voices_db=str(tmp_path / f"v{ahead}.db"), max_streams=4,
                                     overlap_token2wav=True, open_ahead=ahead)
        try:
            eng.run(eng.async_engine.add_voice("v", str(fixture_dir / "prompt_24k.wav"), "Hello there."))
            t2w = eng.async_engine.core.t2w
            t2w.pool = FlowRunner(t2w.flow, num_slots=2, max_frames=512, use_graphs=False)
            open_batches: list[int] = []
            real_opened = t2w.opened
            monkeypatch.setattr(t2w, "opened", lambda real=real_opened, seen=open_batches: (seen.append(1), real()))
            runs[ahead] = (synthesize_together(eng, params), len(open_batches))
            assert t2w.pool.free == [0, 1] and not eng.async_engine.core.batch_in_flight
        finally:
            eng.close()
    (with_ahead, opened_ahead), (without, opened_without) = runs[True], runs[False]
    assert opened_ahead >= 1 and opened_without == 0
    for a, b in zip(without, with_ahead, strict=True):
        assert not isinstance(a, Exception) and not isinstance(b, Exception), (a, b)
        assert a.num_chunks == b.num_chunks >= 2
        # which streams share a batch depends on timing, and a batch's size moves float sums by ~1e-4
        np.testing.assert_allclose(b.pcm, a.pcm, atol=5e-4, rtol=0)


def _three_streams_in_two_slots(model_dir, fixture_dir, voices_db, monkeypatch, scheduler: type | None):
    """Three requests of forced lengths on an overlapped engine whose flow pool (CUDA only) is a two-slot CPU pool,
    with `scheduler` in charge (None: the default). Returns (results, paused: one flag per runner call, True when
    a phase of final passes paused, jobs handed back by stopped batches)."""
    from cosystream.engine.flow_runner import FlowRunner

    params = [SynthesisParams(text=t, voice="v", force_tokens=40 + 20 * i, sampling=SamplingParams(greedy=True, seed=i))
              for i, t in enumerate(TEXTS[:3])]
    eng = Engine.from_pretrained(model_dir, voices_db=str(voices_db), max_streams=4, overlap_token2wav=True)
    try:
        eng.run(eng.async_engine.add_voice("v", str(fixture_dir / "prompt_24k.wav"), "Hello there."))
        core = eng.async_engine.core
        t2w = core.t2w
        t2w.pool = FlowRunner(t2w.flow, num_slots=2, max_frames=512, use_graphs=False)
        if scheduler is not None:
            monkeypatch.setattr(core, "scheduler", scheduler(core.scheduler.cost))
        paused: list[bool] = []
        real_run = t2w.run

        def run(items, should_stop=None):
            out = real_run(items, should_stop=should_stop)
            paused.append(out is None)
            return out

        monkeypatch.setattr(t2w, "run", run)
        handed_back = core.stats()["token2wav_handed_back"]
        results = synthesize_together(eng, params)
        assert t2w.pool.free == [0, 1] and not core.batch_in_flight and core.handed_back == 0
        return results, paused, core.stats()["token2wav_handed_back"] - handed_back
    finally:
        eng.close()


def _same_audio(want: list, got: list) -> None:
    for a, b in zip(want, got, strict=True):
        assert not isinstance(a, Exception) and not isinstance(b, Exception), (a, b)
        assert a.num_chunks == b.num_chunks >= 2
        # which streams share a batch (and a final pass) depends on timing: float sums over other batch
        # compositions differ by up to 1e-3 (as above); a lost, repeated or misplaced Euler step by ~0.1-1
        np.testing.assert_allclose(b.pcm, a.pcm, atol=2e-3, rtol=0)


@pytest.mark.slow  # ~8 s: every Euler step
def test_final_passes_paused_after_every_euler_step_give_the_same_audio(model_dir, fixture_dir, tmp_path,
                                                                         monkeypatch):
    """Phases of official final passes pause between Euler steps when the worker is asked to make way: with
    a scheduler that always asks, every such phase stops after one step and goes on in a later batch, while
    other batches (new streams in the slots those passes gave back) run between its steps. The audio equals
    the default scheduler's. The pool exists on CUDA only, so a two-slot CPU pool stands in (three requests)."""
    stepped, paused, _ = _three_streams_in_two_slots(model_dir, fixture_dir, tmp_path / "a.db", monkeypatch,
                                                     _AlwaysPreempt)
    whole, _, _ = _three_streams_in_two_slots(model_dir, fixture_dir, tmp_path / "b.db", monkeypatch, None)
    # three streams' final passes, ten Euler steps each, at least one run per step
    assert sum(paused) >= 9
    _same_audio(whole, stepped)


class _Buffered(Scheduler):
    """Every client has 10 s of audio left (on the CPU the worker is slower than real time, so clients would
    run dry), and counts the ready later chunks a batch leaves out."""

    def __init__(self, hold_s: float) -> None:
        super().__init__()
        self.hold_s = hold_s
        self.held = 0

    @staticmethod
    def later_deadline(first_audio_at_s: float, audio_sent_s: float) -> float:
        return time.perf_counter() + 10.0

    def plan(self, view: EngineView, returned=()) -> Plan:
        plan = super().plan(view, returned)
        if plan.phases:
            planned = set(plan.new_keys)
            self.held += sum(1 for s in view.streams if s.ready and not s.planned and not s.first
                             and not s.next_final and s.key not in planned)
        return plan



@pytest.mark.slow  # ~14 s: many schedules
def test_later_chunks_held_back_for_a_later_batch_give_the_same_audio(model_dir, fixture_dir, tmp_path,
                                                                       monkeypatch):
    """Later chunks with audio to spare stay out of the batches that first chunks open (Scheduler.hold_s);
    they go in a later batch. Which batch voices a chunk must not change its audio. Two LM rows for four
    requests let new first chunks open batches while others have later chunks ready."""
    params = [SynthesisParams(text=t, voice="v", force_tokens=120 + 30 * i,
                              sampling=SamplingParams(greedy=True, seed=i)) for i, t in enumerate(TEXTS)]
    runs = {}
    for hold in (1.0, 0.0):
        eng = Engine.from_pretrained(model_dir, voices_db=str(tmp_path / f"v{hold}.db"),
                                     overlap_token2wav=True, max_streams=2)
        try:
            eng.run(eng.async_engine.add_voice("v", str(fixture_dir / "prompt_24k.wav"), "Hello there."))
            core = eng.async_engine.core
            scheduler = _Buffered(hold)
            monkeypatch.setattr(core, "scheduler", scheduler)
            runs[hold] = (synthesize_together(eng, params), scheduler.held)
            assert not core.batch_in_flight and core.handed_back == 0
        finally:
            eng.close()
    (with_hold, num_held), (without, none_held) = runs[1.0], runs[0.0]
    assert none_held == 0 and num_held >= 1
    for a, b in zip(without, with_hold, strict=True):
        assert not isinstance(a, Exception) and not isinstance(b, Exception), (a, b)
        assert a.num_chunks == b.num_chunks >= 3
        # which streams share a batch moves float sums by up to 1e-3 (as above); a chunk voiced from the
        # wrong tokens or twice would differ by ~0.1-1
        np.testing.assert_allclose(b.pcm, a.pcm, atol=2e-3, rtol=0)


class _AlwaysStop(_AlwaysPreempt):
    """Asks the busy worker to stop after every phase as for a first chunk waiting for a flow slot: phases of
    official final passes not due pause between Euler steps, the rest of the batch is handed back."""

    def preempt(self, view: EngineView) -> Preempt:
        worker = view.worker
        return Preempt.slot if worker is not None and worker.busy and not worker.preempt_asked else Preempt.none


@pytest.mark.slow  # ~8 s: every phase
def test_a_batch_stopped_for_a_slot_hands_back_its_rest_and_pauses_its_final_passes(model_dir, fixture_dir,
                                                                                   tmp_path, monkeypatch):
    """Preempt.slot: the worker stops after its running phase and hands the rest back, and a phase of final
    passes not due pauses between Euler steps (the slots its streams gave back are free once the batch stops).
    The audio equals the default scheduler's (two-slot CPU pool, three requests: one waits for a slot)."""
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(trace))  # the stop requests go to the decision trace
    stopped, paused, handed_back = _three_streams_in_two_slots(model_dir, fixture_dir, tmp_path / "a.db",
                                                               monkeypatch, _AlwaysStop)
    monkeypatch.delenv(TRACE_ENV)
    whole, _, _ = _three_streams_in_two_slots(model_dir, fixture_dir, tmp_path / "b.db", monkeypatch, None)
    assert any(paused) and handed_back > 0  # some batch really was cut short, and some final pass paused
    asked = [r for r in map(json.loads, trace.read_text().splitlines()) if "preempt" in r]
    assert asked and {r["preempt"] for r in asked} == {"slot"}
    _same_audio(whole, stopped)
