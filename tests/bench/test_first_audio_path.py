"""benchmarks/first_audio_path.py: the first-audio path of each level from the requests' stage times, and the worker's
record of the level from the engine stats before and after it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from benchmark_scripts import import_benchmark


@pytest.fixture(scope="module")
def path_report():
    return import_benchmark("first_audio_path")


def _server(frontend: float, ready: float, start: float) -> dict:
    return {"frontend_s": frontend, "queue_s": 0.001, "first_token_s": 0.002, "first_chunk_ready_s": ready,
            "first_chunk_start_s": start, "first_chunk_flow_s": 0.02, "first_chunk_vocoder_s": 0.003,
            "first_audio_s": start + 0.023}


def _doc() -> dict:
    requests = [{"level": "warmup", "error": None, "server": _server(1.0, 2.0, 3.0)}]
    requests += [{"level": "c=1", "error": None, "server": _server(f, r, s)}
                 for f, r, s in ((0.030, 0.060, 0.080), (0.040, 0.062, 0.070), (0.035, 0.061, 0.090))]
    requests.append({"level": "c=1", "error": "boom", "server": _server(9.0, 9.0, 9.0)})
    before = {"flow_prompts_built": 3.0, "flow_prompt_build_calls": 3.0, "decode_step_seconds_beside_open": 0.1,
              "decode_steps_beside_open": 100.0, "token2wav_calls_ode_1x250": 3.0,
              "token2wav_calls_ode_1x250_seconds": 0.09}
    after = {"flow_prompts_built": 7.0, "flow_prompt_build_calls": 6.0, "decode_step_seconds_beside_open": 0.26,
             "decode_steps_beside_open": 260.0, "token2wav_calls_ode_1x250": 7.0,
             "token2wav_calls_ode_1x250_seconds": 0.218, "token2wav_calls_ode_2x100": 2.0,
             "token2wav_calls_ode_2x100_seconds": 0.05}
    snapshots = [{"after": "warm-up: 3 requests", "wall_s": 1.0, "stats": before},
                 {"after": "c=1: 3/3 ok", "wall_s": 2.0, "stats": after}]
    return {"meta": {"commit": "abc1234", "device": "test", "engine_stats": snapshots}, "requests": requests}


def test_stage_medians_skip_warm_up_and_failed_requests(path_report, tmp_path: Path) -> None:
    doc = _doc()
    measured = [r for r in doc["requests"] if r["level"] == "c=1" and r["error"] is None]

    medians = path_report.stage_medians(measured)

    assert medians["analysis"] == pytest.approx(0.035)
    assert medians["LM start"] == pytest.approx(0.036)
    assert medians["first token"] == pytest.approx(0.038)
    assert medians["tokens ready"] == pytest.approx(0.061)
    assert medians["waited"] == pytest.approx(0.020)  # of 0.020, 0.008, 0.029


def test_the_worker_lines_are_the_levels_differences(path_report, tmp_path: Path) -> None:
    zipped = tmp_path / "zs.json.gz"
    with gzip.open(zipped, "wt") as f:
        json.dump(_doc(), f)

    lines = path_report.report(zipped)

    row = next(line for line in lines if line.startswith("| c=1 |"))
    assert row.split(" | ")[1] == "3"  # the failed request and the warm-up are left out
    text = "\n".join(lines)
    assert "1x250: 4, 32.0" in text  # (0.218 - 0.09) s over 4 calls
    assert "2x100: 2, 25.0" in text
    assert "4 built in 3 calls; open in flight 40.0 ms per pass" in text  # 0.16 s over 4 passes
    assert "the LM decoded 40 steps" in text
