"""`cosystream bench --procs N`: a level's streams or arrivals split over client processes, merged back."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from test_loadgen import run_cli

from cosystream.bench.clients import RequestSpec
from cosystream.bench.loadgen import LevelPlan
from cosystream.bench.procs import ClientJob, run_level_in_processes, split_plan

FakeServer = Any  # conftest.FakeServer


def test_closed_levels_split_streams_and_requests_to_add_up():
    shares = split_plan(LevelPlan("concurrency", 16, max_requests=80), 4)
    assert [(s.value, s.max_requests) for s in shares] == [(4, 20)] * 4
    shares = split_plan(LevelPlan("concurrency", 5, max_requests=10), 4)
    assert [s.value for s in shares] == [2, 1, 1, 1] and [s.max_requests for s in shares] == [4, 2, 2, 2]
    shares = split_plan(LevelPlan("concurrency", 2, duration_s=5.0), 4)  # more processes than streams
    assert [(s.value, s.max_requests, s.duration_s) for s in shares] == [(1, None, 5.0)] * 2
    assert all(s.label == f"c={int(s.value)}" for s in shares)


def test_open_levels_split_the_rate_and_the_count():
    shares = split_plan(LevelPlan("rate", 15.0, max_requests=7, duration_s=10.0), 3)
    assert [s.value for s in shares] == [5.0] * 3 and [s.max_requests for s in shares] == [3, 2, 2]
    assert sum(s.max_requests for s in split_plan(LevelPlan("rate", 2.0, max_requests=1), 3)) == 1
    with pytest.raises(ValueError, match="procs: must be >= 1, got 0"):
        split_plan(LevelPlan("rate", 1.0, max_requests=4), 0)


def test_cli_procs_merges_every_process_records_into_one_level(fake_server: FakeServer, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    code = run_cli("--url", fake_server.url, "--text", "fast procs.", "--concurrency", "4", "--requests-per-level",
                   "12", "--warmup-requests", "1", "--procs", "2", "--out", str(out))
    assert code == 0
    data = json.loads(out.read_text())
    level = [r for r in data["requests"] if r["level"] == "c=4"]
    assert len(level) == 12 and sorted(r["index"] for r in level) == list(range(12))
    assert all(r["error"] is None and r["audio_s"] == pytest.approx(1.0) for r in level)
    starts = [r["start_s"] for r in level]
    assert starts == sorted(starts)  # numbered by send time, over both processes
    assert data["meta"]["client_procs"] == 2 and data["levels"][0]["num_ok"] == 12
    assert run_cli("--text", "x.", "--procs", "0") == 2


async def test_stopping_a_level_stops_every_process(fake_server: FakeServer) -> None:
    job = ClientJob(fake_server.url, "tts", RequestSpec(texts=("hang procs.",)), 30.0, time.perf_counter(),
                    LevelPlan("concurrency", 2, max_requests=2), 0)
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(3.0, stop.set)  # after the processes are up and their requests hang
    t0 = time.perf_counter()
    records, interrupted = await run_level_in_processes(job, 2, stop)
    assert interrupted and records == []  # in-flight requests are cancelled and left out, as in one process
    assert time.perf_counter() - t0 < 20.0  # not the 10 s hang of each request, nor the 30 s timeout
