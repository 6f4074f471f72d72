"""A developer's trace of the scheduler's decisions: `COSYSTREAM_TRACE=<file>` appends one JSON line per
decision of the idle worker's planning that had work in view (engine/voicing.py), so that a run under load
shows where first chunks wait: for a flow slot, for the worker, or for the scheduler's choice.

Each line: `t` (perf_counter seconds), `streams`, `free_slots` (flow slots free, null without a pool),
`first_ready` (first chunks whose tokens are all there and that are not planned), `first_no_slot` (of those,
streams that need a flow slot to open), `later_ready`, `finals_waiting`, `lm_waiting`, `returned` (jobs a
preempted batch handed back), and `phases`: the plan, one [kind, jobs] pair per phase (["opens", n] when it
only opens streams ahead, [] when the worker stays idle).

A busy worker asked to stop (Scheduler.preempt) gives a line with `preempt` (the kind asked), `running` (the
kind of phase then on the worker), `phases_left` (its unstarted phases), `slots_after_batch`, `free_slots`,
`first_ready` and `first_no_slot` as above, and `due_finals` (the batch holds due final passes).

Each phase the worker finishes gives a line with `done` (its kind: `open`, `first`, `chunks`, `final`, ...), `jobs`
and `busy_ms` (the worker's wall time on it); `t` is when it ended, so a phase that holds the worker longer than
its GPU work (say, the opening of new voices) shows between the decisions around it. `passes`, when there are any:
[voices, ms] of each new voices' prompt pass that ended since the previous such line (its GPU time on the prompt
lane: it runs beside the worker).
"""

from __future__ import annotations

import json
import os
from typing import TextIO

from cosystream.engine.scheduler import EngineView, JobView, Plan, Preempt, StreamView

TRACE_ENV = "COSYSTREAM_TRACE"


class DecisionTrace:
    """Appends decision records to a file (engine thread only; line-buffered, so a killed server's trace is
    whole up to its last decision)."""

    def __init__(self, file: TextIO) -> None:
        self.file = file

    @classmethod
    def from_env(cls) -> DecisionTrace | None:
        path = os.environ.get(TRACE_ENV)
        return cls(open(path, "a", buffering=1, encoding="utf-8")) if path else None  # noqa: SIM115

    def write(self, view: EngineView, plan: Plan, returned: int) -> None:
        record = decision_record(view, plan, returned)
        if record is not None:
            self.file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def write_preempt(self, view: EngineView, decision: Preempt, running: str, phases_left: int) -> None:
        self.file.write(json.dumps(preempt_record(view, decision, running, phases_left), separators=(",", ":")) + "\n")

    def write_done(self, kind: str, jobs: int, ended: float, busy_s: float,
                   passes: list[tuple[int, float]] | None = None) -> None:
        record = done_record(kind, jobs, ended, busy_s, passes)
        self.file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self.file.close()


def decision_record(view: EngineView, plan: Plan, returned: int) -> dict | None:
    """The record of one decision; None when nothing was in view to decide on."""
    first_ready = _first_ready(view)
    later_ready = sum(s.ready and not s.first and not s.next_final and not s.planned for s in view.streams)
    finals = sum(s.final_waits and not s.planned for s in view.streams)
    phases: list = [[_phase_kind(phase), len(phase)] for phase in plan.phases]
    if not phases and plan.opens:
        phases = [["opens", sum(len(p) for p in plan.opens)]]
    if not (phases or first_ready or later_ready or finals or returned):
        return None
    return {"t": round(view.now, 6), "streams": len(view.streams), "free_slots": view.free_flow_slots,
            "first_ready": len(first_ready), "first_no_slot": sum(not s.opened and s.needs_slot for s in first_ready),
            "later_ready": later_ready, "finals_waiting": finals, "lm_waiting": view.lm_waiting,
            "returned": returned, "phases": phases}


def preempt_record(view: EngineView, decision: Preempt, running: str, phases_left: int) -> dict:
    """The record of a request to the busy worker to stop (`running`: the kind of its phase on the GPU now)."""
    first_ready = _first_ready(view)
    worker = view.worker
    return {"t": round(view.now, 6), "preempt": decision.value, "running": running, "phases_left": phases_left,
            "slots_after_batch": view.slots_after_batch, "free_slots": view.free_flow_slots,
            "first_ready": len(first_ready), "first_no_slot": sum(not s.opened and s.needs_slot for s in first_ready),
            "due_finals": worker is not None and worker.due_finals}


def done_record(kind: str, jobs: int, ended: float, busy_s: float,
                passes: list[tuple[int, float]] | None = None) -> dict:
    """The record of a phase the worker finished (`kind`: its phase_kind) and of the prompt passes that ended
    meanwhile ((voices, seconds) each)."""
    record: dict = {"t": round(ended, 6), "done": kind, "jobs": jobs, "busy_ms": round(busy_s * 1e3, 3)}
    if passes:
        record["passes"] = [[voices, round(seconds * 1e3, 3)] for voices, seconds in passes]
    return record


def _first_ready(view: EngineView) -> list[StreamView]:
    return [s for s in view.streams if s.first and not s.planned and not s.lm_pending
            and (s.ready or s.missing_tokens == 0)]


def _phase_kind(phase: list[JobView]) -> str:
    if any(job.prompt_pass for job in phase):
        return "prompt"
    if any(job.first for job in phase):
        return "first"
    return "final" if all(job.final for job in phase) else "chunks"
