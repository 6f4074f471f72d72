"""The token-to-wave side of the engine: a batch's jobs, the worker thread that runs them, the messages.

The engine thread plans every batch (engine/scheduler.py decides, engine/voicing.py applies) and owns
every request's state; the worker only runs what it is handed, phase after phase, and posts each
phase's result back to the engine's inbox. While a batch runs the worker is the only user of the flow,
HiFT, their graphs and the slot pool.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from cosystream.engine import runners
from cosystream.engine.chunking import ChunkPlan
from cosystream.engine.request import RequestState, Segment
from cosystream.engine.scheduler import Scheduler

if TYPE_CHECKING:
    from cosystream.engine.core import EngineCore


@dataclass
class ChunkJob:
    """One chunk of one request in a token-to-wave batch."""

    req: RequestState
    seg: Segment
    plan: ChunkPlan | None  # None: the job only opens the segment's stream (open-ahead)
    open_args: dict | None = None  # the segment's stream opens with this job (on whoever runs the batch)
    state: Any = None  # the segment's token-to-wave stream
    error: Exception | None = None  # this job alone failed (e.g. its stream could not open)
    first: bool = False  # the request's first chunk (snapshot when planned: the worker reads no request state)
    pausable: bool = False  # an official final pass: its phase may pause between Euler steps
    due: bool = False  # ... that is due: it pauses only for a client about to run dry
    builds_prompt: bool = False  # opening its stream runs the flow over a new voice's prompt (a prompt pass)


# ------------------------------------------------------------------ messages to the engine thread
@dataclass
class Add:
    req: RequestState


@dataclass
class Abort:
    request_id: str


@dataclass
class Text:
    request_id: str
    text_ids: list[int]


@dataclass
class TextEnd:
    request_id: str


@dataclass
class Call:
    fn: Callable[..., Any]
    args: tuple
    done: threading.Event = field(default_factory=threading.Event)
    box: dict = field(default_factory=dict)


@dataclass
class ChunksDone:
    """A phase of a batch came back from the worker (or inline)."""

    jobs: list[ChunkJob]  # the phase's jobs (riders included); empty for a paused phase of final passes
    results: list | None  # per job (pcm, flow_s, vocoder_s) or None; None with `error`
    error: BaseException | None
    now: float  # when the phase ended
    busy_s: float  # worker seconds it took
    last: bool  # the batch's last phase (the worker is free)
    returned: list[ChunkJob] = field(default_factory=list)  # planned jobs of unstarted phases (preempted)
    kind: str = "chunks"  # phase_kind of the phase
    # (voices, seconds) of the prompt passes done since the last message (runners.finished_prompt_passes)
    prompt_passes: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Stop:
    pass


Message = Add | Abort | Text | TextEnd | Call | ChunksDone | Stop


def phase_kind(jobs: Sequence[ChunkJob]) -> str:
    """What a phase runs: "open" (streams opened ahead), "first" (first chunks, with any riders), "final"
    (official final passes) or "chunks" (later chunks)."""
    if all(job.plan is None for job in jobs):
        return "open"
    if any(job.first for job in jobs):
        return "first"
    if all(job.plan is not None and job.plan.is_final for job in jobs):
        return "final"
    return "chunks"


def _riders(t2w: runners.Token2WavRunner, phases: list[list[ChunkJob]], i: int) -> list[ChunkJob]:
    """Jobs of the next phase of chunks (a phase of prompt passes between is skipped) that join phase i, a
    phase of first chunks, in its ODE call (Scheduler.riders); they leave that phase (dropped when it is
    empty then)."""
    jobs = phases[i]
    if not jobs or not all(job.first for job in jobs):
        return []
    n = next((j for j in range(i + 1, len(phases)) if any(job.plan is not None for job in phases[j])), None)
    if n is None:
        return []
    pool = [job for job in phases[n] if not job.first and job.plan is not None]
    keys = [t2w.flow_group(job.state, job.plan) for job in jobs
            if job.error is None and job.state is not None and job.plan is not None]
    candidates = [t2w.flow_group(job.state, job.plan) if job.open_args is None and job.state is not None
                  and job.plan is not None else None for job in pool]
    riders = [pool[k] for k in Scheduler.riders(keys, len(jobs), candidates)]
    if riders:
        taken = {id(job) for job in riders}
        phases[n] = [job for job in phases[n] if id(job) not in taken]
        if not phases[n]:
            del phases[n]
    return riders


def run_jobs(t2w: runners.Token2WavRunner, jobs: list[ChunkJob], phases: list[list[ChunkJob]] | None = None,
             i: int = 0,
             should_stop: Callable[[], bool] | None = None) -> list[runners.ChunkAudio | None] | None:
    """Open the streams that start with this batch, then voice every job whose stream is open. With the
    batch's `phases` (`jobs` being phase i), riders of phase i + 1 are appended to `jobs` before anything
    runs, so a caller that sees the run fail fails them with it. Returns each job's (pcm, flow_s,
    vocoder_s), riders included; None for a job that failed alone (its error is on the job) or only opened
    its stream. should_stop: passed to t2w.run, which may pause a phase of official final passes between
    Euler steps; then the whole result is None (nothing voiced: the jobs go on in a later batch)."""
    t2w.watch.start()
    opening = [job for job in jobs if job.open_args is not None]
    for job, state in zip(opening, t2w.open_streams([job.open_args for job in opening]), strict=True):
        if isinstance(state, Exception):  # e.g. out of memory building the voice's prompt state
            job.error = state
        else:
            job.state = state
    t2w.watch.lap("open")
    if phases is not None:
        jobs.extend(_riders(t2w, phases, i))
    runnable = [job for job in jobs if job.error is None and job.plan is not None]
    if runnable:
        items = [(job.state, job.seg.tokens[:], job.plan) for job in runnable]
        results = t2w.run(items, should_stop=should_stop)
        if results is None:
            return None
    else:  # streams opened ahead of their first chunk (or none could open)
        results = []
        t2w.opened()
    by_job = {id(job): result for job, result in zip(runnable, results, strict=True)}
    return [by_job.get(id(job)) for job in jobs]


def stop_test(worker: ChunkWorker | None, jobs: Sequence[ChunkJob]) -> Callable[[], bool] | None:
    """What a phase of official final passes asks between Euler steps: due passes give way only to a client
    about to run dry, others to first chunks too. None: the phase does not pause."""
    if worker is None or not jobs or not all(job.pausable for job in jobs):
        return None
    return worker.dry.is_set if any(job.due for job in jobs) else worker.pause.is_set


class ChunkWorker:
    """The token-to-wave thread: runs one batch at a time on its own CUDA stream and posts each phase's
    result to the engine's inbox. It touches no request state."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.jobs: queue.Queue[list[list[ChunkJob]] | None] = queue.Queue()
        self.preempt = threading.Event()  # set by the engine thread: stop after the running phase
        self.pause = threading.Event()  # ... and pause a phase of final passes not due (set with it)
        self.dry = threading.Event()  # ... and the urgent chunk is a client's about to run dry (set with it)
        self.running = "idle"  # the kind of phase on the GPU now (phase_kind), read by the engine's stats
        self.thread = threading.Thread(target=self._run, name="cosystream-token2wav", daemon=True)
        device = core.lm_runner.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def submit(self, phases: list[list[ChunkJob]]) -> None:
        self.preempt.clear()  # a request to stop early is about the batch before this one
        self.pause.clear()
        self.dry.clear()
        self.jobs.put(phases)

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while (phases := self.jobs.get()) is not None:
            i = 0
            while i < len(phases):
                jobs = phases[i]
                kind = self.running = phase_kind(jobs)
                results, error, passes = None, None, []
                t0 = time.perf_counter()
                try:
                    results = self._compute(phases, i)  # riders of phase i + 1 join `jobs` in place
                    passes = self.core.t2w.finished_prompt_passes()
                except BaseException as e:  # reported with the phase; the engine thread decides
                    error = e
                now = time.perf_counter()
                rest = phases[i + 1:]
                paused = error is None and results is None  # final passes stopped between Euler steps
                stop = paused or (bool(rest) and self.preempt.is_set())
                # one message with the unstarted jobs: the engine must not plan before it has them back
                returned = [job for phase in ([jobs] if paused else []) + rest for job in phase] if stop else []
                done, results = ([], []) if paused else (jobs, results)
                self.core.inbox.put(ChunksDone(done, results, error, now, now - t0, not rest or stop, returned,
                                               kind, passes))
                if stop:
                    break
                i += 1
            self.running = "idle"

    def _compute(self, phases: list[list[ChunkJob]], i: int) -> list | None:
        """Phase i's results, or None: a phase of official final passes paused between two Euler steps."""
        t2w = self.core.t2w
        should_stop = stop_test(self, phases[i])
        if self.stream is None:
            return run_jobs(t2w, phases[i], phases, i, should_stop)
        # the batch may read what the engine thread wrote on its stream (prompt caches of new voices)
        self.stream.wait_stream(self.core.gpu_stream)
        with torch.cuda.stream(self.stream):
            return run_jobs(t2w, phases[i], phases, i, should_stop)
