"""The scheduler through its public interface: fed engine views, checked decisions (no threads, no GPU)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from cosystream.engine import costs
from cosystream.engine import scheduler as sched
from cosystream.engine.scheduler import CostModel, EngineView, JobView, Preempt, Scheduler, StreamView, WorkerView

NOW = 100.0


def _first(key: str, *, ready: bool = True, arrival: float = NOW - 0.1, missing: int = 0, **kw) -> StreamView:
    s = Scheduler()
    return StreamView(key=key, arrival_s=arrival, first=True, deadline_s=s.first_deadline(arrival), ready=ready,
                      missing_tokens=missing, decoding_audio=not ready, lm_decoding=not ready,
                      opened=kw.pop("opened", True), **kw)


def _later(key: str, left_s: float, *, final: bool = False, lm_done: bool | None = None, **kw) -> StreamView:
    done = final if lm_done is None else lm_done
    return StreamView(key=key, arrival_s=NOW - 5, first=False, deadline_s=NOW + left_s, ready=kw.pop("ready", True),
                      next_final=final, final_waits=final and done, lm_done=done, opened=True,
                      lm_decoding=not done, decoding_audio=not done, **kw)


def _view(*streams: StreamView, decoding: bool = False, worker: WorkerView | None = None, free_slots=None,
          max_batch: int = 64, **kw) -> EngineView:
    return EngineView(now=NOW, streams=list(streams), lm_decoding=decoding, free_flow_slots=free_slots,
                      max_batch=max_batch, worker=worker if worker is not None else WorkerView(), **kw)


def _keys(phases: list[list[JobView]]) -> list[list[str]]:
    return [[job.key for job in phase] for phase in phases]


def _cost(step_s: float | None = None, first_s: float | None = None, later_s: float | None = None,
          final_s: float | None = None) -> CostModel:
    cost = CostModel()
    if step_s is not None:
        cost.observe_step(step_s)
    if first_s is not None:
        cost.observe_phase("first", 1, first_s)
    if later_s is not None:
        cost.observe_phase("chunks", 1, later_s)
    if final_s is not None:
        cost.observe_phase("final", 1, final_s)
    return cost


# ------------------------------------------------------------------ deadlines and misses
def test_deadlines_first_chunk_from_arrival_later_chunk_when_the_audio_runs_out():
    s = Scheduler(budget_s=0.5)
    assert s.first_deadline(10.0) == pytest.approx(10.5)
    assert s.later_deadline(first_audio_at_s=10.2, audio_sent_s=3.0) == pytest.approx(13.2)
    assert Scheduler().first_audio_target_s == sched.DEFAULT_FIRST_AUDIO_TARGET_S  # no budget: a target anyway
    assert _later("a", 2.0).audio_left_s(NOW) == pytest.approx(2.0)
    assert _first("b").audio_left_s(NOW) == -math.inf


def test_a_miss_names_the_chunk_kind_the_stage_and_how_late():
    s = Scheduler()
    assert s.miss(first=True, final=False, deadline_s=1.0, delivered_s=0.9) is None
    miss = s.miss(first=True, final=False, deadline_s=1.0, delivered_s=1.25, tokens_ready_s=1.1)
    assert (miss.kind, miss.stage, miss.late_s) == ("first", "lm", pytest.approx(0.25))
    miss = s.miss(first=False, final=True, deadline_s=1.0, delivered_s=1.5)
    assert (miss.kind, miss.stage) == ("final", "token2wav")


# ------------------------------------------------------------------ what a batch holds, in which order
def test_first_chunks_go_ahead_of_later_ones_and_clients_about_to_run_dry_ahead_of_all():
    view = _view(_later("old", 1.0), _first("new"), _later("dry", sched.DRY_S / 2), _later("fin", 1.5, final=True))
    plan = Scheduler().plan(view)
    assert _keys(plan.phases) == [["dry"], ["new"], ["old"], ["fin"]]
    assert plan.phases[3][0].pausable and plan.phases[3][0].due  # within FINAL_SLACK_S of running dry


def test_ready_chunks_are_taken_earliest_deadline_first_within_their_class():
    view = _view(_later("late", 4.0), _later("soon", 0.9), _first("f2", arrival=NOW - 0.05),
                 _later("mid", 2.0), _first("f1", arrival=NOW - 0.2), max_batch=3)
    plan = Scheduler().plan(view)
    assert sorted(plan.new_keys) == ["f1", "f2", "soon"]  # the batch's room: first chunks, then EDF
    assert _keys(plan.phases)[0] == ["f1", "f2"]


def test_handed_back_jobs_always_go_with_the_chunk_that_preempted_them():
    back = JobView("back", first=False, final=False, audio_left_s=3.0)
    plan = Scheduler().plan(_view(_first("new"), _later("back", 3.0, planned=True, ready=False)), [back])
    assert _keys(plan.phases) == [["new"], ["back"]]
    # handed back with nothing else ready: they still go
    assert _keys(Scheduler().plan(_view(), [back]).phases) == [["back"]]
    # a handed-back final pass is judged due anew, with the chunks ready now
    fin = JobView("fin", first=False, final=True, audio_left_s=1.0, pausable=True)
    plan = Scheduler().plan(_view(_first("new"), _later("fin", 1.0, final=True, planned=True, ready=False)), [fin])
    assert _keys(plan.phases) == [["new"], ["fin"]] and plan.phases[1][0].due


def test_chunks_with_audio_to_spare_wait_for_an_urgent_chunk_while_the_lm_decodes():
    s = Scheduler()
    relaxed = [_later("a", 3.0), _later("b", 2.0), _first("c", ready=False, missing=10)]
    assert not s.plan(_view(*relaxed, decoding=True)).phases  # they wait to share a batch
    assert s.plan(_view(*relaxed, decoding=False)).phases  # no LM running: nothing new would come
    urgent = [*relaxed, _later("u", sched.URGENT_S / 2)]
    assert sorted(s.plan(_view(*urgent, decoding=True)).new_keys) == ["u"]  # the others have HOLD_S left
    alone = [_later("a", 3.0)]
    assert s.plan(_view(*alone, decoding=True)).new_keys == ["a"]  # nobody else could join it


def test_later_chunks_with_audio_to_spare_ride_only_on_a_first_chunks_ode_shape():
    view = _view(_first("f", ode_key=("pool", 50)), _later("same", 5.0, ode_key=("pool", 50)),
                 _later("other", 5.0, ode_key=("pool", 100)), _later("short", 1.0, ode_key=("pool", 100)),
                 _first("x", ready=False, missing=30), decoding=True)
    assert sorted(Scheduler().plan(view).new_keys) == ["f", "same", "short"]
    no_hold = Scheduler()
    no_hold.hold_s = 0.0
    assert sorted(no_hold.plan(view).new_keys) == ["f", "other", "same", "short"]


def test_the_ode_key_is_asked_of_the_runner_only_when_a_first_chunks_batch_is_formed():
    asked: list[str] = []

    def key_of(name: str, key: tuple):
        return lambda: (asked.append(name), key)[1]

    waiting = [_later("a", 5.0, ode_key_of=key_of("a", ("pool", 50))), _first("x", ready=False, missing=30)]
    assert not Scheduler().plan(_view(*waiting, decoding=True)).phases and asked == []  # no batch: not asked
    view = _view(_first("f", ode_key_of=key_of("f", ("pool", 50))), *waiting, decoding=True)
    assert sorted(Scheduler().plan(view).new_keys) == ["a", "f"] and sorted(asked) == ["a", "f"]


def test_riders_join_a_first_chunk_call_up_to_the_stream_limit():
    assert Scheduler.riders([("k", 1)], 1, [("k", 1), None, ("k", 2), ("k", 1)]) == [0, 3]
    assert Scheduler.riders([None], 1, [("k", 1)]) == []
    full = Scheduler.riders([("k", 1)], sched.RIDER_STREAMS - 1, [("k", 1)] * 3)
    assert full == [0]


def test_a_burst_s_first_chunks_wait_briefly_for_one_due_within_the_wait():
    cost = _cost(step_s=0.002)
    s = Scheduler(cost)
    soon = _first("soon", ready=False, missing=5)  # 10 ms away
    ready = _first("ready", first_ready_s=NOW - 0.01)
    assert not s.plan(_view(ready, soon, decoding=True)).phases
    far = _first("far", ready=False, missing=100)  # 200 ms away: not worth the wait
    assert s.plan(_view(ready, far, decoding=True)).new_keys == ["ready"]
    waited = _first("ready", first_ready_s=NOW - sched.FIRST_CHUNK_WAIT_S)
    assert s.plan(_view(waited, soon, decoding=True)).new_keys == ["ready"]  # the wait is over
    assert Scheduler().plan(_view(ready, soon, decoding=True)).new_keys == ["ready"]  # no step measured yet


# ------------------------------------------------------------------ official final passes
def test_final_passes_come_due_earliest_deadline_first_with_the_measured_cost_before_them():
    s = Scheduler(_cost(final_s=0.5))
    lefts = {"a": 2.3, "b": 2.9, "c": 5.0}
    view = _view(*(_later(k, v, final=True) for k, v in lefts.items()))
    assert s.due_finals(view) == {"a", "b"}  # b: 2.9 - 2 passes = 1.9 < FINAL_SLACK_S
    assert Scheduler().due_finals(view) == set()  # nothing measured: each by its own audio left only


def test_a_first_chunk_batch_leaves_out_final_passes_that_are_not_due():
    s = Scheduler(_cost(final_s=0.1))
    view = _view(_first("new"), _later("due", 1.0, final=True), _later("later", 8.0, final=True))
    plan = s.plan(view)
    assert sorted(plan.new_keys) == ["due", "new"]
    due_job = next(job for job in plan.phases[-1] if job.key == "due")
    assert due_job.due and due_job.pausable
    # unless new streams wait for the flow slots those passes free
    short = _view(_first("new"), _later("later", 8.0, final=True), _first("x", ready=False, opened=False),
                  free_slots=0)
    assert "later" in s.plan(short).new_keys


def test_final_passes_go_in_phases_of_bounded_size_due_ones_first():
    jobs = [JobView(f"p{i}", first=False, final=True, audio_left_s=5.0, pausable=True)
            for i in range(sched.FINAL_PHASE_STREAMS + 3)]
    jobs.append(JobView("due", first=False, final=True, audio_left_s=1.0, due=True, pausable=True))
    phases = Scheduler.phases(jobs)
    assert [len(p) for p in phases] == [1, sched.FINAL_PHASE_STREAMS, 3]
    assert phases[0][0].key == "due"


# ------------------------------------------------------------------ flow slots and open-ahead
def test_no_more_new_streams_than_free_flow_slots_oldest_first():
    view = _view(*(_first(f"n{i}", arrival=NOW - 1 + i * 0.1, opened=False, needs_slot=True) for i in range(3)),
                 free_slots=2)
    assert Scheduler().plan(view).new_keys == ["n0", "n1"]
    assert Scheduler().plan(_view(*view.streams, free_slots=3)).new_keys == ["n0", "n1", "n2"]


def test_the_idle_worker_opens_streams_ahead_voices_at_hand_together_then_new_voices_together():
    streams = [_first(k, ready=False, missing=20, opened=False, needs_slot=True, opens_ahead=True,
                      voice_at_hand=k != "build", arrival=NOW - i) for i, k in enumerate(["a", "build", "b"])]
    plan = Scheduler().plan(_view(*streams, free_slots=4, decoding=True))
    assert not plan.phases and plan.opens == [["b", "a"], ["build"]]
    assert Scheduler().plan(_view(*streams, free_slots=1, decoding=True)).opens == [["b"]]
    assert not Scheduler().plan(_view(*streams, free_slots=0, decoding=True)).opens
    assert not Scheduler().plan(_view(*streams, free_slots=4, open_ahead=False)).opens
    inline = EngineView(now=NOW, streams=streams, free_flow_slots=4, worker=None)
    assert not Scheduler().plan(inline).opens  # without a worker, streams open with their first chunk


def _new_voice(key: str, arrival: float, **kw) -> StreamView:
    """A stream whose first chunk's tokens are being decoded, in a voice whose prompt state must be built."""
    args = dict(ready=False, missing=20, opened=False, needs_slot=True, opens_ahead=True, voice_at_hand=False)
    return _first(key, arrival=arrival, **{**args, **kw})


def test_new_voices_prompt_passes_share_one_phase_earliest_deadline_first():
    builds = [_new_voice(f"n{i}", arrival=NOW - 0.01 * i) for i in range(sched.PROMPT_PHASE_STREAMS + 2)]
    plan = Scheduler().plan(_view(*builds, free_slots=64, decoding=True))
    order = [s.key for s in sorted(builds, key=lambda s: s.deadline_s)]
    assert plan.opens == [order[:sched.PROMPT_PHASE_STREAMS], order[sched.PROMPT_PHASE_STREAMS:]]
    assert Scheduler().plan(_view(*builds, free_slots=3, decoding=True)).opens == [order[:3]]  # slots: EDF
    # a stream whose first chunk is ready, or already on the worker, opens with its chunk, not here
    waiting = [_new_voice("ready", NOW - 1, ready=True), _new_voice("planned", NOW - 1, planned=True),
               _new_voice("n", NOW)]
    assert Scheduler().prompt_passes(_view(*waiting, free_slots=4)) == [waiting[2]]


def test_prompt_passes_join_a_batch_after_its_first_chunks_and_before_its_later_chunks():
    view = _view(_first("first", opened=False, needs_slot=True), _later("later", 0.4), _new_voice("new", NOW),
                 _later("dry", sched.DRY_S / 2), free_slots=4, decoding=True)
    plan = Scheduler().plan(view)
    assert _keys(plan.phases) == [["dry"], ["first"], ["new"], ["later"]]
    (job,) = plan.phases[2]
    assert job.prompt_pass and job.opening and not job.first and not job.final
    # the first chunk's stream takes the last free slot: the pass waits for one
    assert _keys(Scheduler().plan(_view(*view.streams, free_slots=1, decoding=True)).phases) == [
        ["dry"], ["first"], ["later"]]
    # no worker (batches inline) or open-ahead off: the pass runs with the stream's first chunk
    assert not Scheduler().prompt_passes(_view(*view.streams, free_slots=4, open_ahead=False))
    assert not Scheduler().prompt_passes(EngineView(now=NOW, streams=view.streams, free_flow_slots=4, worker=None))


# ------------------------------------------------------------------ while a batch runs
def test_preemption_for_a_new_first_chunk_or_a_client_about_to_run_dry():
    s = Scheduler()
    busy = WorkerView(busy=True)
    assert s.preempt(_view(_first("new"), worker=busy)) is Preempt.first
    assert s.preempt(_view(_later("dry", sched.DRY_S / 2), worker=busy)) is Preempt.dry
    assert s.preempt(_view(_later("fine", 1.0), worker=busy)) is Preempt.none
    asked = WorkerView(busy=True, preempt_asked=True, pause_asked=True)
    assert s.preempt(_view(_first("new"), worker=asked)) is Preempt.none
    # a batch asked only to stop (for a slot) is asked again, to pause its final passes for the first chunk
    assert s.preempt(_view(_first("new"), worker=WorkerView(busy=True, preempt_asked=True))) is Preempt.first
    assert s.preempt(_view(_first("new", planned=True, ready=False), worker=busy)) is Preempt.none
    assert s.preempt(_view(_first("new"), worker=WorkerView())) is Preempt.none  # idle: nothing to preempt
    # not while the new first chunk waits for another of its burst anyway
    waits = Scheduler(_cost(step_s=0.002))
    burst = _view(_first("new", first_ready_s=NOW), _first("soon", ready=False, missing=3), worker=busy)
    assert waits.preempt(burst) is Preempt.none


def test_a_first_chunk_waiting_for_a_slot_the_batch_gave_back_stops_it_after_its_running_phase():
    """The pool takes slots given back during a batch when the batch stops: a first chunk that waits only for a
    slot makes the worker stop after its running phase instead of waiting for its end (Preempt.slot); a batch
    holding due final passes runs on, so a steady flow of such chunks cannot hand them back again and again."""
    s, busy = Scheduler(), WorkerView(busy=True)
    waiting = _first("new", ready=False, opened=False, needs_slot=True)
    assert s.preempt(_view(waiting, worker=busy, free_slots=0, slots_after_batch=1)) is Preempt.slot
    assert s.preempt(_view(waiting, worker=busy, free_slots=0)) is Preempt.none  # none comes back with it
    decoding = _first("new", ready=False, opened=False, needs_slot=True, missing=5)
    assert s.preempt(_view(decoding, worker=busy, free_slots=0, slots_after_batch=1)) is Preempt.none  # tokens
    asked = WorkerView(busy=True, preempt_asked=True)
    assert s.preempt(_view(waiting, worker=asked, free_slots=0, slots_after_batch=1)) is Preempt.none
    # a batch that holds due final passes runs on: they are not handed back again and again
    due = WorkerView(busy=True, due_finals=True)
    assert s.preempt(_view(waiting, worker=due, free_slots=0, slots_after_batch=1)) is Preempt.none


def test_a_busy_worker_is_preempted_for_a_new_voice_s_prompt_pass():
    s, busy = Scheduler(), WorkerView(busy=True)
    new = _new_voice("new", NOW)
    assert s.preempt(_view(new, _later("fine", 1.0), worker=busy, free_slots=2)) is Preempt.first
    assert s.preempt(_view(new, worker=busy, free_slots=0)) is Preempt.none  # no slot to open it in
    asked = WorkerView(busy=True, preempt_asked=True, pause_asked=True)
    assert s.preempt(_view(new, worker=asked, free_slots=2)) is Preempt.none
    assert s.preempt(_view(_new_voice("new", NOW, planned=True), worker=busy, free_slots=2)) is Preempt.none
    assert s.preempt(_view(_new_voice("new", NOW, voice_at_hand=True), worker=busy, free_slots=2)) is Preempt.none
    assert s.preempt(_view(new, worker=busy, free_slots=2, open_ahead=False)) is Preempt.none


def test_decode_pauses_for_a_first_chunk_unless_another_request_waits_for_its_first_audio():
    assert Scheduler.decode_paused(True, False)
    assert not Scheduler.decode_paused(True, True)
    assert not Scheduler.decode_paused(False, False)


def test_the_idle_engine_wakes_when_a_client_behind_the_worker_is_about_to_run_dry():
    s = Scheduler()
    view = _view(_later("a", 1.0), _later("b", 0.7), _later("c", 0.1), worker=WorkerView(busy=True))
    assert s.wake_after_s(view) == pytest.approx(0.7 - sched.DRY_S)  # c is dry already: preempt's business
    assert s.wake_after_s(_view(_later("a", 1.0), worker=WorkerView())) is None
    assert s.wake_after_s(_view(_later("a", 1.0), worker=WorkerView(busy=True, dry_asked=True))) is None


# ------------------------------------------------------------------ fairness
def test_edf_serves_every_stream_in_turn_when_the_worker_takes_two_chunks_at_a_time():
    """Eight later streams, a batch of two: each batch delivers one second of audio to its streams. Earliest
    deadline first serves them round-robin: no stream starves, none runs dry."""
    left = {f"s{i}": 1.0 + 0.1 * i for i in range(8)}
    served = dict.fromkeys(left, 0)
    now = NOW
    for _ in range(40):
        view = EngineView(now=now, streams=[StreamView(k, NOW - 5, False, now + v, ready=True, opened=True)
                                            for k, v in left.items()], max_batch=2, worker=WorkerView())
        keys = Scheduler().plan(view).new_keys
        assert len(keys) == 2
        for k in left:
            left[k] -= 0.2  # each batch takes 0.2 s of the clients' playback
        for k in keys:
            left[k] += 1.0
            served[k] += 1
        assert min(left.values()) > 0
    assert max(served.values()) - min(served.values()) <= 1


# ------------------------------------------------------------------ admission
def test_admission_off_or_idle_admits():
    assert Scheduler().admit(_view(_first("a")), NOW, 28).admitted  # no budget
    assert Scheduler(_cost(step_s=1.0), budget_s=0.1).admit(_view(), NOW, 28).admitted  # nothing runs
    assert Scheduler(budget_s=0.1).admit(None, NOW, 28).admitted  # no view yet


def test_admission_predicts_the_first_audio_from_the_decode_step_and_the_chunks_ahead():
    s = Scheduler(_cost(step_s=0.01, first_s=0.1, later_s=0.1), budget_s=1.0)
    verdict = s.admit(_view(_later("a", 5.0, ready=False), free_lm_slots=4, lm_slots=8), NOW, 30)
    assert verdict.admitted
    assert verdict.predicted_first_audio_s == pytest.approx(30 * 0.01 + 0.1)
    # twelve first chunks ahead of it, ready now: voiced together in one phase (measured at one size only:
    # PRIOR_FIXED_SHARE of it per call), which ends after its tokens are there; then its own phase
    fixed, per = 0.1 * costs.PRIOR_FIXED_SHARE, 0.1 * (1 - costs.PRIOR_FIXED_SHARE)
    crowd = [_first(f"f{i}", ready=True) for i in range(12)]
    burst = s.admit(_view(*crowd, free_lm_slots=4, lm_slots=8), NOW, 30)
    assert burst.predicted_first_audio_s == pytest.approx(fixed + 12 * per + 0.1)
    assert fixed + 12 * per > 30 * 0.01  # (the newcomer's tokens come while that phase runs)
    refused = Scheduler(s.cost, budget_s=0.4).admit(_view(*crowd, free_lm_slots=4, lm_slots=8), NOW, 30)
    assert not refused.admitted and "budget" in refused.reason and refused.rule is sched.Rule.budget
    assert refused.retry_after_s >= 1.0
    # streams admitted since the view count as newcomers ahead of it
    assert not s.admit(_view(_later("a", 5.0, ready=False), free_lm_slots=4, lm_slots=8), NOW, 30,
                       pending_new=8).admitted


def test_the_worker_debt_counts_a_final_pass_per_stream_a_first_chunk_per_stream_to_start_and_the_batch_left():
    cost = _cost(first_s=0.1, final_s=0.02)
    _, per_first = cost.phase_line("first")
    s = Scheduler(cost, budget_s=1.0)
    worker = WorkerView(busy=True, started_s=NOW - 0.1, predicted_s=0.3)  # 0.2 s of its batch left
    on_worker = _later("fin_running", 3.0, final=True, planned=True)  # its pass is in that batch already
    view = _view(_first("new0"), _first("new1", planned=True), _later("mid", 2.0), _later("fin", 4.0, final=True),
                 on_worker, worker=worker)
    # finals owed: new0, new1, mid, fin and 2 newcomers; first chunks owed: new0 and the 2 newcomers
    assert s.worker_debt_s(view, NOW, new_streams=2) == pytest.approx(0.2 + 6 * 0.02 + 3 * per_first)
    # whole-utterance final passes off: no stream owes one, new or running
    assert s.worker_debt_s(replace(view, official_finals=False), NOW, new_streams=2) == pytest.approx(
        0.2 + 3 * per_first)


def test_admission_refuses_while_the_worker_owes_more_than_its_debt_limit():
    # the limit is a number of budgets up to a ceiling (half a final pass's slack) that only a longer budget
    # raises, to one budget (a slow device's); none without a budget
    tight = sched.WORKER_DEBT_MAX_S / sched.WORKER_DEBT_BUDGETS / 2
    assert Scheduler(budget_s=tight).worker_debt_limit_s == pytest.approx(sched.WORKER_DEBT_BUDGETS * tight)
    capped = 0.75 * sched.WORKER_DEBT_MAX_S  # two of them are past the ceiling, one is not
    assert Scheduler(budget_s=capped).worker_debt_limit_s == pytest.approx(sched.WORKER_DEBT_MAX_S)
    assert Scheduler(budget_s=600.0).worker_debt_limit_s == pytest.approx(600.0)
    assert Scheduler().worker_debt_limit_s == math.inf
    cost = _cost(step_s=0.001, first_s=0.01, later_s=0.01, final_s=0.02)
    s = Scheduler(cost, budget_s=1.0)
    s.worker_debt_limit_s = 0.5
    _, per_first = cost.phase_line("first")
    fit = int((0.5 - per_first) / 0.02)  # passes that fit with the newcomer's first chunk, its own pass one of them
    finals = [_later(f"f{i}", 5.0, final=True) for i in range(fit - 1)]
    assert s.admit(_view(*finals, free_lm_slots=8, lm_slots=8), NOW, 10).admitted
    more = [*finals, _later("one_more", 5.0, final=True), _later("and_another", 5.0, final=True)]
    refused = s.admit(_view(*more, free_lm_slots=8, lm_slots=8), NOW, 10)
    assert not refused.admitted and "owes" in refused.reason and refused.retry_after_s >= 1.0
    assert refused.rule is sched.Rule.debt
    assert math.isfinite(refused.predicted_first_audio_s) and refused.predicted_first_audio_s > s.budget_s
    # every stream's first audio alone would be in time: the debt is what refuses
    s.worker_debt_limit_s = math.inf
    assert s.admit(_view(*more, free_lm_slots=8, lm_slots=8), NOW, 10).admitted
    # admitted since the view: they owe as much
    s.worker_debt_limit_s = 0.5
    assert "owes" in s.admit(_view(*finals, free_lm_slots=8, lm_slots=8), NOW, 10, pending_new=2).reason


def test_admission_waits_for_an_lm_slot_by_the_measured_hold_time():
    cost = _cost(step_s=0.01, first_s=0.1)
    cost.observe_lm_hold(4.0)
    s = Scheduler(cost, budget_s=1.0)
    full = _view(_later("a", 5.0, ready=False), free_lm_slots=0, lm_slots=2, lm_waiting=1)
    verdict = s.admit(full, NOW, 30)
    assert not verdict.admitted  # second in line for one of two slots held 4 s each: 4 s
    assert verdict.predicted_first_audio_s == pytest.approx(2 * 4.0 / 2 + 0.4)


def test_admission_before_any_stream_held_an_lm_row_admits_only_into_free_rows():
    s = Scheduler(_cost(step_s=0.01), budget_s=1.0)  # warm-up measured the decode step only
    running = _later("a", 5.0, ready=False)
    assert s.admit(_view(running, free_lm_slots=2, lm_slots=2), NOW, 30, pending_new=1).admitted
    refused = s.admit(_view(running, free_lm_slots=2, lm_slots=2), NOW, 30, pending_new=2)
    assert not refused.admitted and refused.retry_after_s == sched.MAX_RETRY_AFTER_S


def test_admission_waits_for_a_flow_slot_when_the_pool_is_taken():
    cost = _cost(step_s=0.01, first_s=0.1)
    cost.observe_lm_hold(4.0)
    s = Scheduler(cost, budget_s=1.0)
    # 28 flow slots, each held for 4 s and taken one per 4 s / 28 (so they come back one per 4 s / 28); 13
    # streams (their first chunk decoded) already wait for one: the newcomer is 14th in line
    holders = [_later(f"h{j}", 5.0, ready=False, slot_since_s=NOW - 4.0 + 4.0 * (j + 1) / 28) for j in range(28)]
    waiting = [_first(f"w{i}", ready=False, opened=False, needs_slot=True) for i in range(13)]
    taken = _view(*holders, *waiting, free_slots=0, flow_slots=28, free_lm_slots=4, lm_slots=64)
    refused = s.admit(taken, NOW, 30)
    assert not refused.admitted and "budget" in refused.reason
    assert refused.predicted_first_audio_s == pytest.approx(14 * 4.0 / 28 + 0.1)
    # streams admitted since the view queue for a slot ahead of it too
    half = _view(*holders[14:], *waiting, free_slots=14, flow_slots=28, free_lm_slots=4, lm_slots=64)
    assert s.admit(half, NOW, 30).admitted
    late = s.admit(half, NOW, 30, pending_new=8)
    assert not late.admitted and late.predicted_first_audio_s == pytest.approx(22 * 4.0 / 28 + 0.1)
    # free slots (or no pool): the thirteen first chunks go at once in one phase, the newcomer's after it
    fixed, per = 0.1 * costs.PRIOR_FIXED_SHARE, 0.1 * (1 - costs.PRIOR_FIXED_SHARE)
    for free in (28, None):
        verdict = s.admit(_view(*waiting, free_slots=free, flow_slots=28, free_lm_slots=4, lm_slots=64), NOW, 30)
        assert verdict.admitted and verdict.predicted_first_audio_s == pytest.approx(fixed + 13 * per + 0.1)
    # no stream has held its slot yet: no prediction of the slot queue, refused rather than queued
    unmeasured = Scheduler(_cost(step_s=0.01, first_s=0.1), budget_s=1.0).admit(taken, NOW, 30)
    assert not unmeasured.admitted and unmeasured.retry_after_s == sched.MAX_RETRY_AFTER_S


def test_slots_given_back_during_a_batch_come_back_when_its_running_phase_ends():
    """A stream that no longer needs its slot gives it back to the pool once the worker's batch stops, which a
    first chunk waiting for a slot makes it do after its running phase: a newcomer waits for that phase's end,
    not for the holders' measured hold nor for the whole batch."""
    cost = _cost(step_s=0.01, first_s=0.1)
    cost.observe_lm_hold(4.0)
    s = Scheduler(cost, budget_s=2.0)
    busy = WorkerView(busy=True, started_s=NOW, predicted_s=0.6, phase_end_s=NOW + 0.45)
    # 4 slots, none free, none held by a stream in view: all four given back during the running batch
    view = _view(worker=busy, free_slots=0, flow_slots=4, slots_after_batch=4, free_lm_slots=4, lm_slots=8)
    verdict = s.admit(view, NOW, 30)
    assert verdict.predicted_start_s == pytest.approx(0.45)
    # a batch holding due final passes is not stopped for a slot: they come back when it ends
    due = WorkerView(busy=True, started_s=NOW, predicted_s=0.6, phase_end_s=NOW + 0.45, due_finals=True)
    view = _view(worker=due, free_slots=0, flow_slots=4, slots_after_batch=4, free_lm_slots=4, lm_slots=8)
    assert s.admit(view, NOW, 30).predicted_start_s == pytest.approx(0.6)
    # ... slots the view does not account for (lent to the batch itself) are not counted on
    running = _later("a", 5.0, ready=False)  # (an engine with nothing running admits anyway)
    unknown = s.admit(_view(running, worker=busy, free_slots=0, flow_slots=4, free_lm_slots=4, lm_slots=8), NOW, 30)
    assert not unknown.admitted and unknown.retry_after_s == sched.MAX_RETRY_AFTER_S
    idle = s.admit(_view(free_slots=0, flow_slots=4, slots_after_batch=4, free_lm_slots=4, lm_slots=8), NOW, 30)
    assert idle.predicted_start_s == pytest.approx(30 * 0.01)  # its own tokens: the slots are back now


def test_admission_refuses_a_stream_that_would_make_a_running_stream_late():
    s = Scheduler(_cost(step_s=0.0, first_s=0.2, later_s=0.2), budget_s=1.0)
    tight = _later("tight", 0.35)  # on time alone (0.2 s of work), late behind a new first chunk (0.4 s)
    verdict = s.admit(_view(tight, free_lm_slots=4, lm_slots=4), NOW, 0)
    assert not verdict.admitted and "1 running stream" in verdict.reason and verdict.rule is sched.Rule.deadlines
    assert verdict.predicted_first_audio_s <= 1.0  # its own first audio would have been in time
    doomed = _later("doomed", 0.1)  # late whatever happens: not the newcomer's fault
    assert s.admit(_view(doomed, free_lm_slots=4, lm_slots=4), NOW, 0).admitted
    # a client about to run dry goes ahead of a first chunk (its own phase, first in the batch): the
    # newcomer waits for it and makes it late by nothing
    dry = s.admit(_view(_later("dry", 0.25), free_lm_slots=4, lm_slots=4), NOW, 0)
    assert dry.admitted and dry.predicted_first_audio_s == pytest.approx(0.2 + 0.2)
    busy = WorkerView(busy=True, started_s=NOW, predicted_s=0.5)  # the worker's batch finishes first
    late = s.admit(_view(_later("a", 9.0, ready=False), worker=busy, free_lm_slots=4, lm_slots=4), NOW, 0)
    assert late.predicted_first_audio_s == pytest.approx(0.5 + 0.2)


def test_the_cost_model_learns_each_kind_and_final_passes_from_paused_phases():
    cost = CostModel()
    assert cost.decode_step_s is None and cost.chunk_s("first") == 0.0 and cost.final_pass_s() == 0.0
    cost.observe_step(0.004)
    cost.observe_step(1.0)  # an idle gap, not a step
    assert cost.decode_step_s == pytest.approx(0.004)
    cost.observe_phase("chunks", 4, 0.2)  # one phase size seen: the prior split of its cost
    assert cost.phase_s("chunks", 4) == pytest.approx(0.2)
    assert cost.phase_line("chunks") == pytest.approx((0.2 * costs.PRIOR_FIXED_SHARE,
                                                       0.2 * (1 - costs.PRIOR_FIXED_SHARE) / 4))
    assert cost.phase_s("first", 4) == pytest.approx(0.2)  # unmeasured: the other chunk kind stands in
    cost.observe_phase("final", 0, 0.3)  # paused between Euler steps: its time counts for the passes after
    cost.observe_phase("final", 2, 0.1)
    assert cost.final_pass_s() == pytest.approx((0.9 * 0.3 + 0.1) / 2)
