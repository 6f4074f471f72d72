"""The worker's side of a batch (engine/chunk_worker.py) with a stand-in runner: streams opening together
get their prompt states in one call, and riders of a first chunks' call are found past a phase of prompt
passes."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import torch

from cosystream.engine.chunk_worker import ChunkJob, _riders, run_jobs, stop_test
from cosystream.engine.chunking import ChunkPlan
from cosystream.engine.stopwatch import Stopwatch

CPU = torch.device("cpu")


class _Runner:
    """Records what run_jobs asks of a token-to-wave runner."""

    def __init__(self, refuse: str | None = None) -> None:
        self.watch = Stopwatch(CPU)
        self.calls: list[list[str]] = []
        self.refuse = refuse

    def open_streams(self, items: list[dict[str, Any]]) -> list[Any]:
        self.calls.append([item["voice_key"] for item in items])
        return [RuntimeError("out of memory") if item["voice_key"] == self.refuse else f"state:{item['voice_key']}"
                for item in items]

    def opened(self) -> None:
        pass

    def flow_group(self, state: Any, plan: ChunkPlan) -> Any:
        return state.group


def _plan(final: bool = False) -> ChunkPlan:
    return ChunkPlan(index=0, offset=0, num_new=25, token_end=28, is_final=final)


def _opening(key: str) -> ChunkJob:
    return ChunkJob(req=None, seg=None, plan=None, open_args=dict(inputs=key, voice_key=key, stored=None))


def test_streams_opening_together_open_in_one_call():
    runner = _Runner()
    jobs = [_opening("a"), _opening("b"), _opening("c")]
    assert run_jobs(runner, jobs) == [None, None, None]  # opened, nothing voiced
    assert runner.calls == [["a", "b", "c"]]
    assert [job.state for job in jobs] == ["state:a", "state:b", "state:c"] and all(j.error is None for j in jobs)


def test_a_stream_that_cannot_open_fails_alone():
    runner = _Runner(refuse="b")
    jobs = [_opening("a"), _opening("b"), _opening("c")]
    run_jobs(runner, jobs)
    assert [job.state for job in jobs] == ["state:a", None, "state:c"]
    assert [type(job.error) for job in jobs] == [type(None), RuntimeError, type(None)]


def test_riders_are_taken_from_the_chunks_after_a_phase_of_prompt_passes():
    def chunk(group: str, first: bool = False) -> ChunkJob:
        return ChunkJob(req=None, seg=None, plan=_plan(), state=SimpleNamespace(group=group), first=first)

    first, same, other = chunk("g", first=True), chunk("g"), chunk("h")
    prompts = [_opening("p")]
    phases = [[first], prompts, [same, other]]
    assert _riders(_Runner(), phases, 0) == [same]
    assert phases == [[first], prompts, [other]]  # the prompt passes stay a phase of their own
    lone = [[chunk("g", first=True)], [_opening("q")]]
    assert _riders(_Runner(), lone, 0) == [] and len(lone) == 2


def test_a_phase_of_final_passes_pauses_for_what_may_pause_it_only():
    """Due passes give way only to a client about to run dry; passes not due also to a first chunk (pause);
    a request only to stop after the running phase (a first chunk waiting for a slot) pauses neither."""
    def job(due: bool) -> ChunkJob:
        final = ChunkJob(SimpleNamespace(), SimpleNamespace(), None)
        final.pausable, final.due = True, due
        return final

    worker = SimpleNamespace(preempt=threading.Event(), pause=threading.Event(), dry=threading.Event())
    not_due, due = stop_test(worker, [job(False)]), stop_test(worker, [job(False), job(True)])
    worker.preempt.set()
    assert not not_due() and not due()
    worker.pause.set()
    assert not_due() and not due()
    worker.dry.set()
    assert due()
    chunk = ChunkJob(SimpleNamespace(), SimpleNamespace(), None)
    assert stop_test(worker, [chunk]) is None and stop_test(None, [job(False)]) is None
