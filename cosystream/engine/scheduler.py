"""The engine's scheduling policy: one model of time, one cost model, decisions from both.

Every stream has a playback deadline for its next chunk: a first chunk's is the request's arrival plus
the first-audio target; a later chunk's is the moment the audio its client already has runs out (it
plays from its first chunk on). `CostModel` (engine/costs.py) predicts what the GPU's work takes (decode
step, prefill, LM and flow-slot holds, chunk phases as a fixed cost per call plus a cost per chunk, official
final passes), measured on this device at warm-up and then continuously. Admission's prediction simulates
the engine's near future from a view (engine/prediction.py).

`Scheduler` is pure: it reads an `EngineView` (typed snapshots of every live stream and of the
token-to-wave worker) and returns decisions; it holds no thread, lock, tensor or request. The engine
core builds the views, applies the decisions and feeds the cost model its measurements.

Policy, earliest deadline first within two classes (first chunks of new requests, then everything
else), with the refinements that keep the GPU's batches full:

* a batch opens when a chunk is urgent (a first chunk, a client within `URGENT_S` of its deadline, an
  official final pass that is due, a stream whose end frees a flow slot others wait for); chunks with
  audio to spare wait to share it, since a flow call costs nearly the same for one chunk as for sixteen;
* ready first chunks wait (at most `FIRST_CHUNK_WAIT_S`) while another stream's first chunk is due
  within that wait, so a burst's first chunks share one batch;
* a batch runs in phases: clients about to run dry (`DRY_S`), first chunks, later chunks, official
  final passes (due ones, then those that may pause, at most `FINAL_PHASE_STREAMS` a phase); later
  chunks whose ODE has a first chunk's shape ride along with it (`RIDER_STREAMS` in the call);
* a first chunk (or a client about to run dry) that becomes ready while a batch runs preempts the
  worker after its running phase; phases of final passes pause between Euler steps for it;
* a first chunk that waits only for a flow slot while the running batch has given slots back stops the
  batch after its running phase (the pool takes those slots back when the batch stops, not after all
  its final passes), and a phase of final passes not due pauses between Euler steps for it as for a
  ready first chunk; a batch that holds due ones is not stopped for it: under overload such a chunk is
  always there, and due passes handed back again and again would run late and stall everyone's later
  chunks;
* decode steps pause while a first chunk is on the worker, unless another request still waits for its
  first audio (the two share the GPU);
* official final passes come due earliest deadline first, each costing the measured pass;
* idle, the worker opens the flow streams of requests still decoding their first chunk (open-ahead);
* a new recording's prompt pass (the flow over a voice not at hand, which opening its stream needs) is
  work of the first chunks' class: the prompts due earliest go together in one phase of a batch, right
  after its first chunks and before its later chunks (one batched flow call for the burst), and a busy
  worker is preempted for them after its running phase, so the pass is done while the LM still decodes
  the first chunk's tokens instead of in front of that chunk;
* admission: a new stream is admitted only when the predicted finish of its first chunk is within the
  budget and no running stream that meets its deadline now would miss it with the newcomer's work; a
  newcomer that brings a new recording waits for its analysis behind the recordings queued before it,
  and its prompt pass and those of the streams still to open are worker time (engine/prompt_load.py).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from cosystream.engine.costs import CostModel
from cosystream.engine.prediction import (
    Newcomer,
    PromptPass,
    StreamKey,
    batch_end,
    next_chunks,
    simulate_worker,
    worker_state,
)
from cosystream.engine.prompt_load import PromptBacklog, PromptCosts, analysis_ends

# A later chunk whose client has less audio left than this is urgent: it opens a batch. Long enough for
# one batch of final passes to run ahead of it (a phase of 16 passes is a few hundred ms on an H100).
URGENT_S = 0.6
# ... less than this: its client is about to run dry: it preempts the worker, goes first in its batch
# and pauses even due final passes.
DRY_S = URGENT_S / 2
# A batch opened by an urgent chunk leaves out later (not final) chunks with at least this much audio
# left, unless they ride with a first chunk: they meet other streams' chunks in a fuller, later batch.
HOLD_S = 1.5
# Longest wait of ready first chunks for other first chunks due meanwhile (a burst's share one batch).
FIRST_CHUNK_WAIT_S = 0.05
# An official final pass is due (opens a batch, pauses only for a client about to run dry) when its
# client's audio left, less the cost of the passes due before it, is under this.
FINAL_SLACK_S = 2.0
# Final passes per phase: a chunk that preempts the worker waits for one phase, not for 64 passes.
FINAL_PHASE_STREAMS = 16
# Streams in a first chunks' ODE call once later chunks of the same shape ride along.
RIDER_STREAMS = 16
# New voices' prompt passes in one phase (one batched flow call): a burst's, not one phase each.
PROMPT_PHASE_STREAMS = 16
# First-audio target of a stream's first chunk when admission has no budget (deadlines still order work).
DEFAULT_FIRST_AUDIO_TARGET_S = 1.0
# Worker seconds the admitted streams may owe in work the scheduler puts off behind first chunks (an official
# final pass each, the first chunks still to run, the rest of the running batch), in first-audio budgets.
# Past it the worker cannot catch up: the passes put off come due together and hold every first chunk behind
# them. In budgets, so that a tight budget also keeps the queue short; two budgets: the best of the limits
# measured (docs/benchmarks.md, "Open loop and overload").
WORKER_DEBT_BUDGETS = 2.0
# ... and never more than this unless the budget itself is longer (then one budget): a final pass comes due
# with FINAL_SLACK_S of its client's audio left, and a worker owing more than half that slack reaches the
# passes due too late, so that admitted streams run dry. A budget past it says that late audio is accepted (a
# slow device, a CPU), and its own length bounds the queue.
WORKER_DEBT_MAX_S = FINAL_SLACK_S / 2
# Longest Retry-After admission answers (a prediction may be unbounded: a queue nothing has measured yet).
MAX_RETRY_AFTER_S = 60.0
# Chunks waiting is worth it only while the batch is small against the largest batch.
_SMALL_BATCH_SHARE = 4


@dataclass(slots=True)
class StreamView:
    """One live request's stream as the scheduler sees it (a snapshot; times from time.perf_counter)."""

    key: Hashable  # identifies the stream in decisions
    arrival_s: float
    first: bool  # its next chunk is the request's first
    deadline_s: float  # playback deadline of its next chunk
    ready: bool = False  # its next chunk has its tokens and could start now (open, or a slot to open in)
    planned: bool = False  # its next chunk is on the worker or handed back by it
    lm_decoding: bool = False  # the LM decodes one of its segments
    decoding_audio: bool = False  # ... the segment being voiced
    missing_tokens: int = 0  # tokens the next (non-final) chunk still needs
    next_final: bool = False  # its next chunk is the official final pass
    final_waits: bool = False  # ... and it could run now (LM done, not the first chunk)
    lm_done: bool = False  # the LM finished the segment being voiced
    lm_done_s: float | None = None  # ... when it did (None: not done, or not dated)
    opened: bool = False  # its token-to-wave stream is open
    needs_slot: bool = False  # opening it takes a flow slot
    ode_key: Hashable | None = None  # the ODE call its next chunk would share (None: none / unknown) ...
    ode_key_of: Callable[[], Hashable | None] | None = None  # ... or how to learn it, asked only when needed
    first_ready_s: float | None = None  # when its first chunk's tokens were all there
    opens_ahead: bool = False  # its stream could open now, ahead of its first chunk
    voice_at_hand: bool = True  # opening it copies a prompt state (False: builds one, a phase of its own)
    lm_pending: bool = False  # its segment waits for an LM row (or its prefill): no token yet
    slot_since_s: float | None = None  # when it took the flow slot it holds (None: it holds none)
    row_since_s: float | None = None  # when its LM segment took the LM row it holds (None: it holds none)
    lm_tokens: int = 0  # tokens its LM segment has generated so far
    lm_expected_tokens: int | None = None  # ... will generate in all, when known (forced); None: as measured

    def ode(self) -> Hashable | None:
        """The ODE key (`ode_key`, or `ode_key_of()` once: asking the runner costs host time)."""
        if self.ode_key_of is not None:
            self.ode_key, self.ode_key_of = self.ode_key_of(), None
        return self.ode_key

    def audio_left_s(self, now: float) -> float:
        """Audio the client has and has not played yet (-inf before its first chunk)."""
        return -math.inf if self.first else self.deadline_s - now


@dataclass(slots=True)
class WorkerView:
    """The token-to-wave worker: what it runs now and what the engine asked of it."""

    busy: bool = False
    first_keys: frozenset = frozenset()  # streams whose first chunk it runs
    preempt_asked: bool = False  # to stop after its running phase
    pause_asked: bool = False  # ... and to pause a phase of final passes that are not due
    due_finals: bool = False  # its batch still holds official final passes that are due
    dry_asked: bool = False
    started_s: float = 0.0  # when its batch was handed over
    predicted_s: float = 0.0  # the cost model's prediction of that batch (what is left of it, from started_s)
    phase_end_s: float | None = None  # predicted end of its running phase (None: unknown, the batch's end)


@dataclass(slots=True)
class EngineView:
    now: float
    streams: Sequence[StreamView]
    lm_decoding: bool = False  # any LM row decodes
    free_flow_slots: int | None = None  # None: no slot pool (every stream opens at once)
    flow_slots: int | None = None  # the pool's slots (None: unknown, taken as the free ones, at least one)
    slots_after_batch: int = 0  # slots given back while the worker's batch runs: free once it is done
    max_batch: int = 64
    official_finals: bool = True  # final chunks are whole-utterance passes (final_attention="full")
    worker: WorkerView | None = None  # None: batches run inline on the engine thread
    open_ahead: bool = True
    free_lm_slots: int = 0
    lm_slots: int = 1
    lm_waiting: int = 0  # requests waiting for an LM slot
    added: int = 0  # requests the engine had taken in when the view was made


@dataclass(slots=True)
class JobView:
    """A chunk in a batch: planned now (from its stream's view) or handed back by the worker."""

    key: Hashable
    first: bool
    final: bool
    audio_left_s: float
    opening: bool = False  # the batch opens its stream
    due: bool = False  # an official final pass that is due: pauses only for a client about to run dry
    pausable: bool = False  # an official final pass: its phase may pause between Euler steps
    prompt_pass: bool = False  # no chunk: the job opens its stream ahead, building a new voice's prompt state


@dataclass(slots=True)
class Plan:
    """What the idle worker runs now: `phases` of chunks (handed-back jobs among them), or `opens`: phases
    of streams to open ahead of their first chunk. Both empty: nothing to run."""

    phases: list[list[JobView]] = field(default_factory=list)
    opens: list[list[Hashable]] = field(default_factory=list)

    @property
    def new_keys(self) -> list[Hashable]:
        return [job.key for phase in self.phases for job in phase]


class Preempt(enum.Enum):
    none = "none"
    first = "first"  # stop after the running phase; a phase of final passes not due pauses between Euler steps
    dry = "dry"  # ... and a client is about to run dry: due final passes pause too
    slot = "slot"  # as `first`, for a first chunk waiting for a flow slot the running batch gave back


class Rule(enum.Enum):
    """The admission rule that refused a stream."""

    debt = "debt"  # the GPU owes more put-off work than WORKER_DEBT_BUDGETS allow
    budget = "budget"  # its predicted first audio is over the budget
    deadlines = "deadlines"  # it would make running streams miss their playback deadlines


@dataclass(slots=True)
class Verdict:
    admitted: bool
    predicted_first_audio_s: float  # from the request's arrival
    reason: str = ""
    retry_after_s: float = 1.0
    predicted_start_s: float | None = None  # ... its first chunk's tokens and flow slot there (None: not predicted)
    rule: Rule | None = None  # which rule refused it (None: admitted; every refusal names one)


@dataclass(slots=True)
class Miss:
    """A chunk delivered after its deadline."""

    kind: str  # "first" | "later" | "final"
    stage: str  # where the time went: "lm" (tokens came after the deadline) or "token2wav"
    late_s: float


class Scheduler:
    """Decisions from an EngineView and the cost model. `first_audio_target_s`: the first chunk's deadline
    after arrival; `budget_s`: admission's limit on the predicted first audio (None: admit every stream)."""

    # the policy's constants (module level, with why each has its value), per instance for tests
    hold_s = HOLD_S
    first_chunk_wait_s = FIRST_CHUNK_WAIT_S

    def __init__(self, cost: CostModel | None = None, budget_s: float | None = None,
                 first_audio_target_s: float | None = None) -> None:
        self.cost = cost or CostModel()
        self.prompt_costs = PromptCosts()  # new recordings' analysis and prompt passes, measured
        self.budget_s = budget_s
        self.worker_debt_limit_s = (math.inf if budget_s is None
                                    else min(WORKER_DEBT_BUDGETS * budget_s, max(WORKER_DEBT_MAX_S, budget_s)))
        self._earliest: tuple[EngineView, tuple, float] | None = None  # the last newcomer's bound
        self.first_audio_target_s = first_audio_target_s or budget_s or DEFAULT_FIRST_AUDIO_TARGET_S

    # ------------------------------------------------------------------ deadlines
    def first_deadline(self, arrival_s: float) -> float:
        return arrival_s + self.first_audio_target_s

    @staticmethod
    def later_deadline(first_audio_at_s: float, audio_sent_s: float) -> float:
        """When the client's audio runs out, if it plays from its first chunk on."""
        return first_audio_at_s + audio_sent_s

    def miss(self, *, first: bool, final: bool, deadline_s: float, delivered_s: float,
             tokens_ready_s: float | None = None) -> Miss | None:
        """The miss of a chunk delivered at `delivered_s` (None: in time)."""
        late = delivered_s - deadline_s
        if late <= 0:
            return None
        stage = "lm" if tokens_ready_s is not None and tokens_ready_s > deadline_s else "token2wav"
        return Miss("first" if first else "final" if final else "later", stage, late)

    # ------------------------------------------------------------------ the idle worker
    def plan(self, view: EngineView, returned: Sequence[JobView] = ()) -> Plan:
        """What the idle worker (or the engine thread, without one) runs now. Handed-back jobs always go."""
        now = view.now
        ready = sorted((s for s in view.streams if s.ready and not s.planned),
                       key=lambda s: (not s.first, s.deadline_s))
        ready = self._within_free_slots(view, ready, reserved=sum(job.opening for job in returned))
        due = self.due_finals(view) if ready else set()
        if not returned and (not ready or not self._worth_a_batch(view, ready, due)
                             or self._first_chunks_due_soon(view, ready)):
            return Plan(opens=self._opens(view))
        ready = self._without_costly_finals(view, ready, due)
        ready = self._without_early_later_chunks(view, ready, due)
        if not ready and not returned:
            return Plan(opens=self._opens(view))
        if view.worker is not None:
            ready = ready[:max(0, view.max_batch - len(returned))]  # the rest waits, plans untouched
        # handed-back jobs were planned before: whether their final pass is due is judged anew
        jobs = [replace(job, due=job.final and job.key in due) for job in returned]
        jobs += [JobView(s.key, s.first, s.next_final, s.audio_left_s(now), opening=not s.opened,
                         due=s.next_final and s.key in due, pausable=s.next_final) for s in ready]
        room = view.max_batch - len(jobs)
        opening = sum(job.opening for job in jobs)
        jobs += [JobView(s.key, False, False, -math.inf, opening=True, prompt_pass=True)
                 for s in self.prompt_passes(view, reserved=opening)[:max(0, room)]]
        return Plan(phases=self.phases(jobs))

    @staticmethod
    def phases(jobs: Sequence[JobView]) -> list[list[JobView]]:
        """A batch's jobs in the order they are voiced and handed back: clients about to run dry, first
        chunks, new voices' prompt passes (one phase: their flow passes batched), later chunks, final passes
        (due ones, then those that may pause, in phases of at most FINAL_PHASE_STREAMS). Each phase's audio
        goes out when that phase is done, so a first chunk never waits for the whole-utterance passes in its
        batch; the phases would not share a flow call anyway."""
        order: list[list[JobView]] = [[], [], [], [], [], []]
        for job in jobs:
            if job.prompt_pass:
                order[2].append(job)
            elif job.first:
                order[1].append(job)
            elif job.audio_left_s < DRY_S:
                order[0].append(job)
            elif job.final:
                order[4 if job.due or not job.pausable else 5].append(job)
            else:
                order[3].append(job)
        phases = [phase for phase in order[:4] if phase]
        for finals in order[4:]:
            phases += [finals[i:i + FINAL_PHASE_STREAMS] for i in range(0, len(finals), FINAL_PHASE_STREAMS)]
        return phases

    @staticmethod
    def riders(phase_keys: Iterable[Hashable | None], phase_size: int,
               candidates: Sequence[Hashable | None]) -> list[int]:
        """Indices of the next phase's later chunks that join a phase of first chunks: those whose ODE key
        (`candidates`, None: cannot ride) is one of the phase's, up to RIDER_STREAMS streams in the call.
        Small ODE calls are launch-bound: the first chunks wait little longer and the worker saves a call."""
        keys = {key for key in phase_keys if key is not None}
        room = RIDER_STREAMS - phase_size
        if not keys or room <= 0:
            return []
        return [i for i, key in enumerate(candidates) if key is not None and key in keys][:room]

    def _opens(self, view: EngineView) -> list[list[Hashable]]:
        """Streams to open ahead of their first chunk, while the worker idles, earliest first-chunk deadline
        first within the free slots: those of voices at hand in one phase, then new voices' prompt passes in
        phases of PROMPT_PHASE_STREAMS (each phase one batched flow call; a chunk that turns urgent waits for
        one phase)."""
        if not view.open_ahead or view.worker is None or not view.free_flow_slots:
            return []
        new = sorted((s for s in view.streams if s.opens_ahead and (s.voice_at_hand or self._builds_now(s))),
                     key=lambda s: (s.deadline_s, s.arrival_s))
        new = self._within_free_slots(view, new)[:view.max_batch]
        at_hand = [s.key for s in new if s.voice_at_hand]
        builds = [s.key for s in new if not s.voice_at_hand]
        return ([at_hand] if at_hand else []) + [builds[i:i + PROMPT_PHASE_STREAMS]
                                                 for i in range(0, len(builds), PROMPT_PHASE_STREAMS)]

    @staticmethod
    def _builds_now(s: StreamView) -> bool:
        """Does opening this stream now run a new voice's prompt pass on its own (not with its chunk)?"""
        return s.opens_ahead and not s.voice_at_hand and not s.planned and not s.ready

    def prompt_passes(self, view: EngineView, reserved: int = 0) -> list[StreamView]:
        """Streams whose opening builds a new voice's prompt state and may run now, ahead of their first
        chunk: earliest first-chunk deadline first, within the free flow slots (less `reserved`, taken by
        the batch's other openings), at most the batch size. None without a worker or with open-ahead off
        (the pass then runs with the stream's first chunk)."""
        if not view.open_ahead or view.worker is None or not view.free_flow_slots:
            return []
        new = sorted((s for s in view.streams if self._builds_now(s)), key=lambda s: (s.deadline_s, s.arrival_s))
        return self._within_free_slots(view, new, reserved=reserved)[:view.max_batch]

    # ------------------------------------------------------------------ while the worker runs
    def preempt(self, view: EngineView) -> Preempt:
        """Should the busy worker hand back its unstarted phases? For a first chunk (unless it waits for
        others of its burst anyway), a client about to run dry that became ready after the batch was
        planned, a new voice's prompt pass that may run, or a first chunk waiting for one of the flow slots
        the batch gave back."""
        worker = view.worker
        if worker is None or not worker.busy or worker.dry_asked:
            return Preempt.none
        now = view.now
        urgent = [s for s in view.streams if s.ready and not s.planned
                  and (s.first or s.audio_left_s(now) < DRY_S)]
        urgent = self._within_free_slots(view, urgent)
        if any(not s.first for s in urgent):
            return Preempt.dry
        if urgent and not worker.pause_asked and not self._first_chunks_due_soon(view, urgent):
            return Preempt.first
        if (not worker.preempt_asked and not worker.due_finals and view.slots_after_batch
                and any(map(self._waits_for_a_slot, view.streams))):
            return Preempt.slot  # the batch has given slots back: they are free once it stops, not at its end
        if not worker.pause_asked and self.prompt_passes(view):
            return Preempt.first  # a new voice's prompt pass: done while its first chunk's tokens are decoded
        return Preempt.none

    @staticmethod
    def _waits_for_a_slot(s: StreamView) -> bool:
        """Is this a first chunk whose tokens are all there and that waits for nothing but a flow slot?"""
        return (s.first and not s.planned and not s.ready and not s.opened and s.needs_slot
                and not s.lm_pending and s.missing_tokens == 0)

    @staticmethod
    def may_be_urgent(first: bool, audio_left_s: float) -> bool:
        """Cheap pre-test for `preempt` (the core builds full views only of streams that pass it)."""
        return first or audio_left_s < DRY_S

    @staticmethod
    def decode_paused(first_on_worker: bool, another_waits_for_first_audio: bool) -> bool:
        """Decode steps pause while a new request's first chunk is on the worker (sharing the GPU slows it),
        unless another request still decodes towards its own first audio."""
        return first_on_worker and not another_waits_for_first_audio

    def wake_after_s(self, view: EngineView) -> float | None:
        """How long the idle engine thread may sleep while the worker runs: until the first client with a
        ready chunk waiting behind the batch is about to run dry (then it must preempt). None: no limit."""
        worker = view.worker
        if worker is None or not worker.busy or worker.dry_asked:
            return None
        waits = [left - DRY_S for s in view.streams
                 if s.ready and not s.planned and not s.first and (left := s.audio_left_s(view.now)) > DRY_S]
        return min(waits) if waits else None

    # ------------------------------------------------------------------ batching rules
    @staticmethod
    def _slots_short(view: EngineView) -> bool:
        """Do more new streams wait to open than there are free slots?"""
        if view.free_flow_slots is None:
            return False
        wanting = sum(1 for s in view.streams if not s.opened)
        return wanting > view.free_flow_slots

    @staticmethod
    def _within_free_slots(view: EngineView, streams: list[StreamView], reserved: int = 0) -> list[StreamView]:
        """No more new streams than free flow slots: each one
        beyond would need a multi-GB cache of its own. `reserved`: streams handed-back jobs will open."""
        if view.free_flow_slots is None:
            return streams
        free = max(0, view.free_flow_slots - reserved)
        kept = []
        for s in streams:
            if not s.opened and s.needs_slot:
                if free == 0:
                    continue
                free -= 1
            kept.append(s)
        return kept

    @staticmethod
    def _chunks_may_wait(view: EngineView, ready: list[StreamView]) -> bool:
        """Could waiting make `ready` share a fuller batch? Only while the LM makes tokens, the batch is
        small and another stream could bring a chunk to it."""
        if not view.lm_decoding or len(ready) >= view.max_batch // _SMALL_BATCH_SHARE:
            return False
        taken = {s.key for s in ready}
        return any(s.key not in taken for s in view.streams)

    def _worth_a_batch(self, view: EngineView, ready: list[StreamView], due: set) -> bool:
        """Does an urgent chunk open a batch now (or can nothing join by waiting)?"""
        if not self._chunks_may_wait(view, ready):
            return True
        slots_short = self._slots_short(view)
        for s in ready:
            if s.audio_left_s(view.now) < URGENT_S or s.key in due:
                return True
            if slots_short and s.lm_done:
                return True
        return False

    def _first_chunks_due_soon(self, view: EngineView, ready: list[StreamView]) -> bool:
        """Do ready first chunks wait for another stream's first chunk due within what is left of
        FIRST_CHUNK_WAIT_S since the oldest of them became ready (its missing tokens × the decode step)?"""
        step_s = self.cost.decode_step_s
        if step_s is None or self.first_chunk_wait_s <= 0:
            return False
        now = view.now
        firsts = [s for s in ready if s.first]
        if not firsts or any(not s.first and s.audio_left_s(now) < URGENT_S for s in ready):
            return False
        oldest = min(now if s.first_ready_s is None else s.first_ready_s for s in firsts)
        left = self.first_chunk_wait_s - (now - oldest)
        if left <= 0:
            return False
        waiting = {s.key for s in ready}
        return any(s.first and s.decoding_audio and s.key not in waiting and s.missing_tokens > 0
                   and s.missing_tokens * step_s <= left for s in view.streams)

    def _without_costly_finals(self, view: EngineView, ready: list[StreamView], due: set) -> list[StreamView]:
        """A batch that voices a first chunk leaves out official final passes that are not due, unless new
        streams wait for the flow slots they would free."""
        if not view.official_finals or not any(s.first for s in ready) or self._slots_short(view):
            return ready
        return [s for s in ready if s.first or not s.next_final or s.key in due]

    def _without_early_later_chunks(self, view: EngineView, ready: list[StreamView], due: set) -> list[StreamView]:
        """While the LM decodes and others could join, a later (not final) chunk with HOLD_S of audio or
        more left stays out of the batch unless it rides with a first chunk's ODE call."""
        if self.hold_s <= 0 or not self._chunks_may_wait(view, ready):
            return ready
        slots_short = self._slots_short(view)
        rides = {key for s in ready if s.first and (key := s.ode()) is not None}
        now = view.now

        def goes(s: StreamView) -> bool:
            if s.first or s.key in due or s.audio_left_s(now) < max(self.hold_s, URGENT_S) or s.next_final:
                return True
            return (slots_short and s.lm_done) or (bool(rides) and s.ode() in rides)

        return [s for s in ready if goes(s)]

    def due_finals(self, view: EngineView) -> set:
        """Keys of the streams whose official final pass may not wait for a first chunk's batch: the k-th
        to run dry is due when its audio left, less k measured passes, is under FINAL_SLACK_S (so are the
        k-1 before it)."""
        waiting = sorted((s.audio_left_s(view.now), i) for i, s in enumerate(view.streams) if s.final_waits)
        slack = max(URGENT_S, FINAL_SLACK_S)
        cost = self.cost.final_pass_s()
        due = 0
        for k, (left, _) in enumerate(waiting, start=1):
            if left - k * cost < slack:
                due = k
        return {view.streams[i].key for _, i in waiting[:due]}

    # ------------------------------------------------------------------ admission
    def admit(self, view: EngineView | None, now: float, first_chunk_tokens: int, pending_new: int = 0,
              prompts: PromptBacklog | None = None) -> Verdict:
        """Admit a new stream arriving at `now` whose first chunk needs `first_chunk_tokens` tokens?
        `view`: the engine's latest published view; `pending_new`: streams admitted since it was made;
        `prompts`: the prompt analysis as the newcomer finds it (whether it brings a new recording, and the
        recordings of admitted requests in line for the analysis: the first of the pending streams).
        Admitted when the budget is off, when nothing runs, or when its predicted first audio is within the
        budget and every running stream that meets its next deadline still does with the newcomer's work."""
        if self.budget_s is None or view is None:
            return Verdict(True, 0.0)
        idle = not view.streams and pending_new == 0  # refusing would help no one
        debt = self.worker_debt_s(view, now, pending_new + 1)
        if not idle and debt > self.worker_debt_limit_s:
            excess = debt - self.worker_debt_limit_s
            # reported as over the budget by the excess, so a router ranks this engine among those that refuse
            return Verdict(False, self.budget_s + excess, f"the GPU already owes {debt:.2f} s of work put off for "
                           f"first chunks, over its limit of {self.worker_debt_limit_s:g} s",
                           min(MAX_RETRY_AFTER_S, max(1.0, excess)), rule=Rule.debt)
        predicted, broken, start = self._predict(view, now, first_chunk_tokens, pending_new,
                                                 prompts or PromptBacklog())
        if idle or (predicted <= self.budget_s and broken == 0):
            return Verdict(True, predicted, predicted_start_s=start)
        retry = min(MAX_RETRY_AFTER_S, max(1.0, predicted - self.budget_s))
        if predicted > self.budget_s:
            return Verdict(False, predicted, f"predicted first audio in {predicted:.2f} s, over the budget of "
                           f"{self.budget_s:g} s", retry, start, Rule.budget)
        return Verdict(False, predicted, f"admitting it would make {broken} running stream(s) miss their playback "
                       "deadline", retry, start, Rule.deadlines)

    def worker_debt_s(self, view: EngineView, now: float, new_streams: int = 0) -> float:
        """Worker seconds owed in the work that waits behind first chunks: an official final pass for every
        stream whose pass is not on the worker yet, a first chunk for every stream still to start one, each
        at its measured cost, and the rest of the running batch; `new_streams` (admitted since the view, and
        the newcomer) owe both. Under a sustained overload this is the queue that grows."""
        owed_finals = (new_streams + sum(1 for s in view.streams if not (s.planned and s.next_final))
                       if view.official_finals else 0)
        owed_firsts = new_streams + sum(1 for s in view.streams if s.first and not s.planned)
        _, per_first = self.cost.phase_line("first")
        return (batch_end(view, now) - now) + owed_finals * self.cost.final_pass_s() + owed_firsts * per_first

    def _newcomers(self, now: float, tokens: int, pending_new: int, prompts: PromptBacklog
                   ) -> tuple[list[Newcomer], Newcomer]:
        """The streams admitted since the view and the newcomer, each with when its recording is analysed: the
        first pending ones hold the recordings in the analysis now (in their frontend), in line order; the
        newcomer's, if it brings one, is analysed last."""
        deadline = now + (self.budget_s or self.first_audio_target_s)
        ends = analysis_ends(prompts, self.prompt_costs, now) if prompts.waiting else []
        in_line = ends[:prompts.running + prompts.queued]
        pending = [Newcomer(f"pending{i}", tokens, deadline, *((in_line[i], True) if i < len(in_line) else ()))
                   for i in range(pending_new)]
        new = Newcomer("new", tokens, deadline, *((ends[-1], True) if prompts.new_recording else ()))
        return pending, new

    def _predict(self, view: EngineView, now: float, tokens: int, pending_new: int,
                 prompts: PromptBacklog) -> tuple[float, int, float | None]:
        """(predicted first audio of the newcomer from now, running streams it would make late, when its first
        chunk can start from now: tokens and flow slot there; None when a remembered refusal answers): every known
        stream's next chunk, and the first chunks of streams still waiting for an LM row, admitted since the
        view (still in the frontend or the inbox) and the newcomer, each when its tokens and a flow slot are
        there, voiced by a simulation of the worker's batches (`simulate_worker`) from its current batch on.
        Cheapest answers first (admission runs on the caller's event loop, refusals must be quick): a
        newcomer whose tokens or flow slot alone come too late is refused without simulating the worker, and
        the running streams' deadlines are checked only for a newcomer within the budget."""
        step_s = self.cost.decode_step_s or 0.0
        budget = self.budget_s if self.budget_s is not None else math.inf
        # the earliest first audio only grows with `now` (waits either run from now or end at fixed times), so
        # newcomers refused on the same view with the same streams ahead are refused again at no cost
        memo = self._earliest
        if memo is not None and memo[0] is view and memo[1] == (pending_new, tokens, prompts) \
                and memo[2] - now > budget:
            return memo[2] - now, 0, None
        newcomers, new = self._newcomers(now, tokens, pending_new, prompts)
        with_new = next_chunks(view, now, self.cost, step_s, [*newcomers, new])
        start = next(job.ready_s for job in with_new if job.key == "new") - now
        earliest = now + start + self.cost.phase_s("first", 1)
        self._earliest = (view, (pending_new, tokens, prompts), earliest)
        if earliest - now > budget:
            return earliest - now, 0, start
        free_at, carried = worker_state(view, now)
        passes_s = self.prompt_costs.passes_s
        after = simulate_worker(with_new + carried, free_at, self.cost, view.max_batch, DRY_S, FINAL_PHASE_STREAMS,
                                passes_s)
        predicted = max(after["new"], after.get(PromptPass("new"), -math.inf)) - now
        if predicted > budget:
            return predicted, 0, start
        jobs = next_chunks(view, now, self.cost, step_s, newcomers)
        before = simulate_worker(jobs + carried, free_at, self.cost, view.max_batch, DRY_S, FINAL_PHASE_STREAMS,
                                 passes_s)
        broken = sum(1 for job in jobs if isinstance(job.key, StreamKey)
                     and before[job.key] <= job.deadline_s < after[job.key])
        return predicted, broken, start
