"""Which ready chunks the engine voices now and when it pauses decoding (EngineCore's batching policy).

The policy's inputs are request state and the clock, so it is checked on hand-made requests; the
audio it produces is checked by the engine tests (test_overlap, test_engine...)."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cosystream.config import ChunkSchedule
from cosystream.engine.chunking import ChunkPlanner
from cosystream.engine.core import EngineCore, _holds_cuda_tensors, _Job, _Message, _phases, phase_kind
from cosystream.engine.request import LMStatus, RequestState, Segment
from cosystream.frontend import ModelInputs


class _Pool:
    def __init__(self, free: int | None, overflow: int = 0) -> None:
        self.free = free
        self.overflow = overflow

    def free_slots(self) -> int | None:
        return self.free

    def overflow_room(self) -> int:
        return self.overflow

    def needs_slot(self, inputs, max_target_tokens: int) -> bool:
        return self.free is not None


def _core(free_slots: int | None = 4, slack: float = 0.6, first_wait: float = 0.0) -> EngineCore:
    runner = SimpleNamespace(max_slots=8, device=torch.device("cpu"), set_active=lambda slot, active: None)
    return EngineCore(runner, _Pool(free_slots), lm=None, overlap=False, chunk_slack_s=slack,
                      first_chunk_wait_s=first_wait)


def _request(core: EngineCore, name: str, *, buffered_s: float | None, lm: LMStatus, slot: int,
             has_stream: bool = True) -> RequestState:
    """A request decoding in LM row `slot`; buffered_s None: no audio yet, else what its client holds."""
    seg = Segment(inputs=None, planner=ChunkPlanner(ChunkSchedule(), 150), min_len=0, max_len=500,
                  lm_status=lm, slot=slot, t2w=object() if has_stream else None)
    req = RequestState(request_id=name, segments=[seg], sampling=None, emit=lambda _: None)
    if buffered_s is not None:
        now = time.perf_counter()
        req.chunks_emitted, req.t_submit = 1, now - 1.0
        req.times.first_audio_s, req.times.audio_s = 1.0, buffered_s
    core.requests[name] = req
    if lm == LMStatus.decoding:
        core.slot_owner[slot] = req
    return req


def _ready(*reqs: RequestState) -> list:
    return [(r, r.audio_segment) for r in reqs]


def test_a_first_chunk_or_a_client_about_to_run_dry_opens_a_batch():
    core = _core()
    ahead = _request(core, "ahead", buffered_s=5.0, lm=LMStatus.decoding, slot=0)
    new = _request(core, "new", buffered_s=None, lm=LMStatus.decoding, slot=1)
    dry = _request(core, "dry", buffered_s=0.3, lm=LMStatus.decoding, slot=2)
    now = time.perf_counter()
    assert not core._worth_a_batch(_ready(ahead), now)  # waits: 5 s of audio buffered, the LM goes on
    assert core._worth_a_batch(_ready(ahead, new), now)
    assert core._worth_a_batch(_ready(ahead, dry), now)


def test_chunks_wait_only_while_the_lm_is_decoding():
    core = _core()
    ahead = _request(core, "ahead", buffered_s=5.0, lm=LMStatus.done, slot=0)
    assert core._worth_a_batch(_ready(ahead), time.perf_counter())  # no more tokens are coming: go


def test_a_finished_lm_stream_goes_when_new_streams_wait_for_a_flow_slot():
    core = _core(free_slots=0)
    decoding = _request(core, "decoding", buffered_s=5.0, lm=LMStatus.decoding, slot=0)
    ending = _request(core, "ending", buffered_s=5.0, lm=LMStatus.done, slot=1)
    _request(core, "partner", buffered_s=5.0, lm=LMStatus.decoding, slot=3)  # could share their batch
    now = time.perf_counter()
    assert not core._worth_a_batch(_ready(decoding, ending), now)  # nobody waits for its slot
    _request(core, "waiting", buffered_s=None, lm=LMStatus.decoding, slot=2, has_stream=False)
    assert core._worth_a_batch(_ready(decoding, ending), now)
    assert not core._worth_a_batch(_ready(decoding), now)  # a decoding stream frees no slot soon


def test_new_streams_start_beyond_the_pool_while_there_is_room_but_open_ahead_only_in_slots():
    core = _core(free_slots=1)
    core.t2w.overflow = 2
    new = [_request(core, f"new{i}", buffered_s=None, lm=LMStatus.decoding, slot=i, has_stream=False)
           for i in range(4)]
    assert [r.request_id for r, _ in core._within_free_slots(_ready(*new))] == ["new0", "new1", "new2"]
    assert [r.request_id for r, _ in core._within_free_slots(_ready(*new), overflow=False)] == ["new0"]
    assert [r.request_id for r, _ in core._within_free_slots(_ready(*new), reserved=2)] == ["new0"]
    assert core._flow_slots_short()  # four want to start, three can
    core.t2w.overflow = 3
    assert not core._flow_slots_short()


def test_chunks_wait_only_for_streams_that_could_join_them():
    core = _core()
    alone = _request(core, "alone", buffered_s=5.0, lm=LMStatus.decoding, slot=0)
    now = time.perf_counter()
    assert core._worth_a_batch(_ready(alone), now)  # nobody could share the batch: waiting only delays it
    later = _request(core, "later", buffered_s=5.0, lm=LMStatus.decoding, slot=1)
    assert not core._worth_a_batch(_ready(alone), now)  # "later"'s next chunk may join
    assert core._worth_a_batch(_ready(alone, later), now)  # every stream is in the batch already
    later.cancelled = True
    assert core._worth_a_batch(_ready(alone), now)
    queued = RequestState(request_id="queued", segments=[Segment(inputs=None, planner=None, min_len=0, max_len=1)],
                          sampling=None, emit=lambda _: None)
    core.requests["queued"] = queued  # submitted, not yet admitted: its first chunk will come
    assert not core._worth_a_batch(_ready(alone), now)


def test_many_ready_chunks_or_no_slack_run_at_once():
    core = _core()
    reqs = [_request(core, f"r{i}", buffered_s=5.0, lm=LMStatus.decoding, slot=i % 8) for i in range(17)]
    assert core._worth_a_batch(_ready(*reqs[:16]), time.perf_counter())  # a quarter of the largest batch
    assert not core._worth_a_batch(_ready(*reqs[:15]), time.perf_counter())
    eager = _core(slack=0.0)
    ahead = _request(eager, "ahead", buffered_s=5.0, lm=LMStatus.decoding, slot=0)
    assert eager._worth_a_batch(_ready(ahead), time.perf_counter())


def test_decoding_pauses_while_a_first_chunk_is_voiced_unless_another_request_waits_for_audio():
    core = _core()
    first = _request(core, "first", buffered_s=None, lm=LMStatus.decoding, slot=0)
    assert not core._decode_paused()
    core._in_flight = [_Job(first, first.audio_segment, plan=None)]
    core._first_in_flight = {id(first)}
    assert core._decode_paused() and not core._busy()
    _request(core, "playing", buffered_s=2.0, lm=LMStatus.decoding, slot=1)
    assert core._decode_paused()  # it has audio: its tokens can wait for the first chunk
    _request(core, "newer", buffered_s=None, lm=LMStatus.decoding, slot=2)
    assert not core._decode_paused() and core._busy()  # its first audio needs tokens now


def test_decoding_goes_on_beside_a_first_chunk_when_pausing_is_off():
    core = _core()
    core.pause_decode_for_first_chunks = False
    first = _request(core, "first", buffered_s=None, lm=LMStatus.decoding, slot=0)
    core._in_flight = [_Job(first, first.audio_segment, plan=None)]
    core._first_in_flight = {id(first)}
    assert not core._decode_paused() and core._busy()


def test_a_batch_with_a_first_chunk_leaves_out_official_finals_that_can_wait():
    core = _core(free_slots=2)
    core.t2w.final_attention = "full"
    new = _request(core, "new", buffered_s=None, lm=LMStatus.decoding, slot=0, has_stream=False)
    ending = _request(core, "ending", buffered_s=5.0, lm=LMStatus.done, slot=1)
    ending.audio_segment.tokens = list(range(20))  # fewer than the next hop needs: its next chunk is final
    middle = _request(core, "middle", buffered_s=5.0, lm=LMStatus.decoding, slot=2)
    middle.audio_segment.tokens = list(range(200))
    dry = _request(core, "dry", buffered_s=0.2, lm=LMStatus.done, slot=3)
    now = time.perf_counter()
    due = core._due_finals(now)
    assert due == {id(dry)}  # 0.2 s left < chunk_slack_s
    kept = core._without_costly_finals(_ready(new, ending, middle, dry), now, due)
    assert [r.request_id for r, _ in kept] == ["new", "middle", "dry"]
    assert len(core._without_costly_finals(_ready(ending, middle), now, due)) == 2  # no first chunk: all go
    core.t2w.free = 0  # "new" waits for a slot that "ending" frees
    assert len(core._without_costly_finals(_ready(new, ending), now, due)) == 2
    core.t2w.final_attention = "chunk"  # an incremental final costs what any chunk costs
    core.t2w.free = 2
    assert len(core._without_costly_finals(_ready(new, ending), now, due)) == 2


def test_a_final_pass_with_less_than_final_slack_of_audio_left_is_due():
    """EngineConfig.final_slack_s (with pause_final_passes): a final pass whose client has less audio left
    than that goes in a first chunk's batch, and its job may not pause; one with more waits, or pauses."""
    runner = SimpleNamespace(max_slots=8, device=torch.device("cpu"), set_active=lambda slot, active: None)
    core = EngineCore(runner, _Pool(4), lm=None, overlap=False, chunk_slack_s=0.6, final_slack_s=2.0,
                      pause_final_passes=True)
    core.t2w.final_attention = "full"
    new = _with_tokens(_request(core, "new", buffered_s=None, lm=LMStatus.decoding, slot=0), 40)
    soon = _request(core, "soon", buffered_s=1.5, lm=LMStatus.done, slot=1)
    later = _request(core, "later", buffered_s=3.0, lm=LMStatus.done, slot=2)
    for req in (soon, later):
        req.audio_segment.tokens = list(range(20))  # fewer than the next hop needs: its next chunk is final
    now = time.perf_counter()
    assert core._due_finals(now) == {id(soon)}  # no pass measured yet: each judged on its own audio left
    kept = core._without_costly_finals(_ready(new, soon, later), now, core._due_finals(now))
    assert [r.request_id for r, _ in kept] == ["new", "soon"]
    core._chunks = worker = _FakeWorker()
    core._token2wav()
    (jobs,) = worker.submitted
    by_name = {job.req.request_id: job for phase in jobs for job in phase}
    assert set(by_name) == {"new", "soon"} and by_name["soon"].due and not by_name["new"].pausable
    # without pausing, the old rule: finals with more than chunk_slack_s left wait
    off = EngineCore(runner, _Pool(4), lm=None, overlap=False, chunk_slack_s=0.6, final_slack_s=2.0,
                     pause_final_passes=False)
    assert off.final_slack_s == 0 and off._due_finals(now) == set()  # 1.5 s left > chunk_slack_s


def _waiting_finals(core: EngineCore, left_s: list[float]) -> list[RequestState]:
    reqs = [_request(core, f"final{i}", buffered_s=left, lm=LMStatus.done, slot=i) for i, left in enumerate(left_s)]
    for req in reqs:
        req.audio_segment.tokens = list(range(20))  # fewer than the next hop needs: its next chunk is final
    return reqs


def test_final_passes_come_due_by_earliest_deadline_with_the_measured_cost_of_those_before_them():
    """Passes waiting to run cost the measured time each: the k-th to run dry is due once its audio left
    minus k passes is under the slack, and with it every pass due before it."""
    runner = SimpleNamespace(max_slots=8, device=torch.device("cpu"), set_active=lambda slot, active: None)
    core = EngineCore(runner, _Pool(4), lm=None, overlap=False, chunk_slack_s=0.6, final_slack_s=2.0,
                      pause_final_passes=True)
    a, b, c, d = _waiting_finals(core, [3.0, 3.2, 3.4, 9.0])
    now = time.perf_counter()
    assert core._due_finals(now) == set()  # none measured: each has more than 2 s left
    finals = [_Job(r, r.audio_segment, plan=SimpleNamespace(is_final=True)) for r in (a, b)]
    core._time_finals(finals, busy_s=1.0)  # two passes in one phase: 0.5 s each
    assert core._final_cost_s() == pytest.approx(0.5)
    # c: 3.4 s left behind three passes of 0.5 s = 1.9 < 2: c is due, and a and b (earlier deadlines) with it
    assert core._due_finals(now) == {id(a), id(b), id(c)}
    c.cancelled = True  # b: 3.2 - 1.0 = 2.2, a: 3.0 - 0.5 = 2.5: neither due
    assert core._due_finals(now) == set()


def test_a_due_final_pass_opens_a_batch_of_its_own():
    """With no first chunk to open a batch (the end of a burst), finals due by their deadlines must not wait
    until their clients have less than chunk_slack_s left: then all of them would be due at once."""
    runner = SimpleNamespace(max_slots=8, device=torch.device("cpu"), set_active=lambda slot, active: None)
    core = EngineCore(runner, _Pool(4), lm=None, overlap=False, chunk_slack_s=0.6, final_slack_s=2.0,
                      pause_final_passes=True)
    _request(core, "decoding", buffered_s=5.0, lm=LMStatus.decoding, slot=5)  # its chunks could join later
    (final,) = _waiting_finals(core, [1.5])
    now = time.perf_counter()
    assert core._worth_a_batch(_ready(final), now, core._due_finals(now))
    assert not core._worth_a_batch(_ready(final), now)  # 1.5 s buffered > chunk_slack_s: it would wait
    core._chunks = worker = _FakeWorker()
    core._token2wav()
    assert [[job.req.request_id for job in phase] for phase in worker.submitted[0]] == [["final0"]]


def test_the_cost_of_a_final_pass_counts_paused_phases_and_only_phases_of_finals():
    core = _core()
    req = _request(core, "r", buffered_s=3.0, lm=LMStatus.done, slot=0)
    final = _Job(req, req.audio_segment, plan=SimpleNamespace(is_final=True))
    later = _Job(req, req.audio_segment, plan=SimpleNamespace(is_final=False))
    core._time_finals([later], busy_s=5.0)  # a phase of later chunks: not a final's cost
    assert core._final_cost_s() == 0.0
    core._time_finals([], busy_s=0.2)  # a phase paused between Euler steps: time spent, no pass finished
    core._time_finals([final, final], busy_s=0.4)
    assert core._final_cost_s() == pytest.approx((0.9 * 0.2 + 0.4) / 2)
    assert core.t2w_due_final_phases == 0 and core.t2w_due_final_s == 0  # none of them was due


def test_phases_with_a_due_final_pass_are_counted_apart():
    """The worker time of phases that hold a due pass (they do not pause for first chunks) is its own stat."""
    core = _core()
    req = _request(core, "r", buffered_s=1.0, lm=LMStatus.done, slot=0)
    waiting = _Job(req, req.audio_segment, plan=SimpleNamespace(is_final=True))
    due = _Job(req, req.audio_segment, plan=SimpleNamespace(is_final=True), due=True)
    core._time_finals([waiting, due], busy_s=0.3)
    core._time_finals([waiting], busy_s=0.2)
    assert core.t2w_final_s == pytest.approx(0.5) and core.t2w_finals == 3
    assert core.t2w_due_final_s == pytest.approx(0.3) and core.t2w_due_final_phases == 1


def _with_tokens(req: RequestState, n: int) -> RequestState:
    req.audio_segment.tokens = list(range(n))
    return req


def test_ready_first_chunks_wait_for_first_chunks_due_within_the_wait():
    core = _core(first_wait=0.05)
    core._step_s = 0.002  # measured decode step: 2 ms
    need = ChunkPlanner(ChunkSchedule(), 150).tokens_needed()
    first = _with_tokens(_request(core, "first", buffered_s=None, lm=LMStatus.decoding, slot=0), need)
    near = _with_tokens(_request(core, "near", buffered_s=None, lm=LMStatus.decoding, slot=1), need - 10)
    now = time.perf_counter()
    assert core._first_chunks_due_soon(_ready(first), now)  # "near" is 10 steps = 20 ms away
    assert not core._first_chunks_due_soon(_ready(first), now + 0.04)  # 10 ms left of the wait: too far
    near.audio_segment.tokens = list(range(need - 30))  # 60 ms away: never worth the wait
    first.t_first_ready = None
    assert not core._first_chunks_due_soon(_ready(first), now)


def test_first_chunks_do_not_wait_for_streams_not_decoding_or_a_client_running_dry():
    core = _core(first_wait=0.05)
    core._step_s = 0.002
    need = ChunkPlanner(ChunkSchedule(), 150).tokens_needed()
    first = _with_tokens(_request(core, "first", buffered_s=None, lm=LMStatus.decoding, slot=0), need)
    parked = _with_tokens(_request(core, "parked", buffered_s=None, lm=LMStatus.waiting_text, slot=1), need - 5)
    now = time.perf_counter()
    assert not core._first_chunks_due_soon(_ready(first), now)  # parked for text: no tokens are coming
    _with_tokens(_request(core, "near", buffered_s=None, lm=LMStatus.decoding, slot=2), need - 5)
    dry = _request(core, "dry", buffered_s=0.3, lm=LMStatus.decoding, slot=3)
    assert not core._first_chunks_due_soon(_ready(first, dry), now)  # a later chunk about to run dry
    assert parked.t_first_ready is None
    assert core._first_chunks_due_soon(_ready(first), now)
    assert not _core(first_wait=0.0)._first_chunks_due_soon(_ready(first), now)  # off


def _job(req: RequestState, final: bool) -> _Job:
    return _Job(req, req.audio_segment, plan=SimpleNamespace(is_final=final, offset=0, num_new=25))


def test_a_batch_is_voiced_dry_clients_first_chunks_later_chunks_then_finals():
    core = _core()
    ending = _request(core, "ending", buffered_s=0.5, lm=LMStatus.done, slot=0)
    new = _request(core, "new", buffered_s=None, lm=LMStatus.decoding, slot=1)
    middle = _request(core, "middle", buffered_s=2.0, lm=LMStatus.decoding, slot=2)
    short = _request(core, "short", buffered_s=None, lm=LMStatus.done, slot=3)  # its first chunk is its last
    dry = _request(core, "dry", buffered_s=0.1, lm=LMStatus.decoding, slot=4)
    dry_final = _request(core, "dry_final", buffered_s=0.2, lm=LMStatus.done, slot=5)
    jobs = [_job(ending, True), _job(middle, False), _job(dry_final, True), _job(new, False), _job(short, True),
            _job(dry, False)]
    phases = _phases(jobs, time.perf_counter(), dry_s=0.3)
    assert [[j.req.request_id for j in phase] for phase in phases] == [
        ["dry_final", "dry"], ["new", "short"], ["middle"], ["ending"]]
    assert [len(phase) for phase in _phases(jobs[1:2], time.perf_counter(), 0.3)] == [1]  # no empty phases
    assert len(_phases(jobs, time.perf_counter(), dry_s=0.0)) == 3  # no client counts as dry
    # finals that may pause go after the due ones, in a phase of their own (one due pass keeps a phase whole)
    later = _request(core, "later", buffered_s=5.0, lm=LMStatus.done, slot=6)
    waiting = _job(later, True)
    waiting.pausable = True
    for job in jobs:
        job.due = job.plan.is_final
    phases = _phases([waiting, *jobs], time.perf_counter(), dry_s=0.3)
    assert [[j.req.request_id for j in phase] for phase in phases][-2:] == [["ending"], ["later"]]


def test_final_passes_go_in_phases_of_at_most_final_phase_streams():
    core = _core()
    finals = []
    for i in range(5):
        req = _request(core, f"end{i}", buffered_s=3.0, lm=LMStatus.done, slot=i)
        finals.append(_job(req, True))
    new = _job(_request(core, "new", buffered_s=None, lm=LMStatus.decoding, slot=6), False)
    pausable = _job(_request(core, "pausable", buffered_s=3.0, lm=LMStatus.done, slot=7), True)
    pausable.pausable = True
    jobs = [*finals, new, pausable]
    names = [[j.req.request_id for j in phase] for phase in _phases(jobs, time.perf_counter(), 0.3, 2)]
    assert names == [["new"], ["end0", "end1"], ["end2", "end3"], ["end4"], ["pausable"]]
    whole = [[j.req.request_id for j in phase] for phase in _phases(jobs, time.perf_counter(), 0.3, 0)]
    assert whole == [["new"], [f"end{i}" for i in range(5)], ["pausable"]]


def test_a_phase_that_comes_back_is_emitted_while_the_rest_of_its_batch_still_runs():
    core = _core()
    got: dict[str, list] = {"new": [], "ending": []}
    ending = _request(core, "ending", buffered_s=0.1, lm=LMStatus.done, slot=0)
    new = _request(core, "new", buffered_s=None, lm=LMStatus.decoding, slot=1)
    for req in (ending, new):
        req.emit = got[req.request_id].append
    jobs = [_job(new, False), _job(ending, True)]
    core._in_flight = list(jobs)
    core._first_in_flight = {id(new)}
    ran: list[str] = []
    core._after_batch.append(lambda: ran.append("release"))  # e.g. a flow slot given back
    pcm = np.zeros(480, dtype=np.float32)
    core._chunks_done(jobs[:1], [(pcm, 0.02, 0.003)], None, time.perf_counter(), last=False)
    assert len(got["new"]) == 1 and not got["ending"]  # the first chunk is out, the final still computes
    assert core._in_flight == jobs[1:] and not core._first_in_flight and not core._decode_paused()
    assert ran == []  # the worker still uses the flow: slot releases wait for the batch's end
    assert core.t2w_batches == 0
    core._chunks_done(jobs[1:], [(pcm, 0.3, 0.01)], None, time.perf_counter(), last=True)
    assert len(got["ending"]) == 1 and got["ending"][0].is_final
    assert core._in_flight is None and ran == ["release"] and core.t2w_batches == 1


class _Watch:
    def start(self) -> None: ...
    def lap(self, name: str) -> None: ...


class _FakeWorker:
    def __init__(self) -> None:
        self.preempt = threading.Event()
        self.dry = threading.Event()
        self.submitted: list[list[list[_Job]]] = []

    def submit(self, phases: list[list[_Job]]) -> None:
        self.preempt.clear()
        self.dry.clear()
        self.submitted.append(phases)


def _ready_first_chunk(core: EngineCore, name: str, slot: int) -> RequestState:
    req = _request(core, name, buffered_s=None, lm=LMStatus.decoding, slot=slot)
    return _with_tokens(req, req.audio_segment.planner.tokens_needed())


def test_a_first_chunk_ready_during_a_batch_asks_the_worker_to_hand_back_its_unstarted_phases():
    core = _core()
    core._chunks = worker = _FakeWorker()
    ending = _request(core, "ending", buffered_s=3.0, lm=LMStatus.done, slot=0)
    core._in_flight = [_job(ending, True)]
    core._token2wav()
    assert not worker.preempt.is_set()  # nothing urgent is ready
    _request(core, "ahead", buffered_s=3.0, lm=LMStatus.decoding, slot=1).audio_segment.tokens = list(range(200))
    core._token2wav()
    assert not worker.preempt.is_set()  # a later chunk with audio to spare is not urgent
    new = _ready_first_chunk(core, "new", slot=2)
    core._token2wav()
    assert worker.preempt.is_set() and not worker.submitted  # one batch at a time: the new one waits
    worker.preempt.clear()
    core.preempt = False
    core._token2wav()
    assert not worker.preempt.is_set()  # switched off
    core.preempt = True
    new.cancelled = True
    core._token2wav()
    assert not worker.preempt.is_set()


def test_no_preemption_while_the_new_first_chunk_waits_for_its_burst():
    core = _core(first_wait=0.05)
    core._step_s = 0.002
    core._chunks = worker = _FakeWorker()
    ending = _request(core, "ending", buffered_s=3.0, lm=LMStatus.done, slot=0)
    core._in_flight = [_job(ending, True)]
    new = _ready_first_chunk(core, "new", slot=1)
    need = new.audio_segment.planner.tokens_needed()
    _with_tokens(_request(core, "near", buffered_s=None, lm=LMStatus.decoding, slot=2), need - 5)
    core._token2wav()
    assert not worker.preempt.is_set()  # "near" is 10 ms away: they will share a batch anyway
    new.t_first_ready -= 0.05  # the wait is over
    core._token2wav()
    assert worker.preempt.is_set()


def test_handed_back_jobs_open_the_next_batch_with_their_plans_behind_the_new_first_chunk():
    core = _core()
    core._chunks = worker = _FakeWorker()
    got: list = []
    first = _request(core, "first", buffered_s=None, lm=LMStatus.decoding, slot=0)
    first.emit = got.append
    middle = _request(core, "middle", buffered_s=3.0, lm=LMStatus.decoding, slot=1)
    ending = _request(core, "ending", buffered_s=3.0, lm=LMStatus.done, slot=2)
    _with_tokens(middle, 400)  # more tokens than its planned chunk needs: it must not be planned twice
    planned = [_job(middle, False), _job(ending, True)]
    core._in_flight = [_job(first, False)] + planned
    core._first_in_flight = {id(first)}
    ran: list[str] = []
    core._after_batch.append(lambda: ran.append("release"))
    pcm = np.zeros(480, dtype=np.float32)
    core._chunks_done(core._in_flight[:1], [(pcm, 0.02, 0.003)], None, time.perf_counter(), last=True,
                      returned=planned)
    assert len(got) == 1 and core._in_flight is None and ran == ["release"]  # the worker is idle again
    new = _ready_first_chunk(core, "new", slot=3)
    offset_before = middle.audio_segment.planner.offset
    core._token2wav()
    phases = worker.submitted[-1]
    assert [[j.req.request_id for j in phase] for phase in phases] == [["new"], ["middle"], ["ending"]]
    assert phases[1][0] is planned[0] and phases[2][0] is planned[1]  # the same plans, not new ones
    assert middle.audio_segment.planner.offset == offset_before and not core._returned
    assert new.audio_segment.planner.offset > 0  # the new first chunk was planned


def test_handed_back_jobs_of_a_cancelled_request_are_dropped():
    core = _core()
    core._chunks = worker = _FakeWorker()
    gone = _request(core, "gone", buffered_s=3.0, lm=LMStatus.done, slot=0)
    core._returned = [_job(gone, True)]
    gone.cancelled = True
    core._token2wav()
    assert not worker.submitted and not core._returned


def test_the_worker_stops_after_the_running_phase_and_returns_the_rest_in_one_message():
    from cosystream.engine.core import _ChunkWorker

    runs: list[list[str]] = []
    core = SimpleNamespace(inbox=queue.Queue(), lm_runner=SimpleNamespace(device=torch.device("cpu")),
                           rider_streams=16, pause_final_passes=False)
    worker = _ChunkWorker(core)

    def run(items: list, should_stop=None) -> list:
        runs.append([plan.name for _, _, plan in items])
        if len(runs) == 1:
            worker.preempt.set()  # the engine asks while the first phase computes
        return [(np.zeros(4, np.float32), 0.0, 0.0)] * len(items)

    core.t2w = SimpleNamespace(watch=_Watch(), run=run)
    req = RequestState(request_id="r", segments=[Segment(inputs=None, planner=None, min_len=0, max_len=1)],
                       sampling=None, emit=lambda _: None)
    jobs = [_Job(req, req.audio_segment, plan=SimpleNamespace(name=n)) for n in ("a", "b", "c")]
    worker.start()
    try:
        worker.submit([[jobs[0]], [jobs[1]], [jobs[2]]])
        msg = core.inbox.get(timeout=10)
        done, _, error, _, _, last, returned = msg.payload
        assert done == [jobs[0]] and error is None and last and returned == jobs[1:]
        worker.submit([[jobs[1]], [jobs[2]]])  # a new batch: the old request to stop does not apply
        payloads = [core.inbox.get(timeout=10).payload for _ in range(2)]
    finally:
        worker.stop()
    assert [(p[0], p[5], p[6]) for p in payloads] == [([jobs[1]], False, []), ([jobs[2]], True, [])]
    assert runs == [["a"], ["b"], ["c"]] and core.inbox.empty()


def test_a_paused_phase_of_final_passes_comes_back_whole_with_the_rest():
    """EngineConfig.pause_final_passes: the worker hands the preemption flag to the run as `should_stop`; a
    run that paused (None) voiced nothing, so its jobs come back, ahead of the unstarted phases, in one
    message that ends the batch. Off: the run is not asked."""
    from cosystream.engine.core import _ChunkWorker

    asked: list[object] = []
    core = SimpleNamespace(inbox=queue.Queue(), lm_runner=SimpleNamespace(device=torch.device("cpu")),
                           rider_streams=16, pause_final_passes=True)
    worker = _ChunkWorker(core)

    dry_too = [False]

    def run(items: list, should_stop=None) -> list | None:
        asked.append(should_stop)
        worker.preempt.set()  # the engine asks while the phase computes (for a first chunk) ...
        if dry_too[0]:
            worker.dry.set()  # ... or for a client about to run dry
        if should_stop is not None and should_stop():
            return None
        return [(np.zeros(4, np.float32), 0.0, 0.0)] * len(items)

    core.t2w = SimpleNamespace(watch=_Watch(), run=run)
    req = RequestState(request_id="r", segments=[Segment(inputs=None, planner=None, min_len=0, max_len=1)],
                       sampling=None, emit=lambda _: None)
    jobs = [_Job(req, req.audio_segment, plan=SimpleNamespace(name=n), pausable=True, due=n == "g")
            for n in ("f1", "f2", "g")]
    later = _Job(req, req.audio_segment, plan=SimpleNamespace(name="later"))  # not a final pass: never asked
    worker.start()
    try:
        worker.submit([[jobs[0], jobs[1]], [jobs[2]]])
        done, results, error, _, _, last, returned = core.inbox.get(timeout=10).payload
        assert (done, results, error, last, returned) == ([], [], None, True, jobs)
        worker.submit([jobs])  # a phase with a due pass: it does not give way to a first chunk
        done, _, error, _, _, last, returned = core.inbox.get(timeout=10).payload
        assert done == jobs and error is None and last and returned == []
        dry_too[0] = True
        worker.submit([jobs])  # ... but to a client about to run dry
        done, _, error, _, _, last, returned = core.inbox.get(timeout=10).payload
        assert done == [] and error is None and last and returned == jobs
        worker.submit([[later]])
        done, _, error, _, _, last, returned = core.inbox.get(timeout=10).payload
        assert done == [later] and returned == []
        core.pause_final_passes = False
        worker.submit([jobs[:2]])
        done, _, error, _, _, last, returned = core.inbox.get(timeout=10).payload
    finally:
        worker.stop()
    assert done == jobs[:2] and error is None and last and returned == []
    assert all(a is not None for a in asked[:3]) and asked[3:] == [None, None] and core.inbox.empty()


class _GroupingT2W:
    """Token-to-wave fake whose ODE group of a chunk is its plan's `key` (None: a path of its own)."""

    def __init__(self) -> None:
        self.watch = _Watch()
        self.runs: list[list[str]] = []

    def start(self, **open_args) -> object:
        return object()

    def flow_group(self, state: object, plan: SimpleNamespace) -> object:
        return plan.key

    def run(self, items: list, should_stop=None) -> list:
        self.runs.append([plan.name for _, _, plan in items])
        return [(np.zeros(4, np.float32), 0.0, 0.0)] * len(items)


def _keyed_job(name: str, key: object, *, first: bool = False, opening: bool = False, final: bool = False) -> _Job:
    req = RequestState(request_id=name, segments=[Segment(inputs=None, planner=None, min_len=0, max_len=1)],
                       sampling=None, emit=lambda _: None)
    plan = SimpleNamespace(name=name, key=key, is_final=final)
    return _Job(req, req.audio_segment, plan=plan, open_args={} if opening else None,
                state=None if opening else object(), first=first)


def test_later_chunks_with_a_first_chunks_ode_shape_ride_along_with_it():
    from cosystream.engine.core import run_jobs

    t2w = _GroupingT2W()
    a = _keyed_job("a", 50, first=True, opening=True)
    b, c = _keyed_job("b", 50), _keyed_job("c", 100)  # c: another ODE shape (a third chunk)
    d = _keyed_job("d", 50, opening=True)  # a later segment's stream opening: not a rider
    e = _keyed_job("e", None, final=True)  # an official final pass: a path of its own
    f = _keyed_job("f", None, final=True)
    phases = [[a], [b, c, d, e], [f]]
    results = run_jobs(t2w, phases[0], torch.device("cpu"), phases, 0, rider_streams=16)
    assert t2w.runs == [["a", "b"]] and len(results) == 2
    assert phases == [[a, b], [c, d, e], [f]]  # the rider joined phase 0 in place and left phase 1
    # the riders' phase goes when they all rode along
    g = _keyed_job("g", 50)
    phases = [[a], [g], [f]]
    run_jobs(t2w, phases[0], torch.device("cpu"), phases, 0, rider_streams=16)
    assert phases == [[a, g], [f]]
    # only a phase of first chunks takes riders; rider_streams = 0: never
    phases = [[b], [_keyed_job("h", 50)]]
    run_jobs(t2w, phases[0], torch.device("cpu"), phases, 0, rider_streams=16)
    assert [len(p) for p in phases] == [1, 1]
    phases = [[_keyed_job("i", 50, first=True)], [_keyed_job("j", 50)]]
    run_jobs(t2w, phases[0], torch.device("cpu"), phases, 0, rider_streams=0)
    assert [len(p) for p in phases] == [1, 1]


def test_riders_fill_a_first_chunk_phase_up_to_its_stream_limit():
    from cosystream.engine.core import run_jobs

    t2w = _GroupingT2W()
    firsts = [_keyed_job(n, 50, first=True) for n in ("a", "b")]
    later = [_keyed_job(n, 50) for n in ("c", "d")]
    phases = [list(firsts), list(later)]
    run_jobs(t2w, phases[0], torch.device("cpu"), phases, 0, rider_streams=3)
    assert phases == [firsts + later[:1], later[1:]] and t2w.runs == [["a", "b", "c"]]


def test_riders_of_a_failed_run_are_in_the_failed_phase():
    """The engine fails the jobs of a phase whose run raised: riders that shared the call are among them,
    and gone from the phase they came from (their streams may be half advanced)."""
    from cosystream.engine.core import run_jobs

    class _Failing(_GroupingT2W):
        def run(self, items: list, should_stop=None) -> list:
            raise RuntimeError("out of memory")

    a, b, c = _keyed_job("a", 50, first=True), _keyed_job("b", 50), _keyed_job("c", 100)
    phases = [[a], [b, c]]
    jobs = phases[0]
    with pytest.raises(RuntimeError, match="out of memory"):
        run_jobs(_Failing(), jobs, torch.device("cpu"), phases, 0, rider_streams=16)
    assert jobs == [a, b] and phases == [[a, b], [c]]


def test_the_worker_hands_riders_back_with_the_first_chunks_they_rode_with():
    from cosystream.engine.core import _ChunkWorker

    core = SimpleNamespace(inbox=queue.Queue(), lm_runner=SimpleNamespace(device=torch.device("cpu")),
                           t2w=_GroupingT2W(), rider_streams=16, pause_final_passes=False)
    worker = _ChunkWorker(core)
    a, b, c = _keyed_job("a", 50, first=True), _keyed_job("b", 50), _keyed_job("c", 100)
    worker.start()
    try:
        worker.submit([[a], [b, c]])
        payloads = [core.inbox.get(timeout=10).payload for _ in range(2)]
    finally:
        worker.stop()
    assert [(p[0], p[5]) for p in payloads] == [([a, b], False), ([c], True)]
    assert core.t2w.runs == [["a", "b"], ["c"]] and core.inbox.empty()


class _SlotPool(_Pool):
    """A pool whose streams all take a slot; records the streams given back; voices in `cached` have their
    prompt state at hand."""

    def __init__(self, free: int, cached: tuple[str, ...] = ()) -> None:
        super().__init__(free)
        self.released: list[object] = []
        self.cached = cached

    def has_prompt(self, voice_key: str | None, stored: object = None) -> bool:
        return voice_key in self.cached

    def needs_slot(self, inputs: object, max_target_tokens: int) -> bool:
        return True

    def can_start(self, inputs: object, max_target_tokens: int) -> bool:
        return self.free > 0

    def release(self, state: object) -> None:
        self.released.append(state)


def _new_request(core: EngineCore, name: str, slot: int, *, text_stream: bool = False,
                 voice: str | None = None) -> RequestState:
    req = _request(core, name, buffered_s=None, lm=LMStatus.decoding, slot=slot, has_stream=False)
    req.sampling = SimpleNamespace(seed=slot)
    req.voice_key = voice
    if text_stream:
        req.audio_segment.bistream = object()
    return req


def test_the_idle_worker_opens_new_streams_ahead_of_their_first_chunk():
    """While the LM decodes a new request's first tokens and the worker has nothing to voice, the
    request's stream opens in a batch of its own (open jobs only), oldest first, within the free slots:
    streams of voices at hand in one phase, each voice to build in a phase of its own."""
    core = EngineCore(SimpleNamespace(max_slots=8, device=torch.device("cpu"), set_active=lambda s, a: None),
                      _SlotPool(3, cached=("known",)), lm=None, overlap=False, chunk_slack_s=0.6)
    core._chunks = worker = _FakeWorker()
    _request(core, "open", buffered_s=None, lm=LMStatus.decoding, slot=0)  # its stream is open already
    _new_request(core, "texts", 1, text_stream=True)  # its LM may wait for text: opens with its first chunk
    _new_request(core, "old", 2)
    _new_request(core, "gone", 3).cancelled = True
    _new_request(core, "new", 4, voice="known")
    _new_request(core, "newer", 5, voice="known")
    _new_request(core, "newest", 6)  # no fourth free slot
    core._token2wav()
    phases = worker.submitted[-1]
    assert [[job.req.request_id for job in phase] for phase in phases] == [["new", "newer"], ["old"]]
    jobs = [job for phase in phases for job in phase]
    assert all(job.plan is None and job.open_args is not None and not job.first for job in jobs)
    assert phases[1][0].open_args["seed"] == 2 and sorted(map(id, core._in_flight)) == sorted(map(id, jobs))
    assert not core._first_in_flight
    assert not core._decode_paused()  # decoding goes on: these streams have no tokens to voice yet
    core._token2wav()
    assert len(worker.submitted) == 1  # one batch at a time


def test_no_stream_opens_ahead_when_switched_off_without_a_worker_or_while_a_chunk_goes():
    def core_with(open_ahead: bool, worker: bool) -> tuple[EngineCore, _FakeWorker]:
        core = EngineCore(SimpleNamespace(max_slots=8, device=torch.device("cpu"), set_active=lambda s, a: None),
                          _SlotPool(4), lm=None, overlap=False, open_ahead=open_ahead)
        fake = _FakeWorker()
        core._chunks = fake if worker else None
        _new_request(core, "new", 0)
        return core, fake

    core, fake = core_with(open_ahead=False, worker=True)
    core._token2wav()
    assert not fake.submitted
    core, _ = core_with(open_ahead=True, worker=False)  # inline: opening early would not overlap anything
    core._token2wav()
    assert core._in_flight is None
    core, fake = core_with(open_ahead=True, worker=True)
    _ready_first_chunk(core, "ready", 1)  # a chunk to voice: it goes, with its own stream opening
    core._token2wav()
    (phase,) = fake.submitted[-1]
    assert [job.req.request_id for job in phase] == ["ready"] and phase[0].plan is not None


def test_streams_opened_ahead_join_their_segments_and_nothing_is_voiced():
    core = EngineCore(SimpleNamespace(max_slots=8, device=torch.device("cpu"), set_active=lambda s, a: None),
                      _SlotPool(4), lm=None, overlap=False)
    got: list = []
    kept, gone = _new_request(core, "kept", 0), _new_request(core, "gone", 1)
    kept.emit = gone.emit = got.append
    jobs = [_Job(req, req.audio_segment, None, open_args={}, state=object()) for req in (kept, gone)]
    core._in_flight = list(jobs)
    gone.cancelled = True
    core._chunks_done(jobs, [None, None], None, time.perf_counter())
    assert kept.audio_segment.t2w is jobs[0].state and gone.audio_segment.t2w is None
    assert core.t2w.released == [jobs[1].state]  # a cancelled request's slot comes straight back
    assert not got and core._in_flight is None and core.t2w_batches == 0 and core.t2w_chunks == 0


def test_open_jobs_a_preempted_worker_hands_back_are_dropped():
    """A chunk that turned urgent stopped the worker between two voices' builds: the unstarted open jobs are
    not replanned (their streams open later, ahead again or with their first chunk); chunk jobs are."""
    core = EngineCore(SimpleNamespace(max_slots=8, device=torch.device("cpu"), set_active=lambda s, a: None),
                      _SlotPool(4), lm=None, overlap=False)
    first, second = _new_request(core, "first", 0), _new_request(core, "second", 1)
    ending = _request(core, "ending", buffered_s=3.0, lm=LMStatus.done, slot=2)
    opened = _Job(first, first.audio_segment, None, open_args={}, state=object())
    unstarted, planned = _Job(second, second.audio_segment, None, open_args={}), _job(ending, True)
    core._in_flight = [opened, unstarted]
    core._chunks_done([opened], [None], None, time.perf_counter(), last=True, returned=[unstarted, planned])
    assert core._returned == [planned] and core._in_flight is None
    assert first.audio_segment.t2w is opened.state and second.audio_segment.t2w is None


def test_a_batch_of_open_jobs_opens_streams_and_runs_no_flow():
    from cosystream.engine.core import run_jobs

    class _Opening(_GroupingT2W):
        def __init__(self) -> None:
            super().__init__()
            self.settled = 0

        def start(self, **open_args) -> object:
            if open_args.get("fail"):
                raise RuntimeError("out of memory")
            return object()

        def opened(self) -> None:
            self.settled += 1

    t2w = _Opening()
    ok, bad = _keyed_job("ok", None, opening=True), _keyed_job("bad", None, opening=True)
    bad.open_args = {"fail": True}
    for job in (ok, bad):
        job.plan = None
    assert run_jobs(t2w, [ok, bad], torch.device("cpu"), [[ok, bad]], 0, rider_streams=16) == [None, None]
    assert ok.state is not None and ok.error is None and isinstance(bad.error, RuntimeError)
    assert t2w.runs == [] and t2w.settled == 1


def test_a_segment_whose_next_chunk_is_the_official_final_pass_gives_its_flow_slot_back():
    """The official final pass reads no flow slot: once the LM is done and only that pass is left, the
    slot goes back (after the segment's chunk on the worker, if any, is voiced), not when the pass ends."""
    core = _core()
    released: list[object] = []
    core.t2w.release = released.append
    core.t2w.final_attention = "full"
    req = _request(core, "a", buffered_s=None, lm=LMStatus.decoding, slot=0)
    seg = req.audio_segment
    seg.tokens = list(range(40))
    job = _Job(req, seg, seg.planner.next_plan(40, done=False), state=seg.t2w, first=True)  # 25 + 3 tokens
    core._in_flight = [job]
    core._lm_done(req, seg)  # 40 tokens: a second chunk would need 78, so the final pass is next
    assert released == []  # its first chunk is still on the worker: the slot is in use
    core._chunks_done([job], [(np.zeros(4, np.float32), 0.0, 0.0)], None, time.perf_counter())
    assert released == [seg.t2w]

    # not while another chunk is due first, nor in "chunk" mode (the final chunk reads the slot's keys)
    for tokens, mode in ((list(range(90)), "full"), (list(range(40)), "chunk")):
        core.t2w.final_attention = mode
        req = _request(core, f"b{len(tokens)}{mode}", buffered_s=None, lm=LMStatus.decoding, slot=1)
        seg = req.audio_segment
        seg.tokens = tokens
        seg.planner.next_plan(len(tokens), done=False)
        released.clear()
        core._lm_done(req, seg)
        assert released == []


def test_a_client_about_to_run_dry_asks_due_final_passes_to_pause_a_first_chunk_does_not():
    core = _core()
    core._chunks = worker = _FakeWorker()
    ending = _request(core, "ending", buffered_s=3.0, lm=LMStatus.done, slot=0)
    core._in_flight = [_Job(ending, ending.audio_segment, plan=SimpleNamespace(is_final=True), due=True)]
    _ready_first_chunk(core, "new", slot=1)
    core._maybe_preempt()
    assert worker.preempt.is_set() and not worker.dry.is_set()
    _with_tokens(_request(core, "dry", buffered_s=0.1, lm=LMStatus.decoding, slot=2), 200)  # its next chunk is ready
    core._maybe_preempt()
    assert worker.preempt.is_set() and worker.dry.is_set()


def test_decode_steps_are_timed_by_what_the_worker_runs_beside_them():
    core = _core()
    first = _request(core, "first", buffered_s=None, lm=LMStatus.decoding, slot=0)
    ending = _request(core, "ending", buffered_s=3.0, lm=LMStatus.done, slot=1)
    final = _Job(ending, ending.audio_segment, plan=SimpleNamespace(is_final=True))
    later = _Job(ending, ending.audio_segment, plan=SimpleNamespace(is_final=False))
    assert phase_kind([_Job(first, first.audio_segment, plan=SimpleNamespace(is_final=False), first=True), later]) \
        == "first"
    assert [phase_kind(p) for p in ([final], [later, final], [_Job(first, first.audio_segment, plan=None)])] == \
        ["final", "chunks", "open"]
    core._chunks = worker = _FakeWorker()
    worker.running = "final"
    core._time_step(10.000)
    core._time_step(10.002)  # no batch out: the worker is idle whatever it last ran
    core._in_flight = [final]
    core._parts_since_read = {"gpu": 0.001}
    core._time_step(10.007)  # a fast step: where its time went is not kept
    core._parts_since_read = {"gpu": 0.004, "admit": 0.026}
    core._time_step(10.037)  # a slow step
    core._time_step(10.200, ahead=False)  # decoding had stopped: a pause, not a step
    assert core.step_beside == {"idle": (pytest.approx(0.002), 1), "final": (pytest.approx(0.035), 2)}
    assert core.slow_steps_beside == {"final": (pytest.approx(0.030), 1)}
    assert core.slow_step_parts == {"gpu": pytest.approx(0.004), "admit": pytest.approx(0.026)}
    core.t2w.watch = SimpleNamespace(stats=dict)
    stats = {k: v for k, v in core.stats().items() if k.startswith("decode_")}
    assert stats == {"decode_step_seconds_beside_idle": pytest.approx(0.002), "decode_steps_beside_idle": 1.0,
                     "decode_step_seconds_beside_final": pytest.approx(0.035), "decode_steps_beside_final": 2.0,
                     "decode_slow_step_seconds_beside_final": pytest.approx(0.030),
                     "decode_slow_steps_beside_final": 1.0, "decode_slow_step_seconds_in_gpu": pytest.approx(0.004),
                     "decode_slow_step_seconds_in_admit": pytest.approx(0.026)}


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: what the engine's test for one sees."""

    @property
    def is_cuda(self) -> bool:
        return True


def test_only_messages_holding_cuda_tensors_wait_for_the_default_stream():
    """The engine thread orders its stream after the sender's default stream only for tensors the sender
    may have queued work for; the frontend's CPU inputs skip that wait (≈ 18 ms beside final passes)."""
    inputs = random_voice_inputs()
    cpu_req = RequestState(request_id="cpu", segments=[Segment(inputs=inputs, planner=None, min_len=0, max_len=9)],
                           sampling=None, emit=lambda _: None, voice_cache={"mel": torch.zeros(2)})
    assert not _holds_cuda_tensors(_Message("add", cpu_req))
    on_cuda = replace(inputs, prompt_mel=torch.zeros(4, 80).as_subclass(_OnCuda))
    cuda_req = RequestState(request_id="gpu", segments=[Segment(inputs=on_cuda, planner=None, min_len=0, max_len=9)],
                            sampling=None, emit=lambda _: None)
    assert _holds_cuda_tensors(_Message("add", cuda_req))
    cached = replace(cpu_req, voice_cache={"mel": torch.zeros(2).as_subclass(_OnCuda)})
    assert _holds_cuda_tensors(_Message("add", cached))
    assert _holds_cuda_tensors(_Message("call", (print, ([1, {"x": torch.zeros(1).as_subclass(_OnCuda)}],), None, {})))
    assert not _holds_cuda_tensors(_Message("call", (print, (inputs, "voice"), None, {})))
    assert not _holds_cuda_tensors(_Message("chunks_done", ([], [], None, 0.0, 0.0, True, [])))


def random_voice_inputs() -> ModelInputs:
    return ModelInputs(mode="zero_shot", text_ids=torch.zeros(3, dtype=torch.int32), xvector=torch.randn(192),
                       flow_prompt_speech_tokens=torch.zeros(10, dtype=torch.int32), prompt_mel=torch.zeros(20, 80),
                       source_speech_tokens=torch.zeros(0, dtype=torch.int32))


def test_laps_tile_the_engine_thread_s_time_between_two_reads():
    """Each lap takes the time since the one before: a handler's inner laps and its own never overlap."""
    core = _core()
    core._lap_mark = 10.0
    core._lap("inbox", now=10.5)
    core._lap("message_chunks_done", now=10.75)  # the handler's work before the deferred calls
    core._lap("after_batch", now=11.0)
    core._lap("message_chunks_done", now=11.125)  # ... and after them
    assert core._parts_since_read == {"inbox": 0.5, "message_chunks_done": 0.375, "after_batch": 0.25}
    assert core._lap_mark == 11.125


def test_the_idle_engine_wakes_when_a_client_waiting_behind_the_worker_is_about_to_run_dry():
    """With no LM row decoding, the engine thread blocks until the worker's batch comes back; a client whose
    ready chunk waits behind that batch runs dry meanwhile unless the engine wakes in time to preempt."""
    core = _core(slack=0.6)  # dry: less than 0.3 s left
    core._chunks = worker = _FakeWorker()
    ending = _request(core, "ending", buffered_s=5.0, lm=LMStatus.done, slot=0)
    core._in_flight = [_Job(ending, ending.audio_segment, plan=SimpleNamespace(is_final=True))]
    assert core._wake_after_s(time.perf_counter()) is None  # nothing else waits: block until the batch is back
    playing = _request(core, "playing", buffered_s=0.35, lm=LMStatus.done, slot=1)
    assert not core._busy()
    assert core._wake_after_s(time.perf_counter()) == pytest.approx(0.05, abs=0.01)
    t0 = time.perf_counter()
    drained = threading.Thread(target=core._drain, daemon=True)  # no message comes: it must return by itself
    drained.start()
    drained.join(timeout=2.0)
    assert not drained.is_alive() and time.perf_counter() - t0 > 0.03  # at the deadline, not before
    core._maybe_preempt()
    assert worker.dry.is_set() and worker.preempt.is_set()
    assert core._wake_after_s(time.perf_counter()) is None  # asked already: block until the worker answers
    worker.dry.clear()
    playing.times.audio_s -= 1.0  # already past dry and not taken (no waking every millisecond for it)
    assert core._wake_after_s(time.perf_counter()) is None


def _later_with_tokens(core: EngineCore, name: str, buffered_s: float, slot: int, chunks_done: int = 1
                       ) -> RequestState:
    """A decoding request whose next (later, not final) chunk is ready: `chunks_done` chunks voiced."""
    req = _request(core, name, buffered_s=buffered_s, lm=LMStatus.decoding, slot=slot)
    seg = req.audio_segment
    for _ in range(chunks_done):
        seg.tokens = [0] * seg.planner.tokens_needed()
        seg.planner.next_plan(len(seg.tokens), False)
    seg.tokens = [0] * seg.planner.tokens_needed()
    return req


def _first_with_tokens(core: EngineCore, name: str, slot: int) -> RequestState:
    req = _request(core, name, buffered_s=None, lm=LMStatus.decoding, slot=slot)
    req.audio_segment.tokens = [0] * req.audio_segment.planner.tokens_needed()
    return req


def test_later_chunks_with_audio_to_spare_stay_out_of_a_first_chunks_batch():
    core = _core()
    core.later_chunk_hold_s = 1.5
    new = _first_with_tokens(core, "new", slot=0)
    rich = _later_with_tokens(core, "rich", buffered_s=3.0, slot=1)
    poor = _later_with_tokens(core, "poor", buffered_s=1.0, slot=2)
    _request(core, "other", buffered_s=5.0, lm=LMStatus.decoding, slot=3)  # could join a later batch
    now = time.perf_counter()
    ready = _ready(new, rich, poor)
    assert [r.request_id for r, _ in core._without_early_later_chunks(ready, now)] == ["new", "poor"]
    assert core._without_early_later_chunks(ready, now, due={id(rich)}) == ready  # a due chunk goes
    core.later_chunk_hold_s = 0.0  # off: the batch takes every ready chunk
    assert core._without_early_later_chunks(ready, now) == ready
    core.later_chunk_hold_s = 0.3  # below chunk_slack_s (0.6) it holds what chunk_slack_s would
    assert [r.request_id for r, _ in core._without_early_later_chunks(_ready(new, rich), now)] == ["new"]


def test_a_held_back_later_chunk_rides_along_when_it_shares_a_first_chunks_ode():
    core = _core()
    core.later_chunk_hold_s = 1.5
    new = _first_with_tokens(core, "new", slot=0)
    second = _later_with_tokens(core, "second", buffered_s=3.0, slot=1, chunks_done=1)
    third = _later_with_tokens(core, "third", buffered_s=3.0, slot=2, chunks_done=2)
    _request(core, "other", buffered_s=5.0, lm=LMStatus.decoding, slot=3)
    now = time.perf_counter()
    # the planner's own arithmetic as the ODE key: a first chunk adds 25 tokens, a second 50, a third 100
    core.t2w.flow_group = lambda state, plan: plan.num_new
    kept = core._without_early_later_chunks(_ready(new, second, third), now)
    assert [r.request_id for r, _ in kept] == ["new"]
    core.t2w.flow_group = lambda state, plan: plan.num_new if plan.index == 0 else 25 * plan.index
    kept = core._without_early_later_chunks(_ready(new, second, third), now)
    assert [r.request_id for r, _ in kept] == ["new", "second"]  # its call has the first chunk's shape
    assert second.audio_segment.planner.index == 1 and new.audio_segment.planner.index == 0  # only peeked


def test_later_chunks_are_not_held_when_no_more_chunks_can_join_them():
    core = _core()
    core.later_chunk_hold_s = 1.5
    rich = _later_with_tokens(core, "rich", buffered_s=3.0, slot=0)
    poor = _later_with_tokens(core, "poor", buffered_s=0.2, slot=1)
    now = time.perf_counter()
    ready = _ready(rich, poor)
    assert core._without_early_later_chunks(ready, now) == ready  # every stream is in the batch already
    _request(core, "other", buffered_s=5.0, lm=LMStatus.decoding, slot=2)
    assert core._without_early_later_chunks(ready, now) == [(poor, poor.audio_segment)]
    for req in core.requests.values():
        req.audio_segment.lm_status = LMStatus.done  # no more tokens are coming: nothing to wait for
    core.slot_owner.clear()
    assert core._without_early_later_chunks(ready, now) == ready
