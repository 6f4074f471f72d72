"""The scheduler's decision trace (COSYSTREAM_TRACE): one JSON line per idle-worker decision, on the fixture
model, whose counts agree with what the engine ran."""

from __future__ import annotations

import json

from cosystream.engine.sync_engine import Engine
from cosystream.engine.trace import TRACE_ENV
from cosystream.params import SamplingParams, SynthesisParams


def test_the_trace_records_the_first_chunk_phase_of_a_request(model_dir, fixture_dir, tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(path))
    eng = Engine.from_pretrained(model_dir, voices_db=str(tmp_path / "v.db"))
    try:
        eng.run(eng.async_engine.add_voice("v", str(fixture_dir / "prompt_24k.wav"), "Hello there."))
        eng.synthesize(SynthesisParams(text="hello there.", voice="v", force_tokens=40,
                                       sampling=SamplingParams(greedy=True, seed=0)))
    finally:
        eng.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    records = [r for r in lines if "done" not in r]
    assert records and all({"t", "streams", "free_slots", "first_ready", "phases"} <= r.keys() for r in records)
    assert [r["t"] for r in lines] == sorted(r["t"] for r in lines)
    firsts = [r for r in records if any(kind == "first" for kind, _ in r["phases"])]
    assert len(firsts) == 1 and firsts[0]["first_ready"] == 1 and firsts[0]["streams"] == 1
    # every phase decided ends in a line of its own, in the order decided, after its decision
    done = [r for r in lines if "done" in r]
    decided = [(kind, n) for r in records for kind, n in r["phases"] if kind != "opens"]
    assert [(r["done"], r["jobs"]) for r in done] == decided
    first_done = next(r for r in done if r["done"] == "first")
    assert first_done["t"] > firsts[0]["t"] and first_done["busy_ms"] > 0
    assert all("passes" not in r for r in done)  # no flow pool on the CPU: no prompt pass beside the worker


def test_a_request_to_stop_the_busy_worker_is_one_line_with_what_asked_for_it(tmp_path):
    """Scheduler.preempt's decisions while the worker runs: which kind, the phase it interrupts, the slots the batch
    gave back and the first chunks waiting, with and without a free slot to open in."""
    import io

    from cosystream.engine.scheduler import EngineView, Preempt, StreamView, WorkerView
    from cosystream.engine.trace import DecisionTrace

    def first(key: str, opened: bool) -> StreamView:
        return StreamView(key=key, arrival_s=9.0, first=True, deadline_s=9.5, opened=opened, needs_slot=not opened)

    view = EngineView(now=10.0, streams=[first("a", False), first("b", True), first("c", False)], free_flow_slots=0,
                      slots_after_batch=3, worker=WorkerView(busy=True, due_finals=False))
    out = io.StringIO()
    DecisionTrace(out).write_preempt(view, Preempt.slot, running="final", phases_left=2)
    record = json.loads(out.getvalue())
    assert record == {"t": 10.0, "preempt": "slot", "running": "final", "phases_left": 2, "slots_after_batch": 3,
                      "free_slots": 0, "first_ready": 3, "first_no_slot": 2, "due_finals": False}


def test_a_done_line_carries_the_prompt_passes_that_ended_with_their_gpu_time(tmp_path):
    import io

    from cosystream.engine.trace import DecisionTrace

    out = io.StringIO()
    trace = DecisionTrace(out)
    trace.write_done("open", 15, 12.5, 0.0351, [(15, 0.0623), (1, 0.0331)])
    trace.write_done("first", 16, 12.6, 0.08)
    with_passes, without = (json.loads(line) for line in out.getvalue().splitlines())
    assert with_passes == {"t": 12.5, "done": "open", "jobs": 15, "busy_ms": 35.1, "passes": [[15, 62.3], [1, 33.1]]}
    assert without == {"t": 12.6, "done": "first", "jobs": 16, "busy_ms": 80.0}
