"""Stage times of token-to-wave batches: laps add up per stage and reach the engine's stats."""

from __future__ import annotations

import time

import torch

from cosystream.engine.stopwatch import Stopwatch
from cosystream.params import SynthesisParams


def test_laps_accumulate_per_stage_across_batches():
    watch = Stopwatch(torch.device("cpu"))
    for _ in range(2):
        watch.start()
        time.sleep(0.01)
        watch.lap("flow")
        watch.lap("vocoder")
        watch.settle()
    stats = watch.stats()
    assert stats["token2wav_flow_host_seconds"] >= 0.02
    assert stats["token2wav_vocoder_host_seconds"] < 0.01
    assert stats["token2wav_flow_gpu_seconds"] == stats["token2wav_flow_host_seconds"]  # no GPU: host clock


def test_tagged_laps_count_calls_and_their_time_per_tag():
    watch = Stopwatch(torch.device("cpu"))
    for tag in ("ode_1x100", "ode_1x100", "ode_4x200"):
        watch.start()
        time.sleep(0.005)
        watch.lap("ode", tag=tag)
        watch.count("run_with_1_ode_groups")
        watch.settle()
    stats = watch.stats()
    assert stats["token2wav_calls_ode_1x100"] == 2.0 and stats["token2wav_calls_ode_4x200"] == 1.0
    tagged = stats["token2wav_calls_ode_1x100_seconds"] + stats["token2wav_calls_ode_4x200_seconds"]
    assert abs(tagged - stats["token2wav_ode_gpu_seconds"]) < 1e-9  # the tags split the stage's time
    assert stats["token2wav_calls_run_with_1_ode_groups"] == 3.0
    assert "token2wav_calls_run_with_1_ode_groups_seconds" not in stats  # counted, never timed


def test_laps_without_a_started_batch_are_ignored():
    watch = Stopwatch(torch.device("cpu"))
    watch.lap("flow")
    watch.settle()
    assert watch.stats() == {}


def test_engine_stats_split_token2wav_time_into_stages(engine, fixture_dir):
    before = engine.async_engine.stats()
    engine.synthesize(SynthesisParams(text="a line to time.", prompt_audio=str(fixture_dir / "prompt_24k.wav"),
                                      prompt_text="Hello there.", force_tokens=30))
    after = engine.async_engine.stats()
    grew = {k for k in after if k.endswith("_host_seconds") and after[k] > before.get(k, 0.0)}
    # the CPU has no flow pool: chunks run on the per-request flow
    assert {"token2wav_open_host_seconds", "token2wav_eager_flow_host_seconds",
            "token2wav_vocoder_host_seconds", "token2wav_to_host_host_seconds"} <= grew
    staged = sum(after[k] - before.get(k, 0.0) for k in after if k.endswith("_host_seconds"))
    busy = after["token2wav_busy_seconds"] - before["token2wav_busy_seconds"]
    assert 0 < staged <= busy + 1e-3
    assert 0 <= after["token2wav_due_final_seconds"] <= after["token2wav_final_seconds"]
