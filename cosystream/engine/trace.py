"""A developer's trace of the scheduler's decisions: `COSYSTREAM_TRACE=<file>` writes one JSON line per
decision the idle worker waits on (engine/voicing.py), so that a run under load shows where first chunks
wait: for a flow slot, for the worker, or for the scheduler's choice.

Each line: `t` (perf_counter seconds), `streams`, `free_slots` (flow slots free, null without a pool),
`first_ready` (first chunks whose tokens are all there and that are not planned), `first_no_slot` (of those,
streams that need a flow slot to open), `later_ready`, `finals_waiting`, `lm_waiting`, `returned` (jobs a
preempted batch handed back), and `phases`: the plan, one [kind, jobs] pair per phase ("opens" when it only
opens streams ahead, [] when the worker stays idle).
"""

from __future__ import annotations

import json
import logging
import os

from cosystream.engine.scheduler import EngineView, Plan

TRACE_ENV = "COSYSTREAM_TRACE"


def decision_record(view: EngineView, plan: Plan, returned: int) -> str:
    first_ready = [s for s in view.streams if s.first and not s.planned and (s.ready or s.missing_tokens == 0)
                   and not s.lm_pending]
    phases: list = [[_phase_kind(phase), len(phase)] for phase in plan.phases]
    if not phases and plan.opens:
        phases = [["opens", sum(len(p) for p in plan.opens)]]
    return json.dumps({
        "t": round(view.now, 6), "streams": len(view.streams), "free_slots": view.free_flow_slots,
        "first_ready": len(first_ready), "first_no_slot": sum(not s.opened and s.needs_slot for s in first_ready),
        "later_ready": sum(s.ready and not s.first and not s.next_final and not s.planned for s in view.streams),
        "finals_waiting": sum(s.final_waits and not s.planned for s in view.streams),
        "lm_waiting": view.lm_waiting, "returned": returned, "phases": phases,
    }, separators=(",", ":"))


def _phase_kind(phase: list) -> str:
    if any(job.prompt_pass for job in phase):
        return "prompt"
    if any(job.first for job in phase):
        return "first"
    return "final" if all(job.final for job in phase) else "chunks"


def trace_to_env_file() -> None:
    """Send the decision trace to the file COSYSTREAM_TRACE names (nothing when it is unset)."""
    path = os.environ.get(TRACE_ENV)
    logger = logging.getLogger("cosystream.engine.trace")
    if not path or any(getattr(h, "cosystream_trace", False) for h in logger.handlers):
        return
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.cosystream_trace = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
