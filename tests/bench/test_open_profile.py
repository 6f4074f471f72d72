"""benchmarks/open_profile.py runs on the CPU with a fixture model: waves of requests with new recordings, the
worker's openings and chunk phases measured on its thread."""

from __future__ import annotations

import json

from benchmark_scripts import import_benchmark


def test_open_profile_measures_each_wave_s_openings_and_chunk_phases(model_dir, tmp_path, capsys):
    bench = import_benchmark("open_profile")
    out = tmp_path / "open.json"
    assert bench.main(["--model-dir", str(model_dir), "--device", "cpu", "--dtype", "float32", "--streams", "3",
                       "--waves", "2", "--force-tokens", "12", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["waves"]) == 2
    for wave in report["waves"]:
        assert len(wave["first_audio_ms"]) == 3
        opens = [call for call in wave["calls"] if call["call"] == "open_streams"]
        assert sum(call["items"] for call in opens) == 3  # every new voice's stream opened once
        assert any(call["call"] == "run" for call in wave["calls"])
        for call in opens:
            # the parts are timed inside the call on the worker thread: none outlasts it
            assert all(0 <= ms <= call["wall_ms"] for ms in call["parts"].values())
            assert call["syncs"] == []  # counted on CUDA only
    assert "open_streams of" in capsys.readouterr().out
