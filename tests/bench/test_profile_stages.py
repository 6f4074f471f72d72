"""benchmarks/profile_stages.py runs its LM and token-to-wave measures on the fixture model (CPU, eager), so a
change to the runners' entry points cannot leave the stage profiler broken until a GPU run finds it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from benchmark_scripts import import_benchmark


@pytest.mark.slow  # ~8 s: a benchmark script
def test_profile_stages_measures_every_stage_on_the_cpu(model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    profile = import_benchmark("profile_stages")
    out = tmp_path / "stages.json"
    monkeypatch.setattr(sys, "argv", ["profile_stages.py", "--model-dir", str(model_dir), "--device", "cpu",
                                      "--dtype", "float32", "--batches", "1,2", "--iters", "1", "--no-graphs",
                                      "--json", str(out)])
    profile.main()
    results = json.loads(out.read_text())
    for measure in ("prefill_212_ms", "decode_b1_ms", "decode_b2_ms", "prompt_cache_ms", "first_chunk_b1_ms",
                    "first_chunk_b2_ms", "hift_108_b1_ms", "flow_offline_800_frames_ms"):
        assert results[measure] > 0, measure
    assert results["prefill_kernels"] == 0  # kernels are counted on CUDA only
