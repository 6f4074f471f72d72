"""The pooled, batched flow path (what runs under CUDA graphs) equals the per-request incremental flow."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from cosystream.config import ChunkSchedule
from cosystream.engine.chunking import ChunkPlanner
from cosystream.engine.flow_runner import FlowRunner
from cosystream.engine.loader import load_flow
from cosystream.kernels import reference
from cosystream.models.flow import UPSAMPLE
from cosystream.models.flow_stream import FlowStream, PromptCache

pytestmark = pytest.mark.parity


@pytest.mark.parametrize("fused", [False, True])
def test_pooled_batch_equals_per_request_stream(checkpoint, load_fixture, fused):
    """fused: the estimator's fused-op path (GEMM epilogues, q/k/v written straight into the pool) through
    the kernels' torch statements; the per-request stream it is compared with keeps the plain modules."""
    f = load_fixture("stream")
    flow = load_flow(checkpoint)
    stream = FlowStream(flow, final_attention="chunk")
    prompt = stream.build_prompt_cache(f["prompt_token"], f["prompt_feat"], f["embedding"])
    runner = FlowRunner(flow, num_slots=3, max_frames=512, use_graphs=False)
    _compare_pooled_with_stream(runner, stream, prompt, f, reference if fused else None)


def _compare_pooled_with_stream(runner, stream, prompt, f, ops, max_chunks: int = 1000) -> None:
    token_sets = [f["token"][0][:100], (f["token"][0][:100] * 5 + 11) % 6561]
    pooled = [runner.open(prompt) for _ in token_sets]
    alone = [stream.start(prompt, 100) for _ in token_sets]
    planners = [ChunkPlanner(ChunkSchedule(), f["prompt_token"].shape[1]) for _ in token_sets]
    for _ in range(max_chunks):
        plans = [p.next_plan(100, done=True) for p in planners]
        if plans[0] is None or plans[0].is_final:
            break
        ids = [t[: plans[0].token_end].unsqueeze(0) for t in token_sets]
        windows = [stream._window(s, i, finalize=False) for s, i in zip(pooled, ids, strict=True)]
        starts = [s.num_frames for s in pooled]
        runner.use_fused_ops(ops)  # the ODE's projection + CFG + Euler update as the fused op too
        try:
            got = runner.advance(pooled, windows)
        finally:
            runner.use_fused_ops(None)
        for b in range(2):
            want = stream.feed(alone[b], ids[b])
            mel = stream._target_frames(pooled[b], got[b][None], starts[b])
            torch.testing.assert_close(mel, want, atol=1e-4, rtol=0)
    for s in pooled:
        runner.close(s)
    assert sorted(runner.free) == [0, 1, 2]


def test_streams_at_different_tokens_share_a_batch(checkpoint, load_fixture):
    """The encoder steps of one batch group by the token each stream is at: a stream one chunk ahead and a
    new one, in one batch, each get what they get alone."""
    f = load_fixture("stream")
    flow = load_flow(checkpoint)
    stream = FlowStream(flow, final_attention="chunk")
    prompt = stream.build_prompt_cache(f["prompt_token"], f["prompt_feat"], f["embedding"])
    runner = FlowRunner(flow, num_slots=2, max_frames=512, use_graphs=False)
    ids = torch.cat([prompt.prompt_tokens, f["token"][0][:100].long()])
    chunk, look = stream.chunk_tokens, stream.lookahead

    def window(start: int) -> tuple[torch.Tensor, torch.Tensor]:
        return ids[start:start + chunk], ids[start + chunk:start + chunk + look]

    b0 = prompt.num_tokens
    ahead, new = runner.open(prompt), runner.open(prompt)
    ahead_alone, new_alone = stream.start(prompt, 100), stream.start(prompt, 100)
    runner.advance([ahead], [window(b0)])
    stream._advance([ahead_alone], [window(b0)], streaming=True)
    got = runner.advance([ahead, new], [window(b0 + chunk), window(b0)])
    want = [stream._advance([ahead_alone], [window(b0 + chunk)], streaming=True)[0],
            stream._advance([new_alone], [window(b0)], streaming=True)[0]]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w[0].float(), atol=1e-4, rtol=0)
    assert [s.encoder.num_tokens for s in (ahead, new)] == [b0 + 2 * chunk, b0 + chunk]


def test_pooled_full_pass_equals_the_official_final_call(checkpoint, load_fixture, cfm_noise, manifest):
    f, flow, prompt, runner = _official_noise_runner(checkpoint, load_fixture, cfm_noise, num_slots=1,
                                                     max_frames=512)
    runner.conv.normal_()  # garbage left by earlier use of the pool must not matter
    runner.kv.normal_()
    final = len(manifest["stream"]["schedule"]) - 1
    mel = runner.full_pass(prompt, f["token"][0])
    torch.testing.assert_close(mel[:, 2 * f["prompt_token"].shape[1]:], f[f"call{final}_flow_mel_full"][0],
                               atol=1e-4, rtol=0)


def test_final_passes_built_as_on_cuda_give_the_official_final_mel(checkpoint, load_fixture, cfm_noise, manifest):
    """What CUDA runs for the official final call, here on the CPU: the fused estimator ops, each Euler step's
    time terms gathered from tables by the step index, and the projection, CFG mix and update as one op with
    the step size read from the device. Paused between steps, with another pass between them, it still
    gives the official final chunk's mel and the CPU path's passes."""
    f, flow, prompt, runner = _official_noise_runner(checkpoint, load_fixture, cfm_noise, num_slots=1,
                                                     max_frames=512)
    tokens = f["token"][0]
    items = [(prompt, tokens), (prompt, tokens[:-5])]
    want = runner.full_passes(items)
    runner.use_fused_ops(reference)
    runner.attention_ops = reference
    runner.use_constant_step_times()
    try:
        (a, row_a), (b, row_b) = runner.begin_finals(items)
        (other, _), = runner.begin_finals([((prompt, (tokens * 3 + 1) % 6561))])
        while not a.done:
            runner.final_step(a)
            runner.final_step(other)
    finally:
        runner.use_fused_ops(None)
    assert a is b and other.done
    for got, w in zip((a.mel(row_a), a.mel(row_b)), want, strict=True):
        torch.testing.assert_close(got, w, atol=1e-4, rtol=0)
    final = len(manifest["stream"]["schedule"]) - 1
    torch.testing.assert_close(a.mel(row_a)[:, 2 * f["prompt_token"].shape[1]:], f[f"call{final}_flow_mel_full"][0],
                               atol=1e-4, rtol=0)


def test_batched_final_passes_equal_one_at_a_time(checkpoint, load_fixture, cfm_noise):
    """Final calls of streams of different lengths in one batch, with the pool full of stale state, give
    what each gives alone."""
    f, flow, prompt, runner = _official_noise_runner(checkpoint, load_fixture, cfm_noise, num_slots=3,
                                                     max_frames=512)
    tokens = f["token"][0]
    targets = [tokens, tokens[:-7], (tokens[:-3] * 7 + 5) % 6561]
    alone = [runner.full_pass(prompt, t) for t in targets]
    runner.kv.normal_()
    runner.conv.normal_()
    batched = runner.full_passes([(prompt, t) for t in targets])
    for got, want in zip(batched, alone, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    beyond_noise = torch.zeros(cfm_noise.shape[-1], dtype=torch.long)  # the official table bounds a call
    assert runner.full_passes([(prompt, beyond_noise)]) == [None]


def test_a_final_pass_longer_than_a_slot_equals_the_official_final_call(checkpoint, load_fixture, cfm_noise,
                                                                        manifest):
    """The final pass attends to its own keys, so a stream that outgrew its slot (460 frames here, slots of
    128) still gets the official final call from the pool."""
    f, flow, prompt, runner = _official_noise_runner(checkpoint, load_fixture, cfm_noise, num_slots=1,
                                                     max_frames=128)
    final = len(manifest["stream"]["schedule"]) - 1
    (mel,) = runner.full_passes([(prompt, f["token"][0])])
    assert mel.shape[-1] == 2 * (f["prompt_token"].shape[1] + f["token"].shape[1]) > runner.max_frames
    torch.testing.assert_close(mel[:, 2 * f["prompt_token"].shape[1]:], f[f"call{final}_flow_mel_full"][0],
                               atol=1e-4, rtol=0)
    # a short one (2 rows × 256 padded frames) is within the fused ops' row limit, whose path writes keys
    # into the pool: a whole pass must not take it
    big = FlowRunner(flow, num_slots=1, max_frames=512, use_graphs=False)
    short = f["token"][0][:40]
    runner.use_fused_ops(reference)
    try:
        (got,) = runner.full_passes([(prompt, short)])
    finally:
        runner.use_fused_ops(None)
    torch.testing.assert_close(got, big.full_pass(prompt, short), atol=1e-4, rtol=0)


def test_a_failing_open_gives_its_slot_back(checkpoint, load_fixture, monkeypatch):
    f = load_fixture("stream")
    flow = load_flow(checkpoint)
    prompt = FlowStream(flow).build_prompt_cache(f["prompt_token"], f["prompt_feat"], f["embedding"])
    runner = FlowRunner(flow, num_slots=2, max_frames=512, use_graphs=False)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(FlowRunner, "_encoder_in_slot", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        runner.open(prompt)
    assert runner.free == [0, 1]


@pytest.mark.slow  # a minute or more in Triton's CPU interpreter (skipped on CUDA, where tests/gpu covers it)
def test_pooled_batch_with_triton_kernels_equals_per_request_stream(checkpoint, load_fixture, monkeypatch):
    """The same comparison with the Triton kernels the GPU runs (Triton's interpreter on the CPU).

    The interpreter's time goes by programs and statements, not by values: with the engine's small GPU
    launch tiles this one chunk took many minutes. Bigger tiles (fewer programs, each looping fewer times,
    still more than one along the frames) check the same thing here, how the runner calls the kernels; each
    kernel on the engine's own tiles is checked against its reference in tests/kernels and on CUDA in
    tests/gpu."""
    import os

    if torch.cuda.is_available():
        pytest.skip("on CUDA the kernels run for real in tests/gpu/test_cuda_matches_cpu.py")
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when Triton is imported
    pytest.importorskip("triton", reason="Triton is a dev dependency: pip install -e '.[dev]'")
    from cosystream.kernels import flow as flow_kernels

    gemm, conv = flow_kernels.Tile(128, 64), flow_kernels.Tile(64, 128)  # conv: 64 frames, 128 channels a step
    monkeypatch.setattr(flow_kernels, "TILES", {key: conv if key[0] == "conv" else gemm for key in flow_kernels.TILES})
    monkeypatch.setattr(flow_kernels, "ATTENTION_TILES",
                        dict.fromkeys(flow_kernels.ATTENTION_TILES, flow_kernels.Tile(64, 64)))

    f = load_fixture("stream")
    flow = load_flow(checkpoint)
    stream = FlowStream(flow, final_attention="chunk")
    prompt = stream.build_prompt_cache(f["prompt_token"], f["prompt_feat"], f["embedding"])
    runner = FlowRunner(flow, num_slots=3, max_frames=512, use_graphs=False)
    runner.attention_ops = flow_kernels
    _compare_pooled_with_stream(runner, stream, prompt, f, flow_kernels, max_chunks=1)  # the interpreter is slow


def _other_voice(f) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A second voice with the fixture prompt's length: other tokens, mel and speaker."""
    return ((f["prompt_token"] * 7 + 3) % 6561, f["prompt_feat"].flip(1), f["embedding"].roll(5, dims=1))


def _two_voices(checkpoint, f) -> tuple[FlowStream, list[tuple], list[PromptCache], FlowRunner]:
    """(the chunk-masked stream, the fixture voice and another, each one's eager PromptCache, a 3-slot CPU pool)."""
    flow = load_flow(checkpoint)
    stream = FlowStream(flow, final_attention="chunk")
    voices = [(f["prompt_token"], f["prompt_feat"], f["embedding"]), _other_voice(f)]
    return stream, voices, [stream.build_prompt_cache(*voice) for voice in voices], FlowRunner(
        flow, num_slots=3, max_frames=512, use_graphs=False)


def _assert_same_cache(got: PromptCache, want: PromptCache) -> None:
    for name, value in want.to_tensors().items():
        torch.testing.assert_close(got.to_tensors()[name], value, atol=1e-4, rtol=0, msg=name)


@pytest.mark.parametrize("fused", [False, True])
def test_voice_prompts_built_together_in_the_pool_equal_the_per_request_build(checkpoint, load_fixture, fused):
    """Token2WavRunner builds new voices' prompt states in free pool slots, prompts of one length in one
    chunk (one graphed ODE on a GPU), instead of FlowStream's eager pass per voice: every cache each holds
    is the same as its own eager build, and the slots are free again."""
    f = load_fixture("stream")
    stream, voices, want, runner = _two_voices(checkpoint, f)
    runner.use_fused_ops(reference if fused else None)
    try:
        got = runner.build_prompt_caches(stream, voices)
    finally:
        runner.use_fused_ops(None)
    assert sorted(runner.free) == [0, 1, 2]
    for g, w in zip(got, want, strict=True):
        assert g.num_tokens == w.num_tokens > 0
        _assert_same_cache(g, w)
    assert not torch.equal(got[0].kv, got[1].kv)
    # the prompt state built in the pool voices a stream as the one built per request does
    _compare_pooled_with_stream(runner, stream, got[0], f, None, max_chunks=2)
    with pytest.raises(ValueError, match="one length"):
        runner.build_prompt_caches(stream, [voices[0], (voices[1][0][:, :-25], voices[1][1][:, :-50], voices[1][2])])
    assert sorted(runner.free) == [0, 1, 2]


@pytest.mark.parametrize("fused", [False, True])
def test_recomputed_chunks_equal_the_official_calls(checkpoint, load_fixture, cfm_noise, manifest, fused):
    """A stream past its slot gets each chunk as the official code computes it: the flow over prompt + all
    tokens so far with chunk masks (its look-ahead tokens as context), every frame recomputed."""
    f, flow, prompt, runner = _official_noise_runner(checkpoint, load_fixture, cfm_noise, num_slots=1,
                                                     max_frames=128)
    runner.conv.normal_()  # the stream's slot holds stale conv tails: the pass starts from zero
    num_prompt = f["prompt_token"].shape[1]
    runner.use_fused_ops(reference if fused else None)
    try:
        for i, call in enumerate(manifest["stream"]["schedule"][:-1]):
            mel = runner.recompute(prompt, f["token"][0][:call["n_tokens"]], finalize=False)
            torch.testing.assert_close(mel[:, 2 * num_prompt:], f[f"call{i}_flow_mel_full"][0], atol=1e-4, rtol=0)
    finally:
        runner.use_fused_ops(None)


def test_recomputed_chunks_of_several_streams_equal_one_at_a_time(checkpoint, load_fixture, cfm_noise):
    """Streams past their slots recompute together: lengths padded to one bucket share a pass (rows masked
    to their own frames), other lengths run apart; each gets what it gets alone, whatever the pool held."""
    f, flow, prompt, runner = _official_noise_runner(checkpoint, load_fixture, cfm_noise, num_slots=3,
                                                     max_frames=128)
    tokens = f["token"][0]
    # 250 and 234 frames share a 256-frame bucket, 460 runs apart
    items = [(prompt, tokens[:98], False), (prompt, (tokens[:90] * 5 + 2) % 6561, False), (prompt, tokens, True)]
    alone = [runner.recompute(*item) for item in items]
    runner.conv.normal_()
    runner.kv.normal_()
    together = runner.recompute_many(items)
    for got, want in zip(together, alone, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def _official_noise_runner(checkpoint, load_fixture, cfm_noise, num_slots: int, max_frames: int):
    """(stream fixture, flow with the official noise table, the fixture voice's PromptCache, an eager
    FlowRunner of num_slots × max_frames)."""
    f = load_fixture("stream")
    flow = load_flow(checkpoint)
    flow.decoder.set_noise_table(cfm_noise)
    prompt = FlowStream(flow).build_prompt_cache(f["prompt_token"], f["prompt_feat"], f["embedding"])
    return f, flow, prompt, FlowRunner(flow, num_slots=num_slots, max_frames=max_frames, use_graphs=False)


def test_whole_utterance_passes_group_by_padded_length_in_replays_of_at_most_32_streams(checkpoint):
    """Beyond the largest batch bucket warm-up captures, a replay would capture a new graph mid-traffic."""
    runner = FlowRunner(load_flow(checkpoint), num_slots=1, max_frames=128, use_graphs=False)
    frames = [800] * 70 + [300, 250]
    groups = runner._by_padded_length(range(len(frames)), frames)
    assert [(padded, len(members)) for padded, members in groups] == [(896, 32), (896, 32), (896, 6), (384, 1),
                                                                      (256, 1)]
    assert sorted(i for _, members in groups for i in members) == list(range(len(frames)))


def test_a_final_pass_stepped_with_other_work_between_its_steps_equals_one_run_whole(checkpoint, load_fixture,
                                                                                      cfm_noise):
    """A FinalPass owns its ODE state and inputs: another pass of the same shape stepping between its
    steps, and a pool overwritten meanwhile, change nothing."""
    f, flow, prompt, runner = _official_noise_runner(checkpoint, load_fixture, cfm_noise, num_slots=2,
                                                     max_frames=512)
    tokens = f["token"][0]
    items = [(prompt, tokens), (prompt, tokens[:-5])]
    want = runner.full_passes(items)
    (a, row_a), (b, row_b) = runner.begin_finals(items)
    changed = (tokens * 3 + 1) % 6561
    (other, _), _ = runner.begin_finals([(prompt, changed), (prompt, changed[:-2])])
    assert a is b and other is not a and other.key == a.key and (row_a, row_b) == (0, 1)
    while not a.done:
        runner.final_step(a)
        runner.kv.normal_()
        runner.conv.normal_()
        if not other.done:
            runner.final_step(other)
    assert other.done and a.step == runner.cfm.num_steps
    for got, w in zip((a.mel(row_a), a.mel(row_b)), want, strict=True):
        torch.testing.assert_close(got, w, atol=1e-6, rtol=0)


def test_a_paused_final_pass_gives_its_slot_back_and_ends_as_one_run_whole(checkpoint, load_fixture, cfm_noise):
    """Token2WavRunner.run with should_stop: the official final pass of a pooled stream gives the slot back
    when it begins (it reads none), pauses when asked after a step, and a later run goes on from there: a
    new stream in that slot meanwhile changes nothing, and releasing the paused stream again at its end
    does not free the new stream's slot."""
    from cosystream.config import EngineConfig
    from cosystream.engine.chunking import ChunkPlan
    from cosystream.engine.loader import load_hift
    from cosystream.engine.token2wav import Token2WavRunner, Token2WavState

    f, flow, prompt, runner = _official_noise_runner(checkpoint, load_fixture, cfm_noise, num_slots=1,
                                                     max_frames=512)
    t2w = Token2WavRunner(flow, load_hift(checkpoint), EngineConfig())
    t2w.pool = runner
    tokens = f["token"][0].tolist()
    plan = ChunkPlan(index=0, offset=0, num_new=len(tokens), token_end=len(tokens), is_final=True)
    (whole,) = t2w.run([(Token2WavState(runner.open(prompt), key="a"), tokens, plan)])
    assert runner.free == [0]
    paused = Token2WavState(runner.open(prompt), key="b")
    asked: list[int] = []
    assert t2w.run([(paused, tokens, plan)], should_stop=lambda: asked.append(1) or len(asked) >= 3) is None
    assert runner.free == [0] and paused.final is not None and paused.final[0].step == 3
    new = runner.open(prompt)  # the new stream takes the slot back and writes its rows
    runner.kv.normal_()
    runner.conv.normal_()
    (got,) = t2w.run([(paused, tokens, plan)])
    assert paused.final is None and paused.flow.is_finished and runner.free == [] and new.slot == 0
    np.testing.assert_allclose(got[0], whole[0], atol=1e-6, rtol=0)
    # a run that is not all official final passes is never paused
    later = replace(plan, is_final=False)
    assert not t2w.pausable([]) and not t2w.pausable([(Token2WavState(new, key="c"), tokens, later)])


def test_the_stopwatch_counts_a_batched_final_pass_once_with_its_streams(checkpoint, load_fixture, cfm_noise):
    """Every stream of a batched final pass asks for it; it runs, and counts as a call, once."""
    f, flow, prompt, runner = _official_noise_runner(checkpoint, load_fixture, cfm_noise, num_slots=3,
                                                     max_frames=512)
    tokens = f["token"][0]
    runner.watch.start()
    runner.full_passes([(prompt, tokens), (prompt, (tokens * 7 + 5) % 6561)])
    runner.watch.settle()
    calls = {tag: n for tag, n in runner.watch.tag_calls.items() if tag.startswith("final_")}
    frames = runner._full_length(2 * (f["prompt_token"].shape[1] + tokens.shape[0]))
    assert calls == {f"final_2x{frames}": 1}


def test_prompts_of_other_lengths_whose_caches_end_at_one_boundary_are_built_together(checkpoint, load_fixture):
    """Only the prompt's tokens up to its last chunk boundary (with look-ahead) are cached: prompts of different
    lengths with one boundary share the pool call, each with its own look-ahead and mel."""
    f = load_fixture("stream")
    flow = load_flow(checkpoint)
    stream = FlowStream(flow, final_attention="chunk")
    tokens, mel, spk = _other_voice(f)
    shorter = 2  # tokens fewer: the cache still ends at the same chunk boundary
    voices = [(f["prompt_token"], f["prompt_feat"], f["embedding"]),
              (tokens[:, :-shorter], mel[:, :-UPSAMPLE * shorter], spk)]
    lengths = [v[0].shape[1] for v in voices]
    assert lengths[0] != lengths[1] and len({stream.prompt_cache_tokens(n) for n in lengths}) == 1
    want = [stream.build_prompt_cache(*voice) for voice in voices]
    runner = FlowRunner(flow, num_slots=2, max_frames=512, use_graphs=False)
    got = runner.build_prompt_caches(stream, voices)
    assert sorted(runner.free) == [0, 1]
    for g, w, n in zip(got, want, lengths, strict=True):
        assert g.prompt_tokens.shape[0] == n and g.num_tokens == w.num_tokens > 0
        _assert_same_cache(g, w)


@pytest.mark.parametrize("fused", [False, True])
def test_streams_opened_with_their_prompt_pass_in_their_slot_voice_as_from_the_voice_cache(checkpoint, load_fixture,
                                                                                        fused):
    """New voices' streams open with the flow run over their prompts right in their own slots (no cache built
    elsewhere and copied in): their chunks equal those of streams opened from the voices' eagerly built caches,
    and the caches they leave behind equal those too."""
    f = load_fixture("stream")
    stream, voices, want, runner = _two_voices(checkpoint, f)
    token_sets = [f["token"][0][:100], (f["token"][0][:100] * 5 + 11) % 6561]
    runner.use_fused_ops(reference if fused else None)
    try:
        opened = runner.open_new_voices(stream, voices)
        assert sorted(runner.free) == [2]
        alone = [stream.start(w, 100) for w in want]
        planner = ChunkPlanner(ChunkSchedule(), f["prompt_token"].shape[1])
        for _ in range(2):
            plan = planner.next_plan(100, done=True)
            ids = [t[:plan.token_end].unsqueeze(0) for t in token_sets]
            pooled = [p for p, _ in opened]
            windows = [stream._window(p, i, finalize=False) for p, i in zip(pooled, ids, strict=True)]
            starts = [p.num_frames for p in pooled]
            got = runner.advance(pooled, windows)
            for b in range(2):
                mel = stream._target_frames(pooled[b], got[b][None], starts[b])
                torch.testing.assert_close(mel, stream.feed(alone[b], ids[b]), atol=1e-4, rtol=0)
    finally:
        runner.use_fused_ops(None)
    for (pooled, cache), w in zip(opened, want, strict=True):
        _assert_same_cache(cache, w)
        runner.close(pooled)
    assert sorted(runner.free) == [0, 1, 2]


@pytest.mark.parametrize("fused", [False, True])
def test_the_ode_step_by_step_equals_the_ode_in_one_call(checkpoint, load_fixture, fused):
    """A first chunk that follows its stream's prompt pass runs the ODE one Euler step (one graph) at a time:
    the same numbers as the ODE in one call."""
    f = load_fixture("stream")
    flow = load_flow(checkpoint)
    stream = FlowStream(flow, final_attention="chunk")
    prompt = stream.build_prompt_cache(f["prompt_token"], f["prompt_feat"], f["embedding"])
    runner = FlowRunner(flow, num_slots=2, max_frames=512, use_graphs=False)
    ids = f["token"][0][:100].unsqueeze(0)
    plan = ChunkPlanner(ChunkSchedule(), f["prompt_token"].shape[1]).next_plan(100, done=True)
    results = []
    runner.use_fused_ops(reference if fused else None)
    try:
        for by_step in (False, True):
            pooled = runner.open(prompt)
            window = stream._window(pooled, ids[:, :plan.token_end], finalize=False)
            inputs = runner._ode_inputs([pooled], [window], runner.encoder_graphs)
            if by_step:
                results.append(list(runner._ode_steps(inputs, runner.step_graphs))[-1][0].clone())
            else:
                results.append(runner.graphs.run(inputs.key, inputs.tensors)[0][0].clone())
            runner.close(pooled)
    finally:
        runner.use_fused_ops(None)
    assert torch.equal(results[0], results[1])


def test_finished_prompt_passes_are_reported_once_each_when_done(checkpoint):
    """The cost model hears of each prompt pass once it has ended: a pass still running on the prompt lane waits
    for a later call; a finished one reports its GPU time (its events' elapsed time)."""
    from cosystream.engine.prompt_lane import PromptPassEvents

    class Event:
        def __init__(self, done: bool) -> None:
            self.done = done

        def query(self) -> bool:
            return self.done

        def elapsed_time(self, end: Event) -> float:
            return 25.0  # ms, as torch.cuda.Event reports it

    runner = FlowRunner(load_flow(checkpoint), num_slots=1, max_frames=128, use_graphs=False)
    running = PromptPassEvents(Event(True), Event(True), [], Event(False))
    ended = PromptPassEvents(Event(True), Event(True), [], Event(True))
    runner._passes = [(3, running), (2, ended), (1, 0.04)]
    assert runner.finished_passes() == [(2, 0.025), (1, 0.04)]
    assert runner.finished_passes() == []
    running.done.done = True
    assert runner.finished_passes() == [(3, 0.025)] and runner._passes == []


def test_new_voices_not_kept_get_no_cache_and_those_kept_the_same_cache(checkpoint, load_fixture):
    """open_new_voices with keep flags: a voice not kept gets None (its stream still opens in its slot, with the
    voice's prompt tokens, mel and speaker), a kept one the cache its eager build gives; one flag per prompt."""
    f = load_fixture("stream")
    stream, voices, want, runner = _two_voices(checkpoint, f)
    with pytest.raises(ValueError, match="keep"):
        runner.open_new_voices(stream, voices, keep=[True])
    assert sorted(runner.free) == [0, 1, 2]
    (first, none), (second, cache) = runner.open_new_voices(stream, voices, keep=[False, True])
    assert none is None and cache is not None and second.prompt is cache
    _assert_same_cache(cache, want[1])
    torch.testing.assert_close(first.prompt.prompt_mel, want[0].prompt_mel)
    torch.testing.assert_close(first.prompt.spks, want[0].spks)
    for pooled in (first, second):
        runner.close(pooled)
    assert sorted(runner.free) == [0, 1, 2]
