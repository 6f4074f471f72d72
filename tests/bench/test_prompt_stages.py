"""benchmarks/prompt_stages.py runs on the CPU with a fixture model: one new recording's analysis stage by stage,
and the frontend stage of an in-process engine split at its calls."""

from __future__ import annotations

import io
import json

import pytest
import soundfile as sf
from benchmark_scripts import import_benchmark

STAGES = ("decode", "upload", "resample", "whisper_log_mel", "speech_tokenizer", "fbank", "campplus", "prompt_mel",
          "copies_back")


def test_recordings_are_new_lengths_around_the_asked_one():
    bench = import_benchmark("prompt_stages")
    new = bench.recordings(2.0, 24000)
    lengths = [sf.info(io.BytesIO(next(new))).frames for _ in range(7)]
    assert len(set(lengths)) == len(lengths)  # every one a length not seen before
    assert all(abs(n - 48000) <= 4 * 240 for n in lengths)  # 10 ms steps on both sides of 2 s
    with pytest.raises(RuntimeError, match="too short"):
        short = bench.recordings(0.52, 24000)
        for _ in range(10):
            next(short)


def test_prompt_stages_reports_each_stage_and_the_engine_split(model_dir, tmp_path, capsys):
    bench = import_benchmark("prompt_stages")
    out = tmp_path / "stages.json"
    repeats = 1
    assert bench.main(["--model-dir", str(model_dir), "--device", "cpu", "--seconds", "1.5", "--repeats",
                       str(repeats), "--engine", "--dtype", "float32", "--force-tokens", "10", "--warmup", "1",
                       "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    one = report["one_prompt"]
    assert all(one[name] >= 0 for name in STAGES)
    assert one["stages_sum"] == pytest.approx(sum(one[name] for name in STAGES), abs=1e-2)
    for name in ("analyse", "batcher", "voice_prompt", "via_pool"):
        assert one[name] > 0
    assert one["host_syncs"] == []  # counted on CUDA only
    assert one["batches"] == 2 + 3 * repeats  # warm-up, then batcher, voice_prompt and via_pool: each its own batch
    engine = report["engine"]
    # a CPU engine analyses with onnxruntime on its frontend thread: no hand-offs to the analysis thread
    assert "onnx_analysis_transcript" in engine and "to_analysis" not in engine
    steps = [engine[name] for name in ("admit", "to_thread", "decode", "onnx_analysis_transcript",
                                       "request", "to_loop")]
    assert all(step >= 0 for step in steps)
    assert engine["submit_to_core"] >= max(steps)
    assert engine["engine_frontend"] > 0
    printed = capsys.readouterr().out
    assert "speech_tokenizer" in printed and "submit_to_core" in printed
