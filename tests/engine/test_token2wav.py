"""Token-to-wave streaming against the official streamed chunks (fixtures: stream.safetensors)."""

from __future__ import annotations

import pytest
import torch

from cosystream.config import ChunkSchedule, EngineConfig
from cosystream.engine.chunking import ChunkPlanner
from cosystream.engine.loader import load_flow, load_hift
from cosystream.engine.token2wav import Token2WavRunner
from cosystream.frontend import ModelInputs

pytestmark = pytest.mark.parity
ATOL = 1e-4


@pytest.fixture(scope="module")
def models(checkpoint, cfm_noise):
    flow = load_flow(checkpoint)
    flow.decoder.set_noise_table(cfm_noise)  # the exact official noise values (fixtures README)
    return flow, load_hift(checkpoint)


def _inputs(f) -> ModelInputs:
    return ModelInputs(mode="vc", text_ids=torch.zeros(0, dtype=torch.int32), xvector=f["embedding"][0],
                       flow_prompt_speech_tokens=f["prompt_token"][0], prompt_mel=f["prompt_feat"][0],
                       source_speech_tokens=f["token"][0])


def _stream(runner: Token2WavRunner, f, final_attention_key=None) -> list[torch.Tensor]:
    tokens = f["token"][0].tolist()
    planner = ChunkPlanner(ChunkSchedule(), f["prompt_token"].shape[1])
    state = runner.start(_inputs(f), None, key=final_attention_key)
    out = []
    while (plan := planner.next_plan(len(tokens), done=True)) is not None:
        pcm, _, _ = runner.run([(state, tokens, plan)])[0]
        out.append(torch.from_numpy(pcm))
    return out


def test_streamed_chunks_equal_official_yields(models, load_fixture, manifest):
    f = load_fixture("stream")
    num_calls = len(manifest["stream"]["schedule"])
    sources = [f[f"call{i}_hift_source"] for i in range(num_calls)]
    runner = Token2WavRunner(*models, EngineConfig(), source_override=lambda key, i: sources[i])
    chunks = _stream(runner, f)
    assert len(chunks) == num_calls
    for i, chunk in enumerate(chunks):
        torch.testing.assert_close(chunk, f[f"call{i}_yield"][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(chunks), f["stream_concat"][0], atol=ATOL, rtol=0)


def test_generated_sources_keep_length_and_continuity(models, load_fixture):
    """Without injected sources: the same chunk sizes, and the total is 480 samples per mel frame."""
    f = load_fixture("stream")
    runner = Token2WavRunner(*models, EngineConfig())
    chunks = _stream(runner, f)
    assert [c.shape[0] for c in chunks] == [f[f"call{i}_yield"].shape[1] for i in range(len(chunks))]
    assert sum(c.shape[0] for c in chunks) == 960 * f["token"].shape[1]
    assert all(torch.isfinite(c).all() and c.abs().max() <= 0.99 for c in chunks)


def test_batched_chunks_equal_chunks_run_alone(models, load_fixture):
    """Two requests whose flow chunks run in one batch give the mel each gives alone."""
    f = load_fixture("stream")
    runner = Token2WavRunner(*models, EngineConfig())
    tokens = f["token"][0].tolist()[:100]  # two streaming chunks and a final one
    other = [(t * 7 + 3) % 6561 for t in tokens]
    results = {}
    for name, toks in (("a", tokens), ("b", other)):
        state = runner.start(_inputs(f), None)
        planner = ChunkPlanner(ChunkSchedule(), f["prompt_token"].shape[1])
        results[name] = []
        while (plan := planner.next_plan(len(toks), done=True)) is not None:
            results[name].append(runner._flow([(state, toks, plan)])[0])
    states = [runner.start(_inputs(f), None) for _ in range(2)]
    planners = [ChunkPlanner(ChunkSchedule(), f["prompt_token"].shape[1]) for _ in range(2)]
    batched = {"a": [], "b": []}
    while True:
        plans = [p.next_plan(len(tokens), done=True) for p in planners]
        if plans[0] is None:
            break
        mels = runner._flow([(states[0], tokens, plans[0]), (states[1], other, plans[1])])
        batched["a"].append(mels[0])
        batched["b"].append(mels[1])
    for name in ("a", "b"):
        for alone, together in zip(results[name], batched[name], strict=True):
            torch.testing.assert_close(together, alone, atol=ATOL, rtol=0)


def test_short_first_hop(models, load_fixture):
    """first_hop 15: the first chunk is provisional, exactly what the official streaming flow computes from the
    tokens it has seen (a partial block); the next one recomputes the block exactly, so its frames equal the
    official streaming flow over the same tokens, and nothing is voiced twice."""
    f = load_fixture("stream")
    flow, _ = models
    runner = Token2WavRunner(*models, EngineConfig())
    tokens = f["token"][0].tolist()[:120]
    prompt_len = f["prompt_token"].shape[1]
    planner = ChunkPlanner(ChunkSchedule(), prompt_len, first_hop=15)
    state = runner.start(_inputs(f), None)
    plans, mels = [], []
    while (plan := planner.next_plan(len(tokens), done=True)) is not None:
        plans.append(plan)
        mels.append(runner._flow([(state, tokens, plan)])[0])
    assert plans[0].provisional and plans[0].num_new == 15 and not plans[1].provisional
    assert [m.shape[-1] for m in mels] == [2 * p.num_new for p in plans]
    second = plans[1]
    official = flow.inference(torch.tensor([tokens[:second.token_end]]), f["prompt_token"], f["prompt_feat"],
                              f["embedding"], streaming=True, finalize=False)
    torch.testing.assert_close(mels[1], official[0, :, 2 * second.offset:], atol=ATOL, rtol=0)
    first = plans[0]
    seen = flow.inference(torch.tensor([tokens[:first.token_end]]), f["prompt_token"], f["prompt_feat"],
                          f["embedding"], streaming=True, finalize=False)
    assert seen.shape[-1] == 2 * first.num_new
    torch.testing.assert_close(mels[0], seen[0], atol=ATOL, rtol=0)


def test_flow_group_is_the_key_a_chunk_is_batched_under(models, load_fixture):
    """flow_group (what the engine's worker uses to let later chunks ride along with a first chunk's ODE)
    is the key `_flow` groups that chunk under: its window's new positions; None for the final chunk."""
    f = load_fixture("stream")
    runner = Token2WavRunner(*models, EngineConfig())
    tokens = f["token"][0].tolist()
    planner = ChunkPlanner(ChunkSchedule(), f["prompt_token"].shape[1])
    state = runner.start(_inputs(f), None)
    seen = 0
    while (plan := planner.next_plan(len(tokens), done=True)) is not None:
        key = runner.flow_group(state, plan)
        if plan.is_final:
            assert key is None
        else:
            window = runner.stream._window(state.flow, runner._tokens(tokens[:plan.token_end]), finalize=False)
            assert key == (False, window[0].shape[0], False)  # CPU: eager streams, not pooled
            seen += 1
        runner.run([(state, tokens, plan)])
    assert seen >= 2


def test_a_later_chunk_sharing_a_first_chunks_ode_gives_its_own_mel(models, load_fixture):
    """A's second chunk and B's first chunk with equal windows run as one ODE call (a rider, Scheduler.riders):
    each mel is what it is alone."""
    f = load_fixture("stream")
    runner = Token2WavRunner(*models, EngineConfig())
    prompt_len = f["prompt_token"].shape[1]
    tokens = f["token"][0].tolist()
    other = [(t * 7 + 3) % 6561 for t in tokens]

    def first_two(toks):
        state, planner = runner.start(_inputs(f), None), ChunkPlanner(ChunkSchedule(), prompt_len)
        return state, planner, [planner.next_plan(len(toks), done=False) for _ in range(2)]

    a, _, a_plans = first_two(tokens)
    runner._flow([(a, tokens, a_plans[0])])
    b, _, b_plans = first_two(other)
    # the first window re-encodes the prompt's last unfinished block: as long as the second hop here
    assert runner.flow_group(a, a_plans[1]) == runner.flow_group(b, b_plans[0]) is not None
    together = runner._flow([(b, other, b_plans[0]), (a, tokens, a_plans[1])])
    a2, _, a2_plans = first_two(tokens)
    runner._flow([(a2, tokens, a2_plans[0])])
    alone_a = runner._flow([(a2, tokens, a2_plans[1])])[0]
    b2, _, b2_plans = first_two(other)
    alone_b = runner._flow([(b2, other, b2_plans[0])])[0]
    torch.testing.assert_close(together[0], alone_b, atol=ATOL, rtol=0)
    torch.testing.assert_close(together[1], alone_a, atol=ATOL, rtol=0)


def test_a_voice_prompt_is_at_hand_in_memory_or_in_a_record_of_this_model(models, load_fixture):
    """has_prompt tells the engine which new streams open without a flow pass (the scheduler's open-ahead puts
    each of the others in a phase of its own)."""
    f = load_fixture("stream")
    runner = Token2WavRunner(*models, EngineConfig())
    records: dict[str, dict] = {}
    runner.on_new_voice_cache = lambda key, tensors: records.setdefault(key, tensors)
    assert not runner.has_prompt(None) and not runner.has_prompt("v")
    runner.prompt_cache(_inputs(f), "v")
    assert runner.has_prompt("v") and not runner.has_prompt("w")
    assert runner.has_prompt("w", records["v"])  # a stored record of this very model
    other = {**records["v"], "model": torch.tensor(list(b"another model"), dtype=torch.uint8)}
    assert not runner.has_prompt("w", other)


def test_only_registered_voices_caches_are_handed_over_to_be_kept(models, load_fixture):
    """A request's own recording has no voice record: its fresh cache stays in memory and is not copied out."""
    from cosystream.engine.upload_cache import UPLOAD_KEY_PREFIX

    f = load_fixture("stream")
    runner = Token2WavRunner(*models, EngineConfig())
    handed: list[str] = []
    runner.on_new_voice_cache = lambda key, tensors: handed.append(key)
    runner.prompt_cache(_inputs(f), "voice\x00registered")
    runner.prompt_cache(_inputs(f), UPLOAD_KEY_PREFIX + "recording")
    assert handed == ["voice\x00registered"]
    assert runner.has_prompt(UPLOAD_KEY_PREFIX + "recording")


def test_vocoder_calls_of_one_length_run_at_most_replay_rows_streams_at_once(models, load_fixture, monkeypatch):
    """Official final passes wait without a flow slot, so dozens of their vocoder calls may share one mel
    length: they run REPLAY_ROWS at a time (the largest batch warm-up captures), each stream gets the audio
    it gets alone."""
    from cosystream.engine.graphs import REPLAY_ROWS
    from cosystream.engine.token2wav import Token2WavState

    runner = Token2WavRunner(*models, EngineConfig())
    batches: list[int] = []
    real = runner._hift_batch
    monkeypatch.setattr(runner, "_hift_batch", lambda states, mels: batches.append(len(states)) or real(states, mels))
    mel = torch.randn(80, 12, generator=torch.Generator().manual_seed(0)) - 5
    n = REPLAY_ROWS + 3
    wavs = runner._vocode([(Token2WavState(None, key=i, noise_offset=97 * i), mel, True) for i in range(n)])
    assert batches == [REPLAY_ROWS, 3]
    (alone,) = runner._vocode([(Token2WavState(None, key=n - 1, noise_offset=97 * (n - 1)), mel, True)])
    # a batch's size moves float sums by ~1e-4; another row's audio differs by ~0.1
    torch.testing.assert_close(wavs[-1], alone, atol=1e-3, rtol=0)
    assert not torch.allclose(wavs[-2], alone, atol=1e-2)


def _voice_items(f) -> list[dict]:
    other = ModelInputs(mode="vc", text_ids=torch.zeros(0, dtype=torch.int32), xvector=f["embedding"][0].roll(5),
                        flow_prompt_speech_tokens=(f["prompt_token"][0] * 7 + 3) % 6561,
                        prompt_mel=f["prompt_feat"][0].flip(0), source_speech_tokens=f["token"][0])
    return [dict(inputs=_inputs(f), voice_key="a", key=0), dict(inputs=other, voice_key="b", key=1),
            dict(inputs=_inputs(f), voice_key="a", key=2)]


def test_new_voices_opening_together_run_one_prompt_pass_in_their_slots(models, load_fixture):
    """Streams of new voices opening in one batch: one pool call runs the prompt passes of both voices in the
    streams' own slots; the voice asked twice is built once, its second stream opens from the cache the first
    left; the caches are kept for later streams. Each stream's first chunk is what a stream opened from a
    voice cache built on its own gives."""
    from cosystream.engine.flow_runner import FlowRunner, PooledStream

    f = load_fixture("stream")
    runner = Token2WavRunner(*models, EngineConfig())
    runner.pool = FlowRunner(runner.flow, num_slots=4, max_frames=512, use_graphs=False)
    items = _voice_items(f)
    states = runner.open_streams(items)
    assert all(isinstance(s.flow, PooledStream) for s in states) and len(runner.pool.free) == 1
    assert (runner.prompt_build_calls, runner.prompts_built) == (1, 2)
    assert runner.has_prompt("a") and runner.has_prompt("b")
    assert states[2].flow.prompt is runner.voice_caches["a"]  # the second stream of "a" opened from its cache
    tokens = f["token"][0].tolist()[:100]
    plan = ChunkPlanner(ChunkSchedule(), f["prompt_token"].shape[1]).next_plan(len(tokens), done=True)
    mels = runner._flow([(s, tokens, plan) for s in states])
    alone = Token2WavRunner(*models, EngineConfig())
    alone.pool = FlowRunner(alone.flow, num_slots=1, max_frames=512, use_graphs=False)
    for item, mel in zip(items, mels, strict=True):
        state = alone.start(item["inputs"], None)
        torch.testing.assert_close(mel, alone._flow([(state, tokens, plan)])[0], atol=ATOL, rtol=0)
        alone.release(state)


def test_a_recording_sent_once_leaves_no_cache_behind_and_is_kept_when_sent_again(models, load_fixture):
    """A recording sent with a request is new: its stream opens with the prompt pass in its slot, but no cache
    is made for later streams (its first chunk is the same); the second time its pass runs (sent again) the
    cache is kept, and a third request opens from it. A registered voice's cache is kept at once, and so is a
    recording's that one batch opens twice."""
    from cosystream.engine.flow_runner import FlowRunner
    from cosystream.engine.upload_cache import UPLOAD_KEY_PREFIX

    f = load_fixture("stream")
    runner = Token2WavRunner(*models, EngineConfig())
    runner.pool = FlowRunner(runner.flow, num_slots=4, max_frames=512, use_graphs=False)
    upload, twice = UPLOAD_KEY_PREFIX + "x", UPLOAD_KEY_PREFIX + "y"
    a, b, _ = _voice_items(f)
    tokens = f["token"][0].tolist()[:100]
    plan = ChunkPlanner(ChunkSchedule(), f["prompt_token"].shape[1]).next_plan(len(tokens), done=True)

    def first_chunk(item: dict) -> torch.Tensor:
        (state,) = runner.open_streams([item])
        mel = runner._flow([(state, tokens, plan)])[0]
        runner.release(state)
        return mel

    builds = runner.prompts_built
    once = first_chunk({**a, "voice_key": upload})
    assert not runner.has_prompt(upload) and runner.prompts_built == builds + 1
    again = first_chunk({**a, "voice_key": upload})
    assert runner.has_prompt(upload) and runner.prompts_built == builds + 2
    third = first_chunk({**a, "voice_key": upload})
    assert runner.prompts_built == builds + 2  # opened from the kept cache
    for mel in (again, third):
        torch.testing.assert_close(mel, once, atol=ATOL, rtol=0)
    first_chunk({**b, "voice_key": "registered"})
    assert runner.has_prompt("registered")
    states = runner.open_streams([{**b, "voice_key": twice, "key": 5}, {**b, "voice_key": twice, "key": 6}])
    assert runner.has_prompt(twice) and states[1].flow.prompt is runner.voice_caches[twice]
    for state in states:
        runner.release(state)
    assert sorted(runner.pool.free) == [0, 1, 2, 3]


def test_a_failed_prompt_pass_call_leaves_each_stream_to_open_alone(models, load_fixture, monkeypatch):
    from cosystream.engine.flow_runner import FlowRunner

    f = load_fixture("stream")
    runner = Token2WavRunner(*models, EngineConfig())
    runner.pool = FlowRunner(runner.flow, num_slots=4, max_frames=512, use_graphs=False)

    alone = runner.pool.open_new_voices

    def out_of_memory_for_a_group(stream, prompts, keep=None):
        if len(prompts) > 1:
            raise RuntimeError("out of memory for the group")
        return alone(stream, prompts, keep)

    monkeypatch.setattr(runner.pool, "open_new_voices", out_of_memory_for_a_group)
    states = runner.open_streams(_voice_items(f)[:2])
    assert not any(isinstance(s, Exception) for s in states) and len(runner.pool.free) == 2
    assert (runner.prompt_build_calls, runner.prompts_built) == (2, 2)  # one build each, in `start`
