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
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records and all({"t", "streams", "free_slots", "first_ready", "phases"} <= r.keys() for r in records)
    assert [r["t"] for r in records] == sorted(r["t"] for r in records)
    firsts = [r for r in records if any(kind == "first" for kind, _ in r["phases"])]
    assert len(firsts) == 1 and firsts[0]["first_ready"] == 1 and firsts[0]["streams"] == 1
