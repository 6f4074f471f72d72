"""On a GPU: the CUDA paths (graphs, Triton kernels) compute what the CPU paths compute.

These tests need CUDA, so CI (CPU only) does not run them; they run on the lent GPU (docs/benchmarks.md
says when and on which commit). The CPU paths they compare against are checked against the official
fixtures by the parity tests.
"""

from __future__ import annotations

import pytest
import torch

from cosystream.config import ChunkSchedule
from cosystream.engine.chunking import ChunkPlanner
from cosystream.engine.flow_runner import FlowRunner
from cosystream.engine.lm_runner import LMRunner, RowSampling
from cosystream.engine.loader import load_flow, load_llm
from cosystream.kernels import decode, reference
from cosystream.models.flow_stream import FlowStream
from cosystream.models.qwen2 import KVCache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _greedy(lm, prompts: dict[int, torch.Tensor], steps: int, use_graphs: bool) -> dict[int, list[int]]:
    runner = LMRunner(lm, max_slots=4, max_len=512, use_graphs=use_graphs)
    out = {}
    for slot, prompt in prompts.items():
        runner.set_row_sampling(slot, RowSampling(seed=slot, top_p=0.8, top_k=25, win_size=10, tau_r=0.1,
                                                  min_len=1000, greedy=True, ban_special=True))
        out[slot] = [runner.prefill(slot, prompt)]
        runner.set_active(slot, True)
    for _ in range(steps):
        tokens = runner.decode(max(prompts) + 1, 200)
        for slot in prompts:
            out[slot].append(tokens[slot])
    return out


def test_graphed_triton_decode_gives_the_cpu_greedy_tokens(checkpoint):
    g = torch.Generator().manual_seed(0)
    lm_cpu = load_llm(checkpoint)
    prompts = {0: torch.randn(37, lm_cpu.dims.hidden_size, generator=g) * 0.5,
               2: torch.randn(70, lm_cpu.dims.hidden_size, generator=g) * 0.5}
    want = _greedy(lm_cpu, prompts, steps=40, use_graphs=False)
    got = _greedy(load_llm(checkpoint, "cuda"), {k: v.cuda() for k, v in prompts.items()}, 40, use_graphs=True)
    assert got == want


def test_bf16_triton_decode_log_probs_close_to_cpu_float32(checkpoint, load_fixture):
    f = load_fixture("llm")
    forced = f["forced_tokens"].tolist()
    results = {}
    for device, dtype, ops in (("cpu", torch.float32, reference), ("cuda", torch.bfloat16, decode)):
        lm = load_llm(checkpoint, device, dtype)
        n0 = f["lm_input"].shape[1]
        cache = KVCache(lm.dims, 1, n0 + len(forced) + 8, device, dtype)
        lm(f["lm_input"].to(device, dtype), torch.tensor([0], device=device), cache, attn_len=n0,
           slots=torch.tensor([0], device=device))
        probs = []
        for step, token in enumerate(forced[:-1]):
            emb = lm.speech_embedding.weight[token][None]
            h = lm.decode(emb, torch.tensor([n0 + step], device=device), cache, cache.max_len, ops)
            probs.append(lm.logp(h).exp().float().cpu())
        results[device] = torch.cat(probs)
    # total-variation distance between the bf16 GPU and float32 CPU next-token distributions
    tv = 0.5 * (results["cuda"] - results["cpu"]).abs().sum(-1)
    assert float(tv.max()) < 0.05


def test_graphed_pooled_flow_with_triton_attention_matches_cpu(checkpoint, load_fixture):
    f = load_fixture("stream")
    cpu_flow = load_flow(checkpoint)
    stream = FlowStream(cpu_flow, final_attention="chunk")
    prompt = stream.build_prompt_cache(f["prompt_token"], f["prompt_feat"], f["embedding"])
    gpu_flow = load_flow(checkpoint, "cuda")
    gpu_stream = FlowStream(gpu_flow, final_attention="chunk")
    gpu_prompt = gpu_stream.build_prompt_cache(f["prompt_token"].cuda(), f["prompt_feat"].cuda(),
                                               f["embedding"].cuda())
    runner = FlowRunner(gpu_flow, num_slots=3, max_frames=512, use_graphs=True)
    assert runner.attention_ops is not reference
    token_sets = [f["token"][0][:100], (f["token"][0][:100] * 5 + 11) % 6561]
    pooled = [runner.open(gpu_prompt) for _ in token_sets]
    alone = [stream.start(prompt, 100) for _ in token_sets]
    planners = [ChunkPlanner(ChunkSchedule(), f["prompt_token"].shape[1]) for _ in token_sets]
    chunks = 0
    while True:
        plans = [p.next_plan(100, done=True) for p in planners]
        if plans[0] is None or plans[0].is_final:
            break
        ids = [t[: plans[0].token_end].unsqueeze(0) for t in token_sets]
        windows = [gpu_stream._window(s, i.cuda(), finalize=False) for s, i in zip(pooled, ids, strict=True)]
        starts = [s.num_frames for s in pooled]
        got = runner.advance(pooled, windows)
        for b in range(2):
            want = stream.feed(alone[b], ids[b])
            mel = gpu_stream._target_frames(pooled[b], got[b][None], starts[b]).cpu()
            torch.testing.assert_close(mel, want, atol=5e-3, rtol=0)  # tf32 products inside the Triton dots
        chunks += 1
    assert chunks >= 2 and len(runner.encoder_graphs.graphs) >= 2  # the encoder step ran as graphs


def test_graphed_batched_final_passes_match_cpu(checkpoint, load_fixture, cfm_noise):
    """The official final call of two streams of different lengths as one graph (finalizing encoder padded
    and masked, full-attention ODE) against the CPU runner's passes one at a time."""
    f = load_fixture("stream")
    runners, prompts = _cpu_and_graphed_runners(checkpoint, f, cfm_noise, num_slots=2, max_frames=512)
    tokens = f["token"][0]
    targets = [tokens, (tokens[:-7] * 3 + 1) % 6561]
    want = [runners["cpu"].full_pass(prompts["cpu"], t) for t in targets]
    got = runners["cuda"].full_passes([(prompts["cuda"], t.cuda()) for t in targets])
    assert len(runners["cuda"].final_step_graphs.graphs) == len(runners["cuda"].final_encoder_graphs.graphs) == 1
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g.cpu(), w, atol=5e-3, rtol=0)  # tf32 products inside the Triton dots


@pytest.mark.parametrize("max_frames", [128, 512])
def test_graphed_recomputed_chunks_past_a_slot_match_cpu(checkpoint, load_fixture, cfm_noise, manifest, max_frames):
    """A stream past its slot (or beyond the pool): each chunk recomputed over all its frames (chunk masks,
    own keys) as one graph with the Triton kernels, against the CPU runner's pass; and the final pass.
    max_frames 512: passes within the fused estimator path's row limit (rows × frames <= 512), whose path
    writes q/k/v into the pool, must still attend to their own keys; a stale pool must not matter."""
    f = load_fixture("stream")
    runners, prompts = _cpu_and_graphed_runners(checkpoint, f, cfm_noise, num_slots=1, max_frames=max_frames)
    tokens = f["token"][0]
    calls = [tokens[:call["n_tokens"]] for call in manifest["stream"]["schedule"][:-1]]
    want = [runners["cpu"].recompute(prompts["cpu"], ids, finalize=False) for ids in calls]
    for stale in (False, True):
        if stale:
            runners["cuda"].kv.normal_()
            runners["cuda"].conv.normal_()
        got = runners["cuda"].recompute_many([(prompts["cuda"], ids.cuda(), False) for ids in calls])
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.cpu(), w, atol=5e-3, rtol=0)  # tf32 products inside the Triton dots
        for ids, w in zip(calls, want, strict=True):  # one at a time too
            (g,) = runners["cuda"].recompute_many([(prompts["cuda"], ids.cuda(), False)])
            torch.testing.assert_close(g.cpu(), w, atol=5e-3, rtol=0)
    assert len(runners["cuda"].recompute_graphs.graphs) >= 2
    for n in (tokens.shape[0], 40):
        (got,) = runners["cuda"].full_passes([(prompts["cuda"], tokens[:n].cuda())])
        want = runners["cpu"].full_pass(prompts["cpu"], tokens[:n])
        torch.testing.assert_close(got.cpu(), want, atol=5e-3, rtol=0)


def test_voice_prompts_built_in_the_graphed_pool_match_the_eager_build(checkpoint, load_fixture):
    """Token2WavRunner's build of new voices' prompt states: one graphed chunk for two voices in pool slots
    (Triton estimator kernels) against FlowStream's eager build of each on the same GPU (whose flow the
    pooled-flow test above checks against the CPU), and the estimator caches against the CPU build too."""
    f = load_fixture("stream")
    voices = [(f["prompt_token"], f["prompt_feat"], f["embedding"]),
              ((f["prompt_token"] * 7 + 3) % 6561, f["prompt_feat"].flip(1), f["embedding"].roll(5, dims=1))]
    cpu_stream = FlowStream(load_flow(checkpoint), final_attention="chunk")
    gpu_flow = load_flow(checkpoint, "cuda")
    gpu_stream = FlowStream(gpu_flow, final_attention="chunk")
    runner = FlowRunner(gpu_flow, num_slots=3, max_frames=512, use_graphs=True)
    assert runner.attention_ops is not reference
    on_gpu = [tuple(t.cuda() for t in voice) for voice in voices]
    got = runner.build_prompt_caches(gpu_stream, on_gpu)
    assert sorted(runner.free) == [0, 1, 2] and not runner.graphs.graphs  # the ODE ran on the prompt lane ...
    assert len(runner.lane.step_graphs.graphs) == runner.cfm.num_steps  # ... as one graph per Euler step
    for voice, gpu_voice, cache in zip(voices, on_gpu, got, strict=True):
        eager, cpu = gpu_stream.build_prompt_cache(*gpu_voice), cpu_stream.build_prompt_cache(*voice)
        assert cache.num_tokens == eager.num_tokens > 0
        for name, value in eager.to_tensors().items():
            have = cache.to_tensors()[name]
            err = float((have.float() - value.float()).abs().max()) if have.numel() else 0.0
            # tf32 products inside the Triton dots (the conv tails are conv inputs after LayerNorm and Mish:
            # 7e-3 apart on the H100, the other caches within 5e-3)
            tol = 2e-2 if name == "conv" else 5e-3
            torch.testing.assert_close(have, value, atol=tol, rtol=1e-3, msg=f"{name}: max |diff| {err:.2e}")
        # the CPU build: float32 without tf32
        torch.testing.assert_close(cache.kv.cpu(), cpu.kv, atol=5e-3, rtol=1e-3, msg="kv")
        torch.testing.assert_close(cache.conv.cpu(), cpu.conv, atol=2e-2, rtol=1e-2, msg="conv")


def test_first_chunks_that_follow_their_prompt_pass_step_by_step_equal_those_opened_from_the_caches(
        checkpoint, load_fixture):
    """New voices' streams open with their prompt pass queued on the prompt lane (held back there behind ~0.1 s
    of GPU sleep, so it is surely still running when the first chunks are queued): the first chunks, each Euler
    step waiting for the pass's same step (the step graphs captured), or waiting for the whole pass (a shape
    without them), give what streams opened from the finished caches give."""
    f = load_fixture("stream")
    voices = [(f["prompt_token"], f["prompt_feat"], f["embedding"]),
              ((f["prompt_token"] * 7 + 3) % 6561, f["prompt_feat"].flip(1), f["embedding"].roll(5, dims=1))]
    flow = load_flow(checkpoint, "cuda")
    stream = FlowStream(flow, final_attention="chunk")
    runner = FlowRunner(flow, num_slots=4, max_frames=512, use_graphs=True)
    on_gpu = [tuple(t.cuda() for t in voice) for voice in voices]
    token_sets = [f["token"][0][:100].cuda(), ((f["token"][0][:100] * 5 + 11) % 6561).cuda()]
    plan = ChunkPlanner(ChunkSchedule(), f["prompt_token"].shape[1]).next_plan(100, done=True)

    def first_chunks(pooled) -> list[torch.Tensor]:
        ids = [t[:plan.token_end].unsqueeze(0) for t in token_sets]
        windows = [stream._window(p, i, finalize=False) for p, i in zip(pooled, ids, strict=True)]
        return [mel.clone() for mel in runner.advance(pooled, windows)]

    def following_their_passes(warm_up: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        with torch.cuda.stream(runner.lane.stream):
            torch.cuda._sleep(200_000_000)
        opened = runner.open_new_voices(stream, on_gpu)
        # (a capture synchronises the device: the warm-up run captures every graph of the checked run)
        assert warm_up or all(p.building is not None for p, _ in opened) and not opened[0][1].written.query()
        new_streams = [p for p, _ in opened]
        following = first_chunks(new_streams)
        cache_streams = [runner.open(cache) for _, cache in opened]
        from_caches = first_chunks(cache_streams)
        torch.cuda.synchronize()
        for p in new_streams + cache_streams:
            runner.close(p)
        return following, from_caches

    for by_step in (False, True):
        if by_step:  # the first chunk's shape: the prompt's cached frames to the chunk's end
            num_prompt = f["prompt_token"].shape[1]
            end = 2 * (num_prompt + plan.token_end - stream.lookahead)
            runner.capture_steps(2, end - 2 * stream.prompt_cache_tokens(num_prompt), runner.attn_len_for(end))
        following_their_passes(warm_up=True)
        following, from_caches = following_their_passes()
        assert len(runner.step_graphs.graphs) == (runner.cfm.num_steps if by_step else 0)
        for got, want in zip(following, from_caches, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _cpu_and_graphed_runners(checkpoint, f, cfm_noise, num_slots: int, max_frames: int) -> tuple[dict, dict]:
    """({"cpu", "cuda"}: FlowRunner, eager on the CPU, graphed on CUDA; {"cpu", "cuda"}: the fixture voice's
    PromptCache), flows with the official noise table."""
    runners, prompts = {}, {}
    for device in ("cpu", "cuda"):
        flow = load_flow(checkpoint, device)
        flow.decoder.set_noise_table(cfm_noise)
        prompts[device] = FlowStream(flow).build_prompt_cache(f["prompt_token"].to(device), f["prompt_feat"].to(device),
                                                              f["embedding"].to(device))
        runners[device] = FlowRunner(flow, num_slots=num_slots, max_frames=max_frames, use_graphs=device == "cuda")
    return runners, prompts


def _graphed_pooled_chunks(checkpoint, f, window_mb: float) -> list[torch.Tensor]:
    """Two graphed pooled chunks of one stream, with the estimator's L2 prefetch window `window_mb`."""
    gpu_flow = load_flow(checkpoint, "cuda")
    gpu_stream = FlowStream(gpu_flow, final_attention="chunk")
    gpu_prompt = gpu_stream.build_prompt_cache(f["prompt_token"].cuda(), f["prompt_feat"].cuda(),
                                               f["embedding"].cuda())
    runner = FlowRunner(gpu_flow, num_slots=2, max_frames=512, use_graphs=True, l2_prefetch_mb=window_mb)
    planner = ChunkPlanner(ChunkSchedule(), f["prompt_token"].shape[1])
    pooled = [runner.open(gpu_prompt)]
    outs = []
    for _ in range(2):
        plan = planner.next_plan(100, done=True)
        ids = f["token"][0][: plan.token_end].unsqueeze(0).cuda()
        outs.append(runner.advance(pooled, [gpu_stream._window(pooled[0], ids, finalize=False)])[0].clone())
    return outs


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="the bulk L2 prefetch needs a Hopper (sm_90) or newer GPU")
def test_the_estimators_l2_prefetch_changes_no_number(checkpoint, load_fixture, monkeypatch):
    from cosystream.kernels import prefetch

    f = load_fixture("stream")
    want = _graphed_pooled_chunks(checkpoint, f, 0.0)
    launched = []
    real = prefetch._prefetch
    monkeypatch.setattr(prefetch, "_prefetch", lambda ws: (launched.append(len(ws)), real(ws)))
    got = _graphed_pooled_chunks(checkpoint, f, 1.0)
    assert launched  # the prefetch branch was traced into the graphs
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


def test_the_residual_branch_changes_no_number(checkpoint, load_fixture, monkeypatch):
    """The ResNets' residual projections on a branch stream (a parallel node of the chunk ODE's graph) give
    the numbers of the same kernels run in the chain."""
    from cosystream.kernels import prefetch

    f = load_fixture("stream")
    branches = []
    real = prefetch.branch
    monkeypatch.setattr(prefetch, "branch", lambda device: branches.append(real(device)) or branches[-1])
    got = _graphed_pooled_chunks(checkpoint, f, 0.0)
    assert any(b is not None for b in branches)  # the branch was traced into the graphs
    monkeypatch.setattr(prefetch, "branch", lambda device: None)
    want = _graphed_pooled_chunks(checkpoint, f, 0.0)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
