"""benchmarks/soak.py: its checks catch what they are for, and a short soak on the tiny model passes them all."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import soundfile as sf
from benchmark_scripts import import_benchmark


@pytest.fixture(scope="module")
def soak():
    return import_benchmark("soak")


def _sample(soak, t_s: float, rss_mb: float, fds: int = 20, threads: int = 10, **engine: float):
    gauges = {"num_active": 0.0, "queue_depth": 0.0, "num_free_slots": 8.0, "num_flow_slots": 0.0,
              "num_free_flow_slots": 0.0, "num_voice_prompts": 1.0, **engine}
    return soak.Sample(t_s, int(rss_mb * 2**20), fds, threads, True, gauges)


def test_checks_flag_growth_errors_and_a_busy_engine(soak):
    args = soak.parse_args(["--minutes", "1", "--warmup-s", "10"])
    tally = soak.Tally()
    for kind in soak.KINDS:
        tally.record(kind, "completed")
    samples = [_sample(soak, 0, 500), *(_sample(soak, 10 + t, 800 + 40 * (t % 2)) for t in range(9))]
    assert all(soak.checks(args, tally, samples, _sample(soak, 60, 820)).values())  # warm-up growth, noise: fine
    leaking = [*samples[:4], *(_sample(soak, 20 + t, 900 + 10 * t) for t in range(6))]
    assert not soak.checks(args, tally, leaking, _sample(soak, 60, 960))["rss_flat"]
    grown = soak.checks(args, tally, samples, _sample(soak, 60, 900, fds=40, threads=20, num_active=1.0))
    assert not grown["fds_flat"] and not grown["threads_flat"]
    assert not grown["engine_idle"]
    tally.record("tts", "incomplete pcm: 10 bytes, expected 20")
    assert not soak.checks(args, tally, samples, _sample(soak, 60, 820))["no_errors"]


def test_stream_checks_need_every_sample(soak):
    assert soak.whole_pcm(b"\0" * 2 * 960 * 5, 5) == "completed"
    assert soak.whole_pcm(b"\0" * (2 * 960 * 5 - 2), 5).startswith("incomplete")
    out = io.BytesIO()
    sf.write(out, np.zeros(960 * 5, np.float32), 24000, format="WAV", subtype="PCM_16")
    assert soak.whole_wav(out.getvalue(), 5) == "completed"
    assert soak.whole_wav(out.getvalue(), 6).startswith("wrong wav")
    assert soak.whole_wav(out.getvalue()[:30], 5).startswith("invalid wav")


@pytest.mark.slow  # ~20 s of load by design, after a 6 s warm-up and a server start in a subprocess
def test_a_short_soak_passes_every_check(soak, model_dir, tmp_path):
    """The CI form: ~20 s of mixed load with hang-ups against the real server (a subprocess)."""
    out = tmp_path / "soak.json"
    status = soak.main(["--minutes", "0.3", "--concurrency", "4", "--disconnect-prob", "0.4",
                        "--model-dir", str(model_dir), "--warmup-s", "6", "--sample-s", "2",
                        "--max-rss-growth-mb", "256", "--json", str(out)])
    result = json.loads(out.read_text())
    assert status == 0, (result["checks"], result["error_samples"])
    assert result["completed"] > 0 and result["disconnects"] > 0 and result["errors"] == 0
    assert result["end"]["engine"]["num_free_slots"] == result["config"]["max_streams"]
