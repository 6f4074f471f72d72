"""Admission's prediction (Scheduler.admit): the engine's near future simulated from a published view.

Each stream's next chunk becomes a `WorkJob` that can start once its tokens are there (after the decode
steps it still misses, or after its wait for an LM row, its prefill and its first chunk's steps) and, for
a stream still to open, a flow slot; LM rows and flow slots come back when their holders' LM is
predicted done (`_LMRows`, `_FlowSlots`). A stream whose opening builds a new voice's prompt state adds
a prompt pass (a `WorkJob` of kind "prompt", keyed `PromptPass`), and a newcomer that brings a recording
starts its LM only once the recording is analysed (`Newcomer.analysed_s`). `simulate_worker` then runs
those jobs through the token-to-wave worker as the scheduler has it batch them. Pure functions of the
view and the cost models.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cosystream.engine.costs import CostModel
    from cosystream.engine.scheduler import EngineView, StreamView


def batch_end(view: EngineView, now: float) -> float:
    """When the worker's current batch is predicted done (now when it runs none)."""
    worker = view.worker
    if worker is None or not worker.busy:
        return now
    return max(now, worker.started_s + worker.predicted_s)


def worker_state(view: EngineView, now: float) -> tuple[float, list[WorkJob]]:
    """When the worker can take a new batch, and what is left of its current one: it is free for urgent
    chunks once its running phase ends; its unstarted phases go on after them (one job of their cost)."""
    worker = view.worker
    if worker is None or not worker.busy:
        return now, []
    end = batch_end(view, now)
    phase_end = end if worker.phase_end_s is None else min(end, max(now, worker.phase_end_s))
    rest = end - phase_end
    return phase_end, ([WorkJob(phase_end, -math.inf, "batch", None, rest)] if rest > 0 else [])


@dataclass(frozen=True, slots=True)
class Newcomer:
    """A stream not in the view (admitted since it was made, or the one admission decides on)."""

    key: str
    tokens: int  # its first chunk's tokens
    deadline_s: float
    analysed_s: float = -math.inf  # when its recording is analysed, so its LM can start (-inf: nothing to wait)
    prompt_pass: bool = False  # opening its stream runs the flow over a new prompt


@dataclass(frozen=True, slots=True)
class PromptPass:
    """The key of a stream's prompt pass in the simulation (the stream's own key is its chunk's)."""

    key: Hashable


def _needs_pass(s: StreamView) -> bool:
    """Does opening this stream still build a new voice's prompt state (not on the worker yet)?"""
    return not s.voice_at_hand and not s.opened and not s.planned


def next_chunks(view: EngineView, now: float, cost: CostModel, step_s: float,
                newcomers: Sequence[Newcomer] = ()) -> list[WorkJob]:
    """Every stream's next chunk not yet on the worker, with when it can start: its tokens (now, after the
    decode steps still missing, or after its wait for an LM row, prefill and first chunk's steps) and, for
    a stream to open, a flow slot. `newcomers`: streams not in the view, behind its streams in line for an
    LM row, each from when its recording is analysed. A stream that builds a new voice's prompt state also
    has a prompt pass: ready once its LM decodes with open-ahead (the worker runs it ahead of the first
    chunk), else with its first chunk (in whose batch it runs)."""
    pending = sorted((s for s in view.streams if s.first and s.lm_pending and not s.planned),
                     key=lambda s: s.arrival_s)
    rows = _LMRows(view, now, cost, ahead=view.lm_waiting - len(pending))
    lm_ready = {id(s): rows.next() + cost.prefill_s() + s.missing_tokens * step_s for s in pending}
    entries: list[tuple[float, WorkJob, bool]] = []  # (tokens ready at, job, needs a flow slot)
    passes: list[WorkJob] = []
    slots = _FlowSlots(view, now, cost)
    for s in view.streams:
        if s.planned:
            if not s.opened and s.needs_slot:
                slots.take(now)  # on the worker, opening its stream: a free slot is its
            continue
        if id(s) in lm_ready:
            tokens_at = lm_ready[id(s)]
        elif s.ready or s.final_waits or (s.first and s.missing_tokens == 0):  # (a first: maybe no slot yet)
            tokens_at = now
        elif s.decoding_audio and s.missing_tokens > 0:
            tokens_at = now + s.missing_tokens * step_s
        else:
            continue
        kind = "first" if s.first else "final" if s.next_final else "chunks"
        entries.append((tokens_at, WorkJob(tokens_at, s.deadline_s, kind, StreamKey(s.key)),
                        s.needs_slot and not s.opened))
        if _needs_pass(s):  # ahead from when its LM decodes (now, or once it has a row and its prefill)
            decoding = tokens_at - s.missing_tokens * step_s if id(s) in lm_ready else now
            passes.append(WorkJob(decoding if view.open_ahead else tokens_at, s.deadline_s, "prompt",
                                  PromptPass(StreamKey(s.key))))
    for new in newcomers:
        decoding = max(rows.next(), new.analysed_s) + cost.prefill_s()
        tokens_at = decoding + new.tokens * step_s
        entries.append((tokens_at, WorkJob(tokens_at, new.deadline_s, "first", new.key),
                        view.free_flow_slots is not None))
        if new.prompt_pass:
            passes.append(WorkJob(decoding if view.open_ahead else tokens_at, new.deadline_s, "prompt",
                                  PromptPass(new.key)))
    jobs = list(passes)
    for tokens_at, job, needs_slot in sorted(entries, key=lambda e: (e[0], e[1].deadline_s)):
        if needs_slot:
            job.ready_s = slots.take(tokens_at)
        jobs.append(job)
    return jobs


@dataclass(slots=True)
class WorkJob:
    """A piece of the worker's work in `simulate_worker`: a chunk, or the rest of the batch it runs now."""

    ready_s: float  # when it can start (tokens and flow slot there)
    deadline_s: float
    kind: str  # "first", "chunks", "final" (a phase of its own kind), "prompt" (a stream's prompt pass),
    #            "batch": the worker's current batch
    key: Hashable
    cost_s: float = 0.0  # "batch" only: its predicted seconds


@dataclass(frozen=True, slots=True)
class StreamKey:
    """A running stream's key in the simulation (newcomers have plain string keys)."""

    key: Hashable


class _LMRows:
    """When the next stream in line gets an LM row: at once while rows are free, then as their holders give
    them back, each when its LM is predicted done (CostModel.lm_left_s; rows the view does not date: one by
    one over the measured row hold); a stream that takes a row holds it for that hold. No hold measured yet
    and no free row: never (inf). `ahead`: segments in line first (later segments of running requests,
    which the view does not list as new streams)."""

    def __init__(self, view: EngineView, now: float, cost: CostModel, ahead: int = 0) -> None:
        self.now, self.hold = now, cost.lm_hold_s()
        free = max(0, view.free_lm_slots)
        holders = [s for s in view.streams if s.row_since_s is not None]
        ends = [end for s in holders if (end := cost.lm_left_s(s, now)) is not None]
        undated = max(0, view.lm_slots - free - len(ends))
        held = ends + ([] if self.hold is None else [now + self.hold * (j + 1) / undated for j in range(undated)])
        self.heap = [now] * free + held
        heapq.heapify(self.heap)
        for _ in range(max(0, ahead)):
            self.next()

    def next(self) -> float:
        if not self.heap:
            return math.inf
        start = heapq.heappop(self.heap)
        if self.hold is not None:
            heapq.heappush(self.heap, start + self.hold)
        return start


class _FlowSlots:
    """The flow-slot pool over time: a stream that takes a slot holds it for the measured slot hold from
    when it starts; one held now comes back as `_back_at` predicts; one given back while the worker's batch
    runs comes back when the batch's running phase ends (when the whole batch ends if it holds due final
    passes); one the view does not account for (lent to the batch itself, e.g. to a stream it opens) never.
    No pool: every stream opens at once. No hold measured yet and no free slot: never (inf)."""

    def __init__(self, view: EngineView, now: float, cost: CostModel) -> None:
        self.pooled = view.free_flow_slots is not None
        self.hold = cost.slot_hold_s()
        free = view.free_flow_slots or 0
        holders = [s for s in view.streams if s.slot_since_s is not None]
        ends = [math.inf if (end := self._back_at(s, now, cost)) is None else end for s in holders]
        # slots given back while the worker's batch runs: the pool takes them back when it stops, which a first
        # chunk waiting for one makes it do after its running phase unless it holds due final passes
        # (Scheduler.preempt)
        returning = min(view.slots_after_batch, max(0, (view.flow_slots or 0) - free - len(holders)))
        runs_on = view.worker is not None and view.worker.due_finals
        back = batch_end(view, now) if runs_on else worker_state(view, now)[0]
        self.heap = [now] * free + ends + [back] * returning
        heapq.heapify(self.heap)

    def _back_at(self, holder: StreamView, now: float, cost: CostModel) -> float | None:
        """A held slot comes back the measured slot tail after its stream's LM is done (its last chunks and
        the wait for the worker; CostModel.slot_tail_s), the LM's end predicted while it decodes; else the
        measured hold after it was taken."""
        tail = cost.slot_tail_s()
        if holder.lm_done:
            return max(now, (now if holder.lm_done_s is None else holder.lm_done_s) + tail)
        if holder.row_since_s is not None and (end := cost.lm_left_s(holder, now)) is not None:
            return end + tail
        return None if self.hold is None or holder.slot_since_s is None else max(now, holder.slot_since_s + self.hold)

    def take(self, wanted_s: float) -> float:
        """When a stream that wants a slot from `wanted_s` on starts in one (and takes it)."""
        if not self.pooled:
            return wanted_s
        if not self.heap:
            return math.inf
        start = max(wanted_s, heapq.heappop(self.heap))
        if self.hold is not None:
            heapq.heappush(self.heap, start + self.hold)
        return start


def simulate_worker(jobs: Sequence[WorkJob], free_at: float, cost: CostModel, max_batch: int, dry_s: float,
                    final_phase_streams: int, passes_s: Callable[[int], float] | None = None) -> dict:
    """Finish time of each job's phase (by key) on a worker that runs as the scheduler has it run: when free,
    it takes every job ready (at most `max_batch`, by class, then deadline) as one batch, voiced in phases:
    clients about to run dry (a later chunk whose deadline is within dry_s when the batch forms), first
    chunks, the rest of an earlier batch, later chunks, official final passes (final_phase_streams a phase);
    each phase costs the cost model's fixed + per-chunk seconds for its size. Prompt passes are work of the
    first chunks' class: those of streams whose first chunk is in the batch run in that chunk's phase, the
    others in one phase after the first chunks; `passes_s(n)`: seconds of n passes (None: free). A first
    chunk or prompt pass that becomes ready, or a client that comes within dry_s of running dry, while a
    batch runs preempts it after the running phase: the batch's unstarted jobs always go in the next batch
    (Scheduler.plan), whose new jobs fill what is left of max_batch. The rest of the worker's current batch
    runs on the same way."""
    pending = sorted(jobs, key=lambda j: j.ready_s)
    queue: list[WorkJob] = []
    returned = [job for job in pending if job.kind == "batch"]
    pending = [job for job in pending if job.kind != "batch"]
    out: dict = {}
    t, i = free_at, 0

    def release(until: float) -> None:
        nonlocal i
        while i < len(pending) and pending[i].ready_s <= until:
            queue.append(pending[i])
            i += 1

    def preempted(since: float, now: float) -> bool:
        """Did a chunk turn urgent (ready, or within dry_s of its deadline) after `since`, by `now`?"""
        release(now)
        return any(job.ready_s > since if job.kind in ("first", "prompt") else
                   job.deadline_s - now < dry_s and (job.ready_s > since or job.deadline_s - since >= dry_s)
                   for job in queue)

    if returned and not preempted(-math.inf, t):
        t += sum(job.cost_s for job in returned)
        returned = []
    while i < len(pending) or queue or returned:
        release(t)
        if not queue and not returned:
            if math.isinf(pending[i].ready_s):
                for job in pending[i:]:
                    out[job.key] = math.inf
                break
            t = pending[i].ready_s
            continue
        queue.sort(key=lambda j: (_class_at(j, t, dry_s), j.deadline_s))
        room = max(0, max_batch - len(returned))
        batch, queue[:], returned = returned + queue[:room], queue[room:], []
        phases = _sim_phases(batch, t, dry_s, final_phase_streams)
        start = t
        for k, phase in enumerate(phases):
            t += _phase_cost(phase, cost, passes_s)
            for job in phase:
                out[job.key] = t
            if k + 1 < len(phases) and preempted(start, t):  # the rest goes in the next batch
                returned = [job for rest in phases[k + 1:] for job in rest]
                break
    return out


def _class_at(job: WorkJob, t: float, dry_s: float) -> int:
    """-1: a client about to run dry at t, 0: a first chunk or a prompt pass, 1: the rest."""
    if job.kind in ("first", "prompt"):
        return 0
    return -1 if job.kind != "batch" and job.deadline_s - t < dry_s else 1


def _phase_cost(phase: Sequence[WorkJob], cost: CostModel, passes_s: Callable[[int], float] | None) -> float:
    if phase[0].kind == "batch":
        return phase[0].cost_s
    voiced = [job for job in phase if job.kind != "prompt"]
    passes = len(phase) - len(voiced)
    seconds = passes_s(passes) if passes and passes_s is not None else 0.0
    if voiced:
        kinds = {job.kind for job in voiced}
        kind = "first" if "first" in kinds else "final" if kinds == {"final"} else "chunks"
        seconds += cost.phase_s(kind, len(voiced))
    return seconds


def _sim_phases(batch: Sequence[WorkJob], t: float, dry_s: float, final_phase_streams: int) -> list[list[WorkJob]]:
    """A batch formed at t in the worker's phase order (Scheduler.phases): dry clients, first chunks (with the
    prompt passes of their streams), other prompt passes, what is left of the batch they preempted (or that
    runs on), later chunks, final passes in phases of final_phase_streams."""
    classes = [(_class_at(j, t, dry_s), j) for j in batch]
    dry = [j for c, j in classes if c < 0]
    firsts = [j for c, j in classes if c == 0 and j.kind == "first"]
    in_line = {j.key for j in firsts}
    passes = [j for j in batch if j.kind == "prompt"]
    with_chunk = [j for j in passes if j.key.key in in_line]  # opened by its first chunk, in its phase
    ahead = [j for j in passes if j.key.key not in in_line]
    rest = [[j] for j in batch if j.kind == "batch"]
    later = [j for c, j in classes if c > 0 and j.kind == "chunks"]
    finals = [j for c, j in classes if c > 0 and j.kind == "final"]
    phases = [phase for phase in (dry, with_chunk + firsts, ahead) if phase] + rest + ([later] if later else [])
    return phases + [finals[i:i + final_phase_streams] for i in range(0, len(finals), final_phase_streams)]
