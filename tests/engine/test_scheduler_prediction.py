"""Admission's first-audio prediction against an independent simulation of the engine's token-to-wave worker.

The reference below is written from the worker's documented behaviour, not from the scheduler's code: it
follows the worker from one phase's end to the next; an idle worker takes every chunk that is ready as one
batch (at most max_batch: clients about to run dry, then first chunks, then the rest, each earliest deadline
first), voices it in phases (dry clients, first chunks, what is left of a preempted batch, later chunks,
official final passes sixteen at a time), each phase costing the "GPU's" true fixed + per-chunk seconds; a
first chunk or a dry client that became ready while a batch ran stops it after the running phase, and the
jobs it did not start go in the next batch. The scheduler's cost model only sees phases this GPU ran (sizes
1, 4, 16), so these tests also check that it recovers the fixed and per-chunk costs.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from cosystream.engine import scheduler as sched
from cosystream.engine.scheduler import CostModel, EngineView, Scheduler, StreamView, WorkerView

NOW = 50.0
STEP_S = 0.002  # decode step
PREFILL_S = 0.006
FIRST_TOKENS = 28  # the newcomer's first chunk: first hop + look-ahead
# the GPU's true phase costs: (fixed per call, per chunk) seconds; one official final pass alone
TRUE_LINES = {"first": (0.021, 0.0036), "chunks": (0.014, 0.0021)}
FINAL_PASS_S = 0.017


def _true_phase_s(kind: str, n: int) -> float:
    if kind == "final":
        return FINAL_PASS_S * n
    fixed, per = TRUE_LINES[kind]
    return fixed + per * n


def _cost_measured_on_this_gpu() -> CostModel:
    cost = CostModel()
    cost.observe_step(STEP_S)
    cost.observe_prefill(PREFILL_S)
    for n in (1, 4, 16, 1, 16, 4):
        for kind in ("first", "chunks"):
            cost.observe_phase(kind, n, _true_phase_s(kind, n))
    cost.observe_phase("final", 16, _true_phase_s("final", 16))
    return cost


# ------------------------------------------------------------------ the independent reference
@dataclass
class Chunk:
    key: str
    ready: float  # seconds from NOW when it can start
    first: bool
    final: bool
    deadline: float  # seconds from NOW

    def urgent_class(self, t: float) -> int:
        """At time t: 0 a first chunk, -1 a client about to run dry, 1 the rest."""
        if self.first:
            return 0
        return -1 if self.deadline - t < sched.DRY_S else 1

    def turned_urgent(self, since: float, now: float) -> bool:
        """Ready by `now`, and urgent then but not yet when `since` came (a batch started)?"""
        if self.ready > now:
            return False
        if self.first:
            return self.ready > since
        return self.urgent_class(now) < 0 and (self.ready > since or self.urgent_class(since) > 0)


def reference_finish(chunks: list[Chunk], busy_until: float | None, rest_s: float, max_batch: int) -> dict:
    """Seconds from NOW at which each chunk's audio is out, following the worker through its phases."""
    waiting = list(chunks)
    out: dict = {}
    # the batch on the worker now: its running phase ends at busy_until; `rest_s` of unstarted phases follow
    phases: list[tuple[str, list[Chunk], float]] = []  # (what, chunks, seconds) still to run after the current one
    current: tuple[list[Chunk], float] | None = None  # (chunks, end) of the running phase
    batch_start = -math.inf  # chunks ready now became ready while the batch on the worker runs
    if busy_until is not None:
        current = ([], busy_until)
        if rest_s > 0:
            phases = [("rest", [], rest_s)]
    t = 0.0
    horizon = 30.0
    while t < horizon and (waiting or current or phases):
        if current is not None and t >= current[1] - 1e-12:
            end = current[1]
            for c in current[0]:
                out[c.key] = end
            current = None
            preempt = any(c.turned_urgent(batch_start, end) for c in waiting)
            if phases and preempt:  # unstarted phases go back and always go in the next batch, whose new
                # chunks fill what is left of max_batch; the rest of the batch on the worker stays one piece
                rest = [p for p in phases if p[0] == "rest"]
                back = [c for p in phases if p[0] != "rest" for c in p[1]]
                new = _take_batch(waiting, end, max(0, max_batch - len(back) - len(rest)))
                phases = _phases_of(back + new, rest, end)
                batch_start = end
            if phases:
                what, members, seconds = phases.pop(0)
                current = (members, end + seconds)
                continue
        if current is None and not phases:
            batch = _take_batch(waiting, t, max_batch)
            if batch:
                phases = _phases_of(batch, [], t)
                batch_start = t
                what, members, seconds = phases.pop(0)
                current = (members, t + seconds)
                continue
            # idle: on to the moment the next chunk can start
            t = min((c.ready for c in waiting), default=horizon)
            continue
        assert current is not None
        t = current[1]  # busy: on to the end of the running phase
    for c in waiting:
        out.setdefault(c.key, math.inf)
    return out


def _take_batch(waiting: list[Chunk], t: float, max_batch: int) -> list[Chunk]:
    ready = sorted((c for c in waiting if c.ready <= t + 1e-12), key=lambda c: (c.urgent_class(t), c.deadline))
    batch = ready[:max_batch]
    for c in batch:
        waiting.remove(c)
    return batch


def _phases_of(batch: list[Chunk], rest: list, t: float) -> list[tuple[str, list[Chunk], float]]:
    dry = [c for c in batch if c.urgent_class(t) < 0]
    firsts = [c for c in batch if c.urgent_class(t) == 0]
    later = [c for c in batch if c.urgent_class(t) > 0 and not c.final]
    finals = [c for c in batch if c.urgent_class(t) > 0 and c.final]
    out = []
    if dry:
        out.append(("dry", dry, _true_phase_s("final" if all(c.final for c in dry) else "chunks", len(dry))))
    if firsts:
        out.append(("first", firsts, _true_phase_s("first", len(firsts))))
    out += rest
    if later:
        out.append(("chunks", later, _true_phase_s("chunks", len(later))))
    for i in range(0, len(finals), sched.FINAL_PHASE_STREAMS):
        part = finals[i:i + sched.FINAL_PHASE_STREAMS]
        out.append(("final", part, _true_phase_s("final", len(part))))
    return out


# ------------------------------------------------------------------ scenarios
def _scenario(rng: random.Random, target_s: float) -> tuple[list[StreamView], list[Chunk], int, float | None, float]:
    """Random engine state: first chunks decoding or ready, streams still waiting for their prefill, later
    chunks with audio to spare or about to run dry, official final passes waiting; the same as views (for
    the scheduler) and as chunks with their start times (for the reference)."""
    views: list[StreamView] = []
    chunks: list[Chunk] = []
    for i in range(rng.randint(0, 16)):  # new streams decoding their first chunk (or with it ready)
        arrival = NOW - rng.uniform(0.0, 0.3)
        missing = rng.choice([0, 0, rng.randint(1, FIRST_TOKENS)])
        views.append(StreamView(key=f"f{i}", arrival_s=arrival, first=True, deadline_s=arrival + target_s,
                                ready=missing == 0, missing_tokens=missing, decoding_audio=missing > 0,
                                lm_decoding=missing > 0, opened=True))
        chunks.append(Chunk(f"f{i}", missing * STEP_S, True, False, arrival + target_s - NOW))
    for i in range(rng.randint(0, 4)):  # admitted, waiting for their prefill (free LM rows)
        arrival = NOW - rng.uniform(0.0, 0.05)
        views.append(StreamView(key=f"p{i}", arrival_s=arrival, first=True, deadline_s=arrival + target_s,
                                missing_tokens=FIRST_TOKENS, lm_pending=True, opened=True))
        chunks.append(Chunk(f"p{i}", PREFILL_S + FIRST_TOKENS * STEP_S, True, False, arrival + target_s - NOW))
    for i in range(rng.randint(0, 40)):  # later chunks: ready, or decoding their hop
        left = rng.uniform(0.05, 2.0)
        missing = rng.choice([0, 0, rng.randint(1, 60)])
        views.append(StreamView(key=f"l{i}", arrival_s=NOW - 5, first=False, deadline_s=NOW + left,
                                ready=missing == 0, missing_tokens=missing, decoding_audio=missing > 0,
                                lm_decoding=missing > 0, opened=True))
        chunks.append(Chunk(f"l{i}", missing * STEP_S, False, False, left))
    for i in range(rng.randint(0, 20)):  # official final passes waiting (LM done)
        left = rng.uniform(0.2, 6.0)
        views.append(StreamView(key=f"z{i}", arrival_s=NOW - 8, first=False, deadline_s=NOW + left,
                                next_final=True, final_waits=True, lm_done=True, opened=True))
        chunks.append(Chunk(f"z{i}", 0.0, False, True, left))
    pending_new = rng.randint(0, 4)
    busy_until = rng.choice([None, rng.uniform(0.0, 0.08)])
    rest_s = 0.0 if busy_until is None else rng.choice([0.0, rng.uniform(0.0, 0.2)])
    return views, chunks, pending_new, busy_until, rest_s


def _view(views: list[StreamView], busy_until: float | None, rest_s: float, max_batch: int) -> EngineView:
    worker = WorkerView()
    if busy_until is not None:
        worker = WorkerView(busy=True, started_s=NOW, predicted_s=busy_until + rest_s, phase_end_s=NOW + busy_until)
    return EngineView(now=NOW, streams=views, lm_decoding=True, max_batch=max_batch, worker=worker,
                      free_lm_slots=64, lm_slots=64, lm_waiting=sum(v.lm_pending for v in views))


def _newcomers(pending_new: int, target_s: float) -> list[Chunk]:
    ready = PREFILL_S + FIRST_TOKENS * STEP_S
    return [Chunk(f"n{i}", ready, True, False, target_s) for i in range(pending_new)] + [
        Chunk("new", ready, True, False, target_s)]


@pytest.mark.parametrize("seed", range(60))
def test_the_predicted_first_audio_is_the_simulated_workers(seed):
    rng = random.Random(seed)
    budget = rng.choice([0.12, 0.2, 0.5])
    max_batch = rng.choice([8, 64])
    views, chunks, pending_new, busy_until, rest_s = _scenario(rng, budget)
    s = Scheduler(_cost_measured_on_this_gpu(), budget_s=budget)
    s.worker_debt_limit_s = math.inf  # the simulation alone (the debt's own tests: test_scheduler.py)
    verdict = s.admit(_view(views, busy_until, rest_s, max_batch), NOW, FIRST_TOKENS, pending_new=pending_new)
    newcomers = _newcomers(pending_new, budget)
    reference = reference_finish(chunks + newcomers, busy_until, rest_s, max_batch)
    assert verdict.predicted_first_audio_s == pytest.approx(reference["new"], abs=1e-9)
    # admitted unless late, or unless it makes a chunk late that would have been in time without it
    without = reference_finish(chunks + newcomers[:-1], busy_until, rest_s, max_batch)
    broken = sum(1 for c in chunks if without[c.key] <= c.deadline < reference[c.key])
    if abs(reference["new"] - budget) < 1e-9:
        return  # on the budget itself: rounding decides, either answer is right
    assert verdict.admitted == (reference["new"] <= budget and broken == 0)
    if reference["new"] <= budget and broken:
        assert f"{broken} running stream" in verdict.reason


def test_a_burst_of_first_chunks_is_one_phase_not_a_queue_of_lone_chunks():
    """Sixteen new streams whose first chunks are all ready: one call of sixteen, not sixteen calls."""
    views = [StreamView(key=f"f{i}", arrival_s=NOW, first=True, deadline_s=NOW + 1, ready=True, opened=True)
             for i in range(16)]
    s = Scheduler(_cost_measured_on_this_gpu(), budget_s=1.0)
    verdict = s.admit(_view(views, None, 0.0, 64), NOW, FIRST_TOKENS)
    chunks = [Chunk(f"f{i}", 0.0, True, False, 1.0) for i in range(16)]
    reference = reference_finish(chunks + _newcomers(0, 1.0), None, 0.0, 64)
    assert verdict.predicted_first_audio_s == pytest.approx(reference["new"], abs=1e-9)
    serial = 17 * _true_phase_s("first", 1)  # what charging each first chunk alone would say
    assert verdict.predicted_first_audio_s < serial / 2


def test_streams_waiting_for_their_prefill_are_ahead_of_the_newcomer():
    """Admitted streams that have no token yet (waiting for an LM row's prefill, or still in the frontend)
    voice their first chunks in the same phase as the newcomer's: it costs them their per-chunk share."""
    s = Scheduler(_cost_measured_on_this_gpu(), budget_s=1.0)
    alone = s.admit(_view([], None, 0.0, 64), NOW, FIRST_TOKENS).predicted_first_audio_s
    waiting = [StreamView(key=f"p{i}", arrival_s=NOW, first=True, deadline_s=NOW + 1, lm_pending=True,
                          missing_tokens=FIRST_TOKENS, opened=True) for i in range(6)]
    behind = s.admit(_view(waiting, None, 0.0, 64), NOW, FIRST_TOKENS, pending_new=3).predicted_first_audio_s
    _, per = TRUE_LINES["first"]
    assert behind - alone == pytest.approx(9 * per, abs=1e-9)


def test_a_newcomer_waits_for_the_flow_slot_its_holders_give_back_after_the_measured_hold():
    cost = _cost_measured_on_this_gpu()
    cost.observe_slot_hold(1.0)
    s = Scheduler(cost, budget_s=0.5)
    # four slots, all held: taken 0.9, 0.5, 0.2 and 0.1 s ago, so back in 0.1, 0.5, 0.8 and 0.9 s
    holders = [StreamView(key=f"h{i}", arrival_s=NOW - 2, first=False, deadline_s=NOW + 3, opened=True,
                          lm_decoding=True, decoding_audio=True, missing_tokens=500, slot_since_s=NOW - ago)
               for i, ago in enumerate((0.9, 0.5, 0.2, 0.1))]
    waiting = StreamView(key="w", arrival_s=NOW - 0.05, first=True, deadline_s=NOW + 0.45, opened=False,
                         needs_slot=True, missing_tokens=0, lm_decoding=True)
    view = EngineView(now=NOW, streams=[*holders, waiting], lm_decoding=True, free_flow_slots=0, flow_slots=4,
                      worker=WorkerView(), free_lm_slots=8, lm_slots=8)
    verdict = s.admit(view, NOW, FIRST_TOKENS)
    # the waiting stream takes the slot back at 0.1 s, the newcomer the one back at 0.5 s
    assert verdict.predicted_first_audio_s == pytest.approx(0.5 + _true_phase_s("first", 1), abs=1e-9)
    assert not verdict.admitted
    # two slots free: the newcomer waits for nothing but its own tokens (the waiting stream's chunk is done)
    free = s.admit(EngineView(now=NOW, streams=[*holders[2:], waiting], lm_decoding=True, free_flow_slots=2,
                              flow_slots=4, worker=WorkerView(), free_lm_slots=8, lm_slots=8), NOW, FIRST_TOKENS)
    assert _true_phase_s("first", 1) < PREFILL_S + FIRST_TOKENS * STEP_S
    assert free.predicted_first_audio_s == pytest.approx(PREFILL_S + FIRST_TOKENS * STEP_S + _true_phase_s("first", 1))


def test_the_cost_model_recovers_the_fixed_and_per_chunk_cost_from_noisy_phases():
    rng = random.Random(0)
    cost = CostModel()
    for _ in range(200):
        n = rng.choice([1, 2, 4, 8, 16, 32])
        cost.observe_phase("first", n, _true_phase_s("first", n) * rng.uniform(0.95, 1.05))
    fixed, per = cost.phase_line("first")
    assert fixed == pytest.approx(TRUE_LINES["first"][0], rel=0.15)
    assert per == pytest.approx(TRUE_LINES["first"][1], rel=0.15)


def test_newcomers_refused_on_the_same_view_are_refused_again_with_a_lower_bound():
    """The earliest first audio only grows with time: a later newcomer on the same view and the same streams
    ahead is refused without a new prediction, and what it is told never exceeds a fresh prediction."""
    cost = _cost_measured_on_this_gpu()
    cost.observe_slot_hold(2.0)
    holders = [StreamView(key=f"h{i}", arrival_s=NOW - 1, first=False, deadline_s=NOW + 3, opened=True,
                          lm_decoding=True, decoding_audio=True, missing_tokens=500, slot_since_s=NOW - 0.5)
               for i in range(4)]
    view = EngineView(now=NOW, streams=holders, lm_decoding=True, free_flow_slots=0, flow_slots=4,
                      worker=WorkerView(), free_lm_slots=8, lm_slots=8)
    s = Scheduler(cost, budget_s=0.5)
    first = s.admit(view, NOW, FIRST_TOKENS)
    assert not first.admitted and first.predicted_first_audio_s == pytest.approx(1.5 + _true_phase_s("first", 1))
    for later in (0.01, 0.2):
        again = s.admit(view, NOW + later, FIRST_TOKENS)
        fresh = Scheduler(cost, budget_s=0.5).admit(view, NOW + later, FIRST_TOKENS)
        assert not again.admitted and not fresh.admitted
        assert again.predicted_first_audio_s <= fresh.predicted_first_audio_s + 1e-9
        assert again.predicted_first_audio_s == pytest.approx(first.predicted_first_audio_s - later)


def test_a_newcomer_waits_for_the_lm_row_its_holders_give_back_after_the_measured_hold():
    """Rows taken together come back together: four rows taken 0.2 s ago, held 3 s each, come back in
    2.8 s, not one every 3 s / 4."""
    cost = _cost_measured_on_this_gpu()
    cost.observe_lm_hold(3.0)
    holders = [StreamView(key=f"h{i}", arrival_s=NOW - 0.3, first=False, deadline_s=NOW + 2, opened=True,
                          lm_decoding=True, decoding_audio=True, missing_tokens=500, row_since_s=NOW - 0.2)
               for i in range(4)]
    view = EngineView(now=NOW, streams=holders, lm_decoding=True, worker=WorkerView(), free_lm_slots=0,
                      lm_slots=4)
    verdict = Scheduler(cost, budget_s=10.0).admit(view, NOW, FIRST_TOKENS, pending_new=1)
    tokens_s = PREFILL_S + FIRST_TOKENS * STEP_S
    # the stream admitted before it takes the first row back, the newcomer the second, both at 2.8 s; their
    # first chunks share one phase
    assert verdict.predicted_first_audio_s == pytest.approx(2.8 + tokens_s + _true_phase_s("first", 2))


def test_rows_and_slots_come_back_when_their_holders_lm_is_predicted_done_at_the_decode_step_now():
    """A holder with 100 of its 250 tokens to go gives its LM row and its flow slot back in 100 steps of the
    decode step measured now (a loaded GPU's slower step stretches the wait); one whose LM is done gives its
    slot back at once."""
    cost = _cost_measured_on_this_gpu()
    cost.observe_lm_hold(0.3)  # measured on a lighter load: not what the wait is predicted from
    cost.observe_slot_hold(0.3)

    def holder(key: str, tokens: int, done: bool = False) -> StreamView:
        return StreamView(key=key, arrival_s=NOW - 1, first=False, deadline_s=NOW + 5, opened=True, lm_done=done,
                          lm_decoding=not done, decoding_audio=not done, missing_tokens=0 if done else 500,
                          row_since_s=None if done else NOW - 0.1, slot_since_s=NOW - 0.1, lm_tokens=tokens,
                          lm_expected_tokens=250)

    rows_full = EngineView(now=NOW, streams=[holder("a", 150), holder("b", 100)], lm_decoding=True,
                           worker=WorkerView(), free_lm_slots=0, lm_slots=2)
    verdict = Scheduler(cost, budget_s=10.0).admit(rows_full, NOW, FIRST_TOKENS)
    tokens_s = PREFILL_S + FIRST_TOKENS * STEP_S
    assert verdict.predicted_first_audio_s == pytest.approx(100 * STEP_S + tokens_s + _true_phase_s("first", 1))
    slots_full = EngineView(now=NOW, streams=[holder("a", 150), holder("c", 250, done=True)], lm_decoding=True,
                            worker=WorkerView(), free_lm_slots=4, lm_slots=6, free_flow_slots=0, flow_slots=2)
    verdict = Scheduler(cost, budget_s=10.0).admit(slots_full, NOW, FIRST_TOKENS)
    assert verdict.predicted_first_audio_s == pytest.approx(tokens_s + _true_phase_s("first", 1))


def test_slots_come_back_the_measured_tail_after_their_holders_lm_is_done():
    """A slot is held after its stream's LM ends (its last chunks wait for the worker, and CosyVoice3's final
    pass reads the slot): measured as the slot tail, it delays the slot's return from the LM's end on, both
    for a holder whose LM ended 0.1 s ago and for one still decoding."""
    cost = _cost_measured_on_this_gpu()
    cost.observe_slot_hold(0.3)
    cost.observe_slot_tail(0.4)
    assert cost.slot_tail_s() == pytest.approx(0.4)
    done = StreamView(key="d", arrival_s=NOW - 2, first=False, deadline_s=NOW + 5, opened=True, lm_done=True,
                      lm_done_s=NOW - 0.1, slot_since_s=NOW - 1.5, lm_tokens=250, lm_expected_tokens=250)
    decoding = StreamView(key="r", arrival_s=NOW - 1, first=False, deadline_s=NOW + 5, opened=True,
                          lm_decoding=True, decoding_audio=True, missing_tokens=500, row_since_s=NOW - 0.5,
                          slot_since_s=NOW - 0.5, lm_tokens=150, lm_expected_tokens=250)
    tokens_s = PREFILL_S + FIRST_TOKENS * STEP_S
    first_s = _true_phase_s("first", 1)

    def predicted(holder: StreamView) -> float:
        view = EngineView(now=NOW, streams=[holder], lm_decoding=True, worker=WorkerView(), free_lm_slots=4,
                          lm_slots=6, free_flow_slots=0, flow_slots=1)
        return Scheduler(cost, budget_s=10.0).admit(view, NOW, FIRST_TOKENS).predicted_first_audio_s

    assert predicted(done) == pytest.approx(max(tokens_s, 0.3) + first_s)
    assert predicted(decoding) == pytest.approx(100 * STEP_S + 0.4 + first_s)
