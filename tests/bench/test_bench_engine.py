"""benchmarks/bench_engine.py against a fake engine: voice registration, levels, refusals, the shared report."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from benchmark_scripts import import_benchmark

from cosystream.errors import Overloaded, UnknownVoice
from cosystream.outputs import AudioChunk, StageTimes
from cosystream.params import SynthesisParams


@pytest.fixture(scope="module")
def bench_engine():
    return import_benchmark("bench_engine")


class FakeEngine:
    """Streams force_tokens * 960 samples in 3 chunks; every 4th request is refused as overloaded."""

    def __init__(self) -> None:
        self.voices: dict[str, tuple[str, str]] = {}
        self.params: list[SynthesisParams] = []

    def get_voice(self, name: str) -> tuple[str, str]:
        if name not in self.voices:
            raise UnknownVoice(f"voice: no voice named {name!r}")
        return self.voices[name]

    async def add_voice(self, name: str, audio: str, prompt_text: str) -> None:
        self.voices[name] = (audio, prompt_text)

    async def synthesize(self, params: SynthesisParams) -> AsyncIterator[AudioChunk]:
        self.params.append(params)
        if len(self.params) % 4 == 0:
            raise Overloaded("queue full", retry_after_s=0.5)
        num_samples = params.force_tokens * 960
        for index, size in enumerate((num_samples // 4, num_samples // 4, num_samples - num_samples // 2)):
            await asyncio.sleep(0.005)
            final = index == 2
            times = StageTimes(total_s=0.015, audio_s=num_samples / 24000) if final else None
            yield AudioChunk(pcm=np.zeros(size, np.float32), index=index, is_final=final, times=times)


async def test_engine_bench_registers_voice_and_reports(bench_engine, tmp_path: Path) -> None:
    args = bench_engine.build_parser().parse_args(
        ["--model-dir", "unused", "--concurrency", "1,2", "--requests-per-level", "4", "--warmup-requests", "0",
         "--force-tokens", "25", "--first-hop", "15"])
    engine = FakeEngine()
    wav = tmp_path / "voice.wav"
    records, summaries = await bench_engine.run(engine, args, wav)
    assert engine.voices == {"bench_voice": (str(wav), "the sun rose slowly.")}
    assert [s.level for s in summaries] == ["c=1", "c=2"]
    for s in summaries:
        assert (s.num_requests, s.num_ok, s.num_refused, s.num_errors, s.num_wrong_length) == (4, 3, 1, 0, 0)
        assert s.first_audio_s is not None and s.aggregate_rtf > 0
    ok = [r for r in records if r.ok]
    assert all(r.audio_s == 1.0 and r.server["total_s"] == 0.015 for r in ok)
    assert sum(r.refused and r.retry_after_s == 0.5 for r in records) == 2
    params = engine.params[0]
    assert (params.voice, params.force_tokens, params.first_hop, params.stream) == ("bench_voice", 25, 15, True)
    assert params.text == "a quiet river flows past the green mill."
    assert await bench_engine.ensure_voice(engine, "bench_voice", wav, "x") == "exists"


@pytest.mark.parametrize("distinct", [False, True])
async def test_prompt_per_request_sends_the_recording_the_same_or_distinct(bench_engine, tmp_path: Path,
                                                                           distinct: bool) -> None:
    """--prompt-per-request: every request carries the recording (the same bytes, which the engine may
    reuse); --distinct-prompts: another recording each time, of the same length, so nothing is reused."""
    wav = tmp_path / "voice.wav"
    wav.write_bytes(b"RIFF" + bytes(range(200)))
    argv = ["--model-dir", "unused", "--concurrency", "2", "--requests-per-level", "4", "--warmup-requests", "1",
            "--prompt-per-request", *(["--distinct-prompts"] if distinct else [])]
    engine = FakeEngine()
    await bench_engine.run(engine, bench_engine.build_parser().parse_args(argv), wav)
    sent = [p.prompt_audio for p in engine.params]
    assert len(sent) == 5 and all(p.voice is None and p.prompt_text for p in engine.params)
    assert {len(a) for a in sent} == {len(wav.read_bytes())}
    assert len(set(sent)) == (5 if distinct else 1)
    assert all(a[:-4] == wav.read_bytes()[:-4] for a in sent)


def test_distinct_prompts_needs_prompt_per_request(bench_engine, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_engine.main(["--model-dir", "unused", "--distinct-prompts"])
    assert exit_info.value.code == 2 and "--distinct-prompts: goes with --prompt-per-request" in capsys.readouterr().err


class CountingEngine(FakeEngine):
    """FakeEngine with the engine's stats(): a counter of the requests it was sent."""

    def stats(self) -> dict[str, float]:
        return {"num_steps": float(len(self.params)), "queue_depth": 0.0}


async def test_busy_logger_keeps_the_engine_stats_of_every_level(bench_engine, tmp_path: Path) -> None:
    """meta.engine_stats: a snapshot at the start and after each level, so a level's counters can be read later."""
    args = bench_engine.build_parser().parse_args(
        ["--model-dir", "unused", "--concurrency", "1,2", "--requests-per-level", "4", "--warmup-requests", "2",
         "--force-tokens", "25"])
    engine, sink, lines = CountingEngine(), [], []
    log = bench_engine._busy_logger(engine, sink)
    await bench_engine.run(engine, args, tmp_path / "voice.wav", log=lambda m: (lines.append(m), log(m)))
    assert [entry["after"] for entry in sink] == ["start"] + [line.splitlines()[0] for line in lines]
    sent = [entry["stats"]["num_steps"] for entry in sink]
    assert sent[0] == 0 and sent[-1] == len(engine.params) == 2 + 4 + 4
    assert len(sink) == 4 and sent[1] == 2  # start, the warm-up line, one line per level
    assert (sent[2] - sent[1], sent[3] - sent[2]) == (4, 4)
    assert all(entry["wall_s"] >= 0 for entry in sink)


def test_the_busy_line_reports_new_recordings_and_their_batched_prompt_passes(bench_engine) -> None:
    before = {"upload_cache_misses": 2.0, "upload_cache_hits": 1.0, "prompt_analysis_prompts": 2.0,
              "prompt_analysis_batches": 2.0, "prompt_analysis_largest_batch": 1.0, "flow_prompts_built": 2.0,
              "flow_prompt_build_calls": 2.0, "flow_prompt_build_largest": 1.0}
    after = {**before, "upload_cache_misses": 18.0, "upload_cache_hits": 5.0, "prompt_analysis_prompts": 18.0,
             "prompt_analysis_batches": 4.0, "prompt_analysis_largest_batch": 8.0, "flow_prompts_built": 18.0,
             "flow_prompt_build_calls": 5.0, "flow_prompt_build_largest": 6.0}
    line = bench_engine._busy_line(before, after, 1.0)
    assert ("new recordings: 16 analysed (16 in 2 GPU batches, largest so far 8), 4 reused; "
            "flow prompt passes: 16 prompts in 3 calls (largest so far 6)") in line
    assert "new recordings" not in bench_engine._busy_line(before, before, 1.0)  # registered voices only
