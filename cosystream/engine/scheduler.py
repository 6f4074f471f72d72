"""The engine's scheduling policy: one model of time, one cost model, decisions from both.

Every stream has a playback deadline for its next chunk: a first chunk's is the request's arrival plus
the first-audio target; a later chunk's is the moment the audio its client already has runs out (it
plays from its first chunk on). `CostModel` predicts what the GPU's work takes (decode step, prefill,
chunk phases by kind and size, official final passes), measured on this device: the decode step at
warm-up, the rest from the first phases and then continuously.

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
* decode steps pause while a first chunk is on the worker, unless another request still waits for its
  first audio (the two share the GPU);
* official final passes come due earliest deadline first, each costing the measured pass;
* idle, the worker opens the flow streams of requests still decoding their first chunk (open-ahead);
* admission: a new stream is admitted only when the predicted finish of its first chunk is within the
  budget and no running stream that meets its deadline now would miss it with the newcomer's work.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace

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
# First-audio target of a stream's first chunk when admission has no budget (deadlines still order work).
DEFAULT_FIRST_AUDIO_TARGET_S = 1.0
# Longest Retry-After admission answers (a prediction may be unbounded: a queue nothing has measured yet).
MAX_RETRY_AFTER_S = 60.0
# Chunks waiting is worth it only while the batch is small against the largest batch.
_SMALL_BATCH_SHARE = 4
# Decode-step periods longer than this are idle gaps, not steps.
_MAX_STEP_S = 0.05
# Weight kept by the phase-cost fit's past at each new phase (≈ the last 30 phases of a kind count).
PHASE_FIT_DECAY = 0.97
# Share of a phase's cost that is per call rather than per chunk, while the fit has seen one phase size
# only: on the H100 one first chunk takes 25 ms and sixteen in one call 79 ms (docs/benchmarks.md, "Where
# one stream's first audio goes"), a fixed ≈ 21 ms. Measured phases of other sizes replace it.
PRIOR_FIXED_SHARE = 0.8
# Variance of the phase sizes (chunks²) the fit needs before it trusts its own slope.
_MIN_SIZE_VARIANCE = 0.25


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
    preempt_asked: bool = False
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
    first = "first"  # stop after the running phase (a phase of due final passes goes on)
    dry = "dry"  # ... and a client is about to run dry: due final passes pause too


@dataclass(slots=True)
class Verdict:
    admitted: bool
    predicted_first_audio_s: float  # from the request's arrival
    reason: str = ""
    retry_after_s: float = 1.0


@dataclass(slots=True)
class Miss:
    """A chunk delivered after its deadline."""

    kind: str  # "first" | "later" | "final"
    stage: str  # where the time went: "lm" (tokens came after the deadline) or "token2wav"
    late_s: float


class _Ewma:
    def __init__(self, weight: float) -> None:
        self.weight, self.value = weight, None

    def observe(self, x: float) -> None:
        if math.isfinite(x) and x >= 0:
            self.value = x if self.value is None else self.value + self.weight * (x - self.value)


class _PhaseLine:
    """seconds = fixed + per_chunk × chunks for one kind of worker phase: an exponentially weighted
    least-squares fit of the phases seen. A flow call (and its vocoder call) costs nearly as much for one
    chunk as for sixteen, so a per-chunk average measured at one batch size is wrong at every other.
    While every phase seen had about the same size, the split between the two terms is PRIOR_FIXED_SHARE."""

    def __init__(self, decay: float = PHASE_FIT_DECAY) -> None:
        self.decay = decay
        self.w = self.wn = self.wnn = self.wy = self.wny = 0.0

    def observe(self, chunks: int, seconds: float) -> None:
        if chunks <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        d, n = self.decay, float(chunks)
        self.w, self.wn, self.wnn = d * self.w + 1, d * self.wn + n, d * self.wnn + n * n
        self.wy, self.wny = d * self.wy + seconds, d * self.wny + n * seconds

    @property
    def measured(self) -> bool:
        return self.w > 0

    def line(self) -> tuple[float, float]:
        """(fixed seconds per phase, seconds per chunk); (0, 0) before any phase."""
        if self.w <= 0:
            return 0.0, 0.0
        mean_n, mean_y = self.wn / self.w, self.wy / self.w
        var_n = self.wnn / self.w - mean_n * mean_n
        if var_n >= _MIN_SIZE_VARIANCE:
            per = (self.wny / self.w - mean_n * mean_y) / var_n
            if per >= 0:
                fixed = mean_y - per * mean_n
                if fixed >= 0:
                    return fixed, per
                return 0.0, self.wny / self.wnn  # through the origin: no negative fixed cost
        # one size seen (or a fit that makes no physical sense): the prior split of the mean phase
        fixed = PRIOR_FIXED_SHARE * mean_y
        return fixed, (mean_y - fixed) / mean_n

    def seconds(self, chunks: int) -> float:
        fixed, per = self.line()
        return fixed + per * chunks if chunks > 0 else 0.0


class CostModel:
    """Measured costs of the GPU's work on this device. Written by the engine thread only (the admission
    path reads floats, which is safe in CPython)."""

    def __init__(self) -> None:
        self._step = _Ewma(0.2)
        self._prefill = _Ewma(0.2)
        self._lm_hold = _Ewma(0.1)  # seconds a segment holds its LM row
        self._lm_tokens = _Ewma(0.1)  # speech tokens a segment's LM generates
        self._slot_hold = _Ewma(0.1)  # seconds a stream holds its flow slot (open to release)
        self._phases: dict[str, _PhaseLine] = {}  # worker seconds per phase by kind and chunks in it
        self._final_busy_s = 0.0
        self._finals_done = 0.0

    @property
    def decode_step_s(self) -> float | None:
        return self._step.value

    def observe_step(self, period_s: float) -> None:
        if period_s < _MAX_STEP_S:
            self._step.observe(period_s)

    def observe_prefill(self, seconds: float) -> None:
        self._prefill.observe(seconds)

    def observe_lm_hold(self, seconds: float) -> None:
        self._lm_hold.observe(seconds)

    def observe_lm_tokens(self, tokens: int) -> None:
        self._lm_tokens.observe(float(tokens))

    def lm_left_s(self, stream: StreamView, now: float) -> float | None:
        """When the LM of a stream that holds a row is predicted done: its tokens still to come (of its forced
        length, else of the measured tokens per segment) × the decode step now, so holds stretch as the GPU
        loads; without those, the measured row hold after it took the row. None: nothing measured."""
        expected = stream.lm_expected_tokens or self._lm_tokens.value
        if expected is not None and self._step.value is not None:
            return now + max(0.0, expected - stream.lm_tokens) * self._step.value
        if self._lm_hold.value is not None and stream.row_since_s is not None:
            return max(now, stream.row_since_s + self._lm_hold.value)
        return None

    def observe_slot_hold(self, seconds: float) -> None:
        self._slot_hold.observe(seconds)

    def observe_phase(self, kind: str, jobs: int, seconds: float) -> None:
        """A worker phase of `jobs` chunks of one kind ("first", "chunks", "final") took `seconds`; a paused
        phase of final passes comes with jobs=0 (its time counts towards the passes that finish later)."""
        if kind == "final":
            self._final_busy_s = 0.9 * self._final_busy_s + seconds
            self._finals_done = 0.9 * self._finals_done + jobs
            return
        if jobs > 0:
            self._phases.setdefault(kind, _PhaseLine()).observe(jobs, seconds)

    def final_pass_s(self) -> float:
        """Worker seconds per official final pass (0 before one was measured)."""
        return self._final_busy_s / self._finals_done if self._finals_done > 0 else 0.0

    def phase_s(self, kind: str, chunks: int) -> float:
        """Predicted worker seconds of a phase of `chunks` chunks of `kind` ("first", "chunks", "final");
        an unmeasured chunk kind borrows the other's line (0 before either was measured)."""
        if kind == "final":
            return self.final_pass_s() * chunks
        line = self._phases.get(kind)
        if line is None or not line.measured:
            line = self._phases.get("first" if kind == "chunks" else "chunks")
            if line is None:
                return 0.0
        return line.seconds(chunks)

    def phase_line(self, kind: str) -> tuple[float, float]:
        """(fixed seconds per phase, seconds per chunk) of a chunk kind, as `phase_s` uses it."""
        chunks = self.phase_s(kind, 2) - self.phase_s(kind, 1)
        return self.phase_s(kind, 1) - chunks, chunks

    def chunk_s(self, kind: str) -> float:
        """Worker seconds of one chunk voiced alone in a phase of `kind` (0 before one was measured)."""
        return self.phase_s(kind, 1)

    def prefill_s(self) -> float:
        return self._prefill.value or 0.0

    def lm_hold_s(self) -> float | None:
        return self._lm_hold.value

    def slot_hold_s(self) -> float | None:
        """Seconds a stream holds its flow slot; the LM row's hold stands in before one was measured."""
        return self._slot_hold.value if self._slot_hold.value is not None else self._lm_hold.value


class Scheduler:
    """Decisions from an EngineView and the cost model. `first_audio_target_s`: the first chunk's deadline
    after arrival; `budget_s`: admission's limit on the predicted first audio (None: admit every stream)."""

    # the policy's constants (module level, with why each has its value), per instance for tests
    hold_s = HOLD_S
    first_chunk_wait_s = FIRST_CHUNK_WAIT_S

    def __init__(self, cost: CostModel | None = None, budget_s: float | None = None,
                 first_audio_target_s: float | None = None) -> None:
        self.cost = cost or CostModel()
        self.budget_s = budget_s
        self._earliest: tuple[EngineView, tuple[int, int], float] | None = None  # the last newcomer's bound
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
        return Plan(phases=self.phases(jobs))

    @staticmethod
    def phases(jobs: Sequence[JobView]) -> list[list[JobView]]:
        """A batch's jobs in the order they are voiced and handed back: clients about to run dry, first
        chunks, later chunks, final passes (due ones, then those that may pause, in phases of at most
        FINAL_PHASE_STREAMS). Each phase's audio goes out when that phase is done, so a first chunk never
        waits for the whole-utterance passes in its batch; the phases would not share a flow call anyway."""
        order: list[list[JobView]] = [[], [], [], [], []]
        for job in jobs:
            if job.first:
                order[1].append(job)
            elif job.audio_left_s < DRY_S:
                order[0].append(job)
            elif job.final:
                order[3 if job.due or not job.pausable else 4].append(job)
            else:
                order[2].append(job)
        phases = [phase for phase in order[:3] if phase]
        for finals in order[3:]:
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
        """Streams to open ahead of their first chunk, while the worker idles: those of voices at hand in
        one phase, each voice to build in a phase of its own (a chunk that turns urgent waits for one)."""
        if not view.open_ahead or view.worker is None or not view.free_flow_slots:
            return []
        new = [s for s in sorted(view.streams, key=lambda s: s.arrival_s) if s.opens_ahead]
        new = self._within_free_slots(view, new)[:view.max_batch]
        at_hand = [s.key for s in new if s.voice_at_hand]
        return ([at_hand] if at_hand else []) + [[s.key] for s in new if not s.voice_at_hand]

    # ------------------------------------------------------------------ while the worker runs
    def preempt(self, view: EngineView) -> Preempt:
        """Should the busy worker hand back its unstarted phases? For a first chunk (unless it waits for
        others of its burst anyway) or a client about to run dry that became ready after the batch was
        planned."""
        worker = view.worker
        if worker is None or not worker.busy or worker.dry_asked:
            return Preempt.none
        now = view.now
        urgent = [s for s in view.streams if s.ready and not s.planned
                  and (s.first or s.audio_left_s(now) < DRY_S)]
        urgent = self._within_free_slots(view, urgent)
        if any(not s.first for s in urgent):
            return Preempt.dry
        if urgent and not worker.preempt_asked and not self._first_chunks_due_soon(view, urgent):
            return Preempt.first
        return Preempt.none

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
    def admit(self, view: EngineView | None, now: float, first_chunk_tokens: int, pending_new: int = 0) -> Verdict:
        """Admit a new stream arriving at `now` whose first chunk needs `first_chunk_tokens` tokens?
        `view`: the engine's latest published view; `pending_new`: streams admitted since it was made.
        Admitted when the budget is off, when nothing runs, or when its predicted first audio is within the
        budget and every running stream that meets its next deadline still does with the newcomer's work."""
        if self.budget_s is None or view is None:
            return Verdict(True, 0.0)
        predicted, broken = self._predict(view, now, first_chunk_tokens, pending_new)
        idle = not view.streams and pending_new == 0  # refusing would help no one
        if idle or (predicted <= self.budget_s and broken == 0):
            return Verdict(True, predicted)
        retry = min(MAX_RETRY_AFTER_S, max(1.0, predicted - self.budget_s))
        reason = (f"predicted first audio in {predicted:.2f} s, over the budget of {self.budget_s:g} s"
                  if predicted > self.budget_s else
                  f"admitting it would make {broken} running stream(s) miss their playback deadline")
        return Verdict(False, predicted, reason, retry)

    def _predict(self, view: EngineView, now: float, tokens: int, pending_new: int) -> tuple[float, int]:
        """(predicted first audio of the newcomer from now, running streams it would make late): every known
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
        if memo is not None and memo[0] is view and memo[1] == (pending_new, tokens) and memo[2] - now > budget:
            return memo[2] - now, 0
        deadline = now + (self.budget_s or self.first_audio_target_s)
        newcomers = [(f"pending{i}", tokens, deadline) for i in range(pending_new)]
        with_new = self._next_chunks(view, now, step_s, newcomers + [("new", tokens, deadline)])
        earliest = next(job.ready_s for job in with_new if job.key == "new") + self.cost.phase_s("first", 1)
        self._earliest = (view, (pending_new, tokens), earliest)
        if earliest - now > budget:
            return earliest - now, 0
        free_at, carried = self._worker_state(view, now)
        after = simulate_worker(with_new + carried, free_at, self.cost, view.max_batch)
        predicted = after["new"] - now
        if predicted > budget:
            return predicted, 0
        jobs = self._next_chunks(view, now, step_s, newcomers)
        before = simulate_worker(jobs + carried, free_at, self.cost, view.max_batch)
        broken = sum(1 for job in jobs if isinstance(job.key, _Key)
                     and before[job.key] <= job.deadline_s < after[job.key])
        return predicted, broken

    @staticmethod
    def _worker_state(view: EngineView, now: float) -> tuple[float, list[WorkJob]]:
        """When the worker can take a new batch, and what is left of its current one: it is free for urgent
        chunks once its running phase ends; its unstarted phases go on after them (one job of their cost)."""
        worker = view.worker
        if worker is None or not worker.busy:
            return now, []
        end = max(now, worker.started_s + worker.predicted_s)
        phase_end = end if worker.phase_end_s is None else min(end, max(now, worker.phase_end_s))
        rest = end - phase_end
        return phase_end, ([WorkJob(phase_end, 1, -math.inf, "batch", None, rest)] if rest > 0 else [])

    def _next_chunks(self, view: EngineView, now: float, step_s: float,
                     newcomers: Sequence[tuple[str, int, float]] = ()) -> list[WorkJob]:
        """Every stream's next chunk not yet on the worker, with when it can start: its tokens (now, after the
        decode steps still missing, or after its wait for an LM row, prefill and first chunk's steps) and, for
        a stream to open, a flow slot. `newcomers`: (key, first chunk tokens, deadline) of streams not in the
        view, behind its streams in line for an LM row. Classes as the worker's phases run them: a client
        about to run dry (`DRY_S`) ahead of first chunks, then the rest."""
        cost = self.cost
        pending = sorted((s for s in view.streams if s.first and s.lm_pending and not s.planned),
                         key=lambda s: s.arrival_s)
        rows = _LMRows(view, now, cost, ahead=view.lm_waiting - len(pending))
        lm_ready = {id(s): rows.next() + cost.prefill_s() + s.missing_tokens * step_s for s in pending}
        entries: list[tuple[float, WorkJob, bool]] = []  # (tokens ready at, job, needs a flow slot)
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
            cls = 0 if s.first else -1 if s.deadline_s - tokens_at < DRY_S else 1
            entries.append((tokens_at, WorkJob(tokens_at, cls, s.deadline_s, kind, _Key(s.key)),
                            s.needs_slot and not s.opened))
        for key, num_tokens, deadline in newcomers:
            tokens_at = rows.next() + cost.prefill_s() + num_tokens * step_s
            entries.append((tokens_at, WorkJob(tokens_at, 0, deadline, "first", key), view.free_flow_slots is not None))
        jobs = []
        for tokens_at, job, needs_slot in sorted(entries, key=lambda e: (e[0], e[1].deadline_s)):
            if needs_slot:
                job.ready_s = slots.take(tokens_at)
            jobs.append(job)
        return jobs


@dataclass(slots=True)
class WorkJob:
    """A piece of the worker's work in `simulate_worker`: a chunk, or the rest of the batch it runs now."""

    ready_s: float  # when it can start (tokens and flow slot there)
    cls: int  # -1: a client about to run dry, 0: a first chunk, 1: the rest (the worker's phase order)
    deadline_s: float
    kind: str  # "first", "chunks", "final" (a phase of its own kind), "batch": the worker's current batch
    key: Hashable
    cost_s: float = 0.0  # "batch" only: its predicted seconds


@dataclass(frozen=True, slots=True)
class _Key:
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
    when it starts; one held now comes back as `_back_at` predicts.
    No pool: every stream opens at once. No hold measured yet and no free slot: never (inf)."""

    def __init__(self, view: EngineView, now: float, cost: CostModel) -> None:
        self.pooled = view.free_flow_slots is not None
        self.hold = cost.slot_hold_s()
        free = view.free_flow_slots or 0
        holders = [s for s in view.streams if s.slot_since_s is not None]
        ends = [end for s in holders if (end := self._back_at(s, now, cost)) is not None]
        # slots held by streams the view does not date (none in the engine's views): back one by one over a hold
        undated = max(0, (view.flow_slots or 0) - free - len(ends))
        held = ends + ([] if self.hold is None else [now + self.hold * (j + 1) / undated for j in range(undated)])
        self.heap = [now] * free + held
        heapq.heapify(self.heap)

    def _back_at(self, holder: StreamView, now: float, cost: CostModel) -> float | None:
        """A held slot comes back once its stream's LM is done (its last chunks are voiced at once then: the
        pool is short); a stream whose LM is done gives it back now; else the measured hold after it was
        taken."""
        if holder.lm_done:
            return now
        if holder.row_since_s is not None and (end := cost.lm_left_s(holder, now)) is not None:
            return end
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


def simulate_worker(jobs: Sequence[WorkJob], free_at: float, cost: CostModel, max_batch: int) -> dict:
    """Finish time of each job's phase (by key) on a worker that runs as the scheduler has it run: when free,
    it takes every job ready (at most `max_batch`, by class, then deadline) as one batch, voiced in phases:
    clients about to run dry (a later chunk whose deadline is within DRY_S when the batch forms), first
    chunks, the rest of an earlier batch, later chunks, official final passes (FINAL_PHASE_STREAMS a phase);
    each phase costs the cost model's fixed + per-chunk seconds for its size. A first chunk that becomes
    ready, or a client that comes within DRY_S of running dry, while a batch runs preempts it after the
    running phase: the batch's unstarted jobs always go in the next batch (Scheduler.plan), whose new jobs
    fill what is left of max_batch. The rest of the worker's current batch runs on the same way."""
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
        """Did a chunk turn urgent (ready, or within DRY_S of its deadline) after `since`, by `now`?"""
        release(now)
        return any(job.ready_s > since if job.kind == "first" else
                   job.deadline_s - now < DRY_S and (job.ready_s > since or job.deadline_s - since >= DRY_S)
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
        queue.sort(key=lambda j: (_class_at(j, t), j.deadline_s))
        room = max(0, max_batch - len(returned))
        batch, queue[:], returned = returned + queue[:room], queue[room:], []
        phases = _sim_phases(batch, t)
        start = t
        for k, phase in enumerate(phases):
            t += _phase_cost(phase, cost)
            for job in phase:
                out[job.key] = t
            if k + 1 < len(phases) and preempted(start, t):  # the rest goes in the next batch
                returned = [job for rest in phases[k + 1:] for job in rest]
                break
    return out


def _class_at(job: WorkJob, t: float) -> int:
    """-1: a client about to run dry at t, 0: a first chunk, 1: the rest."""
    if job.kind == "first":
        return 0
    return -1 if job.kind != "batch" and job.deadline_s - t < DRY_S else 1


def _phase_cost(phase: Sequence[WorkJob], cost: CostModel) -> float:
    if phase[0].kind == "batch":
        return phase[0].cost_s
    kinds = {job.kind for job in phase}
    kind = "first" if "first" in kinds else "final" if kinds == {"final"} else "chunks"
    return cost.phase_s(kind, len(phase))


def _sim_phases(batch: Sequence[WorkJob], t: float) -> list[list[WorkJob]]:
    """A batch formed at t in the worker's phase order (Scheduler.phases): dry clients, first chunks, what is
    left of the batch they preempted (or that runs on), later chunks, final passes in phases of
    FINAL_PHASE_STREAMS."""
    classes = [(_class_at(j, t), j) for j in batch]
    dry = [j for c, j in classes if c < 0]
    firsts = [j for c, j in classes if c == 0]
    rest = [[j] for j in batch if j.kind == "batch"]
    later = [j for c, j in classes if c > 0 and j.kind == "chunks"]
    finals = [j for c, j in classes if c > 0 and j.kind == "final"]
    phases = [phase for phase in (dry, firsts) if phase] + rest + ([later] if later else [])
    return phases + [finals[i:i + FINAL_PHASE_STREAMS] for i in range(0, len(finals), FINAL_PHASE_STREAMS)]
