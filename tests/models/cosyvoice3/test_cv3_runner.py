"""The CosyVoice3 token-to-wave runner driven by the engine's own chunk planner, against the official chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosystream.config import ChunkSchedule
from cosystream.engine.chunking import ChunkPlan, ChunkPlanner
from cosystream.engine.cv3_token2wav import CV3Token2WavRunner
from cosystream.frontend.prompt import ModelInputs
from cosystream.models.cosyvoice3.hift import HiftStream

AUDIO_ATOL = 5e-3  # README §C3: e2e streamed audio per call

pytestmark = pytest.mark.parity


def _inputs(e2e: dict, src: str) -> ModelInputs:
    return ModelInputs(mode="zero_shot", text_ids=e2e[f"{src}_in_text"][0] if f"{src}_in_text" in e2e else
                       torch.zeros(0, dtype=torch.int32),
                       xvector=e2e[f"{src}_in_flow_embedding"][0],
                       flow_prompt_speech_tokens=e2e[f"{src}_in_flow_prompt_speech_token"][0],
                       prompt_mel=e2e[f"{src}_in_prompt_speech_feat"][0])


@pytest.mark.parametrize("mode", ["zero_shot", "vc_long"])
def test_runner_with_the_engine_planner_reproduces_the_official_chunks(cv3_flow, cv3_hift, cv3_load,
                                                                        cv3_manifest, mode):
    e2e, run = cv3_load("e2e"), cv3_manifest["e2e"][mode]
    src = run.get("prompt_inputs_from", mode)
    inputs = _inputs(e2e, src)
    tokens = e2e[f"{mode}_speech_tokens"][0].tolist()
    runner = CV3Token2WavRunner(cv3_flow, cv3_hift)
    assert not runner.has_prompt("voice-a")
    state = runner.start(inputs, voice_key="voice-a")  # a registered voice: its prompt blocks are encoded once
    assert runner.has_prompt("voice-a")
    planner = ChunkPlanner(ChunkSchedule(), inputs.flow_prompt_speech_tokens.numel(),
                           block=cv3_flow.decoder.estimator.dims.static_chunk_size // cv3_flow.ratio)
    i = 0
    while (plan := planner.next_plan(len(tokens), done=True)) is not None:
        official = run["schedule"][i]
        assert (plan.token_end, plan.offset, plan.is_final) == (official["n_tokens"], official["token_offset"],
                                                                official["finalize"])
        [(pcm, flow_s, vocoder_s)] = runner.run([(state, tokens, plan)])
        assert flow_s >= 0 and vocoder_s >= 0
        np.testing.assert_allclose(pcm, e2e[f"{mode}_call{i}_yield"][0].numpy(), rtol=0, atol=AUDIO_ATOL)
        i += 1
    assert i == len(run["schedule"])
    runner.forget_voice("voice-a")
    assert not runner.has_prompt("voice-a")
    with pytest.raises(RuntimeError, match="finished"):
        runner.run([(state, tokens, ChunkPlan(i, 0, len(tokens), len(tokens), is_final=True))])


def test_speed_needs_a_non_streaming_request(cv3_flow, cv3_hift, cv3_load):
    e2e = cv3_load("e2e")
    runner = CV3Token2WavRunner(cv3_flow, cv3_hift)
    tokens = e2e["zero_shot_speech_tokens"][0].tolist()
    planner = ChunkPlanner(ChunkSchedule(), e2e["zero_shot_in_flow_prompt_speech_token"].shape[1])
    state = runner.start(_inputs(e2e, "zero_shot"), None, speed=1.5)
    with pytest.raises(ValueError, match="speed"):
        runner.run([(state, tokens, planner.next_plan(len(tokens), done=True))])
    offline = ChunkPlanner(ChunkSchedule(), 10, stream=False).next_plan(len(tokens), done=True)
    state = runner.start(_inputs(e2e, "zero_shot"), None, speed=1.5)
    [(pcm, _, _)] = runner.run([(state, tokens, offline)])
    assert pcm.shape[0] == 480 * int(2 * len(tokens) / 1.5)


def test_a_speed_changed_stream_holds_its_slot_and_gives_it_back(cv3_flow, cv3_hift, cv3_load):
    e2e = cv3_load("e2e")
    tokens = e2e["zero_shot_speech_tokens"][0].tolist()
    runner = CV3Token2WavRunner(cv3_flow, cv3_hift, flow_slots=1, slot_frames=cv3_flow.ratio * (
        e2e["zero_shot_in_flow_prompt_speech_token"].shape[1] + len(tokens)) + 64)
    plain = CV3Token2WavRunner(cv3_flow, cv3_hift)
    offline = ChunkPlanner(ChunkSchedule(), 10, stream=False).next_plan(len(tokens), done=True)
    state = runner.start(_inputs(e2e, "zero_shot"), None, speed=1.5)
    assert runner.free_slots() == 0 and not runner.can_start(_inputs(e2e, "zero_shot"), 256)
    [(pcm, _, _)] = runner.run([(state, tokens, offline)])
    [(want, _, _)] = plain.run([(plain.start(_inputs(e2e, "zero_shot"), None, speed=1.5), tokens, offline)])
    np.testing.assert_array_equal(pcm, want)  # the eager whole-utterance path, as without a pool
    assert runner.free_slots() == 1


def _runs(e2e: dict, manifest: dict) -> list[tuple[str, ModelInputs, list[int], list[dict]]]:
    out = []
    for mode, run in manifest["e2e"].items():
        out.append((mode, _inputs(e2e, run.get("prompt_inputs_from", mode)), e2e[f"{mode}_speech_tokens"][0].tolist(),
                    run["schedule"]))
    return out


@pytest.mark.parametrize("slot_room", ["whole", "short"])
def test_pooled_streams_voiced_together_reproduce_the_official_chunks(cv3_flow, cv3_hift, cv3_load, cv3_manifest,
                                                                       slot_room):
    """Every e2e run of the set as one stream each, their chunks in shared `run` calls (batched in the
    pool); "short": slots too small for the longest run, which leaves the pool mid-utterance."""
    e2e = cv3_load("e2e")
    runs = _runs(e2e, cv3_manifest)
    block = cv3_flow.decoder.estimator.dims.static_chunk_size
    prompt_frames = max(inputs.prompt_mel.shape[0] for _, inputs, _, _ in runs)
    longest = max(cv3_flow.ratio * (inputs.flow_prompt_speech_tokens.numel() + len(tokens))
                  for _, inputs, tokens, _ in runs)
    frames = longest if slot_room == "whole" else prompt_frames + 4 * block
    runner = CV3Token2WavRunner(cv3_flow, cv3_hift, flow_slots=len(runs), slot_frames=frames)
    assert runner.flow_slots() == runner.free_slots() == len(runs)
    assert runner.pool.scratch == len(runs) and runner.pool.free == list(range(len(runs)))  # engine/accounting.py
    states, planners = [], []
    for mode, inputs, _, _ in runs:
        assert runner.needs_slot(inputs, 256) and runner.can_start(inputs, 256)
        states.append(runner.start(inputs, voice_key=f"voice-{mode}" if len(states) % 2 else None))
        planners.append(ChunkPlanner(ChunkSchedule(), inputs.flow_prompt_speech_tokens.numel(),
                                     block=block // cv3_flow.ratio))
    assert runner.free_slots() == 0 and not runner.can_start(runs[0][1], 256)
    calls = [0] * len(runs)
    while True:
        jobs, who = [], []
        for i, (_, _, tokens, _) in enumerate(runs):
            plan = planners[i].next_plan(len(tokens), done=True) if not states[i].finished else None
            if plan is not None:
                jobs.append((states[i], tokens, plan))
                who.append(i)
        if not jobs:
            break
        for i, (pcm, _, _) in zip(who, runner.run(jobs), strict=True):
            mode = runs[i][0]
            np.testing.assert_allclose(pcm, e2e[f"{mode}_call{calls[i]}_yield"][0].numpy(), rtol=0, atol=AUDIO_ATOL)
            calls[i] += 1
    assert calls == [len(schedule) for _, _, _, schedule in runs]
    assert runner.free_slots() == len(runs)  # every final chunk gave its slot back
    assert runner.pooled_chunks >= len(runs)
    assert (runner.pool_exits > 0) == (slot_room == "short")


def test_vocoder_windows_of_several_streams_run_together(cv3_flow, cv3_hift, cv3_load, cv3_manifest, monkeypatch):
    """Every e2e run twice (so windows of equal shape share a batch), fed the official per-call mels: the
    batched windows (non-final ones padded on the right to a block multiple) give each stream the samples
    its own `HiftStream` gives, and the official ones."""
    e2e = cv3_load("e2e")
    runner = CV3Token2WavRunner(cv3_flow, cv3_hift)
    shapes = []
    window_key = CV3Token2WavRunner._window_key

    def spy(self, window):
        shape = window_key(self, window)
        shapes.append((window.key[0], shape[0]))
        return shape

    monkeypatch.setattr(CV3Token2WavRunner, "_window_key", spy)
    streams = []
    for mode, inputs, _, schedule in _runs(e2e, cv3_manifest) * 2:
        streams.append((mode, runner.start(inputs, None), HiftStream(cv3_hift), schedule))
    with torch.inference_mode():
        for r in range(max(len(schedule) for *_, schedule in streams)):
            live = [s for s in streams if r < len(s[3])]
            items = [(state, e2e[f"{mode}_call{r}_flow_mel_new"], schedule[r]["finalize"])
                     for mode, state, _, schedule in live]
            wavs, seconds = runner.vocode_chunks(items)
            assert all(s >= 0 for s in seconds)
            for (mode, _, alone, schedule), wav in zip(live, wavs, strict=True):
                want = alone.push(e2e[f"{mode}_call{r}_flow_mel_new"], schedule[r]["finalize"])
                torch.testing.assert_close(wav, want, rtol=0, atol=1e-6)
                torch.testing.assert_close(wav, e2e[f"{mode}_call{r}_yield"], rtol=0, atol=AUDIO_ATOL)
    assert any(padded > real for real, padded in shapes)  # the padding was exercised


class _RecordingGraphs:
    """Stands in for a GraphCache on the CPU: runs the function, records each key it was asked for."""

    def __init__(self, fn) -> None:
        self.fn, self.enabled, self.graphs = fn, True, {}

    def run(self, key, inputs):
        self.graphs[key] = True
        return self.fn(*inputs)


def test_warmup_covers_every_graph_a_registered_voice_stream_uses(cv3_flow, cv3_hift, cv3_load, cv3_manifest):
    """After `warmup` for a stream's prompt and length, that stream (in a registered voice, alone or with
    another in lockstep) asks for no graph that warm-up did not capture."""
    e2e = cv3_load("e2e")
    mode, inputs, tokens, _ = max(_runs(e2e, cv3_manifest), key=lambda r: len(r[2]))
    block = cv3_flow.decoder.estimator.dims.static_chunk_size
    frames = cv3_flow.ratio * (inputs.flow_prompt_speech_tokens.numel() + len(tokens)) + block
    runner = CV3Token2WavRunner(cv3_flow, cv3_hift, flow_slots=2, slot_frames=frames)
    runner.graphs = _RecordingGraphs(runner._graph_chunk)
    runner.vocoder_graphs = _RecordingGraphs(runner._graph_window)
    assert runner.warmup(inputs.flow_prompt_speech_tokens.numel(), len(tokens)) > 0
    warmed = set(runner.graphs.graphs) | set(runner.vocoder_graphs.graphs)
    assert runner.free_slots() == 2
    states = [runner.start(inputs, voice_key="voice") for _ in range(2)]
    planner = ChunkPlanner(ChunkSchedule(), inputs.flow_prompt_speech_tokens.numel(), block=block // cv3_flow.ratio)
    while (plan := planner.next_plan(len(tokens), done=True)) is not None:
        runner.run([(s, tokens, plan) for s in states])
    used = set(runner.graphs.graphs) | set(runner.vocoder_graphs.graphs)
    assert used == warmed, f"{mode}: graphs not warmed: {used - warmed}"


class _FailingGraphs(_RecordingGraphs):
    """A GraphCache whose captures fail (as an unsupported op inside a capture would)."""

    def run(self, key, inputs):
        if self.enabled:
            raise RuntimeError("operation not permitted when stream is capturing")
        return self.fn(*inputs)


def test_a_failed_graph_capture_falls_back_to_the_same_numbers(cv3_flow, cv3_hift, cv3_load, cv3_manifest):
    e2e = cv3_load("e2e")
    mode, inputs, tokens, schedule = _runs(e2e, cv3_manifest)[0]
    block = cv3_flow.decoder.estimator.dims.static_chunk_size
    frames = cv3_flow.ratio * (inputs.flow_prompt_speech_tokens.numel() + len(tokens)) + block
    runner = CV3Token2WavRunner(cv3_flow, cv3_hift, flow_slots=1, slot_frames=frames)
    runner.graphs = _FailingGraphs(runner._graph_chunk)
    runner.vocoder_graphs = _FailingGraphs(runner._graph_window)
    state = runner.start(inputs, voice_key=None)
    planner = ChunkPlanner(ChunkSchedule(), inputs.flow_prompt_speech_tokens.numel(), block=block // cv3_flow.ratio)
    i = 0
    while (plan := planner.next_plan(len(tokens), done=True)) is not None:
        [(pcm, _, _)] = runner.run([(state, tokens, plan)])
        np.testing.assert_allclose(pcm, e2e[f"{mode}_call{i}_yield"][0].numpy(), rtol=0, atol=AUDIO_ATOL)
        i += 1
    assert i == len(schedule)
    assert "not permitted" in runner.graph_error
    assert not runner.graphs.enabled and not runner.vocoder_graphs.enabled
