"""Which ready chunks the engine voices now and when it pauses decoding (EngineCore's batching policy).

The policy's inputs are request state and the clock, so it is checked on hand-made requests; the
audio it produces is checked by the engine tests (test_overlap, test_engine...)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from cosystream.config import ChunkSchedule
from cosystream.engine.chunking import ChunkPlanner
from cosystream.engine.core import EngineCore, _Job
from cosystream.engine.request import LMStatus, RequestState, Segment


class _Pool:
    def __init__(self, free: int | None) -> None:
        self.free = free

    def free_slots(self) -> int | None:
        return self.free


def _core(free_slots: int | None = 4, slack: float = 0.6, first_wait: float = 0.0) -> EngineCore:
    runner = SimpleNamespace(max_slots=8, device=torch.device("cpu"))
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
    now = time.perf_counter()
    assert not core._worth_a_batch(_ready(decoding, ending), now)  # nobody waits for its slot
    _request(core, "waiting", buffered_s=None, lm=LMStatus.decoding, slot=2, has_stream=False)
    assert core._worth_a_batch(_ready(decoding, ending), now)
    assert not core._worth_a_batch(_ready(decoding), now)  # a decoding stream frees no slot soon


def test_many_ready_chunks_or_no_slack_run_at_once():
    core = _core()
    reqs = [_request(core, f"r{i}", buffered_s=5.0, lm=LMStatus.decoding, slot=i % 8) for i in range(16)]
    assert core._worth_a_batch(_ready(*reqs), time.perf_counter())  # a quarter of the largest batch
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
    kept = core._without_costly_finals(_ready(new, ending, middle, dry), now)
    assert [r.request_id for r, _ in kept] == ["new", "middle", "dry"]
    assert len(core._without_costly_finals(_ready(ending, middle), now)) == 2  # no first chunk: all go
    core.t2w.free = 0  # "new" waits for a slot that "ending" frees
    assert len(core._without_costly_finals(_ready(new, ending), now)) == 2
    core.t2w.final_attention = "chunk"  # an incremental final costs what any chunk costs
    core.t2w.free = 2
    assert len(core._without_costly_finals(_ready(new, ending), now)) == 2


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
