"""benchmarks/trace_stream.py on the CPU with the fixture model: a lone request's timeline is complete and in
the order the engine works (tokens, then the chunk's job on the worker, then its audio)."""

from __future__ import annotations

import argparse
import asyncio
import re
from pathlib import Path

import pytest
from benchmark_scripts import import_benchmark


@pytest.fixture(scope="module")
def trace_stream():
    return import_benchmark("trace_stream")


def _events(text: str) -> list[tuple[float, str, str]]:
    return [(float(t), kind, detail) for t, kind, detail in
            re.findall(r"^\s*([\d.]+) ms\s+(\w+)\s+(.*)$", text, flags=re.MULTILINE)]


@pytest.mark.slow  # ~9 s: a benchmark script end to end
def test_a_lone_request_timeline(trace_stream, model_dir: Path, capsys) -> None:
    args = argparse.Namespace(model_dir=str(model_dir), device="cpu", dtype="float32", requests=1, warmup=0,
                              first_hop=None, token_marks="28,78,178,250", config=[])
    asyncio.run(trace_stream.amain(args))
    events = _events(capsys.readouterr().out)
    times = [t for t, _, _ in events]
    assert times == sorted(times)
    # the official schedule of 250 forced tokens: chunks of 25, 50, 100 tokens (each + 3 look-ahead), then 75
    jobs = [detail for _, kind, detail in events if kind == "job_start"]
    assert jobs == ["[(0, 25, False, 28)]", "[(1, 50, False, 78)]", "[(2, 100, False, 178)]",
                    "[(3, 75, True, 250)]"]
    audio = [detail for _, kind, detail in events if kind == "audio"]
    assert len(audio) == 4 and audio[-1].endswith("True)")
    assert sum(int(a.split(",")[1]) for a in audio) == 250 * 960  # 10 s at 24 kHz, all of it
    for index, job in enumerate(jobs):  # each job starts after its tokens exist and ends before its audio
        needed = int(job.rstrip(")]").split(",")[-1])
        t_tokens = next(t for t, kind, d in events if kind == "tokens" and int(d) == needed)
        t_start = next(t for t, kind, d in events if kind == "job_start" and d == job)
        t_end = next(t for t, kind, d in events if kind == "job_end" and d == job)
        t_audio = next(t for t, kind, d in events if kind == "audio" and d.startswith(f"({index},"))
        assert t_tokens <= t_start <= t_end <= t_audio
