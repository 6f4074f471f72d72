"""On a GPU: programmatic dependent launch (both families of cosystream.kernels.PDL) changes no number. It is
pure scheduling, so the outputs must be identical bit for bit; a missing wait in a PDL kernel would show here
as a race (a kernel reading its predecessor's output before that one has finished)."""

from __future__ import annotations

import pytest
import torch

from cosystream import kernels
from cosystream.checkpoint.hparams import LLMDims
from cosystream.config import ChunkSchedule
from cosystream.engine.chunking import ChunkPlanner
from cosystream.engine.flow_runner import FlowRunner
from cosystream.engine.loader import load_flow
from cosystream.kernels import decode
from cosystream.models.flow_stream import FlowStream
from cosystream.models.qwen2 import KVCache, SpeechLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# CosyVoice2-0.5B's backbone (a small text vocabulary: the decode step never reads it)
DIMS_05B = LLMDims(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                   intermediate_size=4864, rms_norm_eps=1e-6, rope_theta=1e6, text_vocab_size=16,
                   speech_token_size=6561, mix_ratio=(5, 15), top_p=0.8, top_k=25, win_size=10, tau_r=0.1)


def _pdl_available() -> bool:
    from cosystream.kernels._launch_jit import HAS_GDC

    return HAS_GDC and torch.cuda.get_device_capability()[0] >= 9


needs_pdl = pytest.mark.skipif(not (torch.cuda.is_available() and _pdl_available()),
                               reason="programmatic dependent launch needs Hopper and grid dependency control")


def _graphed_steps(lm: SpeechLM, batch: int, steps: int, pdl: bool,
                   monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], KVCache]:
    """`steps` replays of one captured decode step (rows [0, batch)), each at a new position."""
    monkeypatch.setitem(kernels.PDL, "decode", pdl)
    cache = KVCache(lm.dims, batch, 256, "cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(5)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    embeds = torch.zeros(batch, lm.dims.hidden_size, device="cuda", dtype=torch.bfloat16)
    positions = torch.zeros(batch, dtype=torch.long, device="cuda")
    lm.rope_table(cache.max_len, embeds.device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        lm.decode(embeds, positions, cache, cache.max_len, decode)  # compiles every kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hidden = lm.decode(embeds, positions, cache, cache.max_len, decode)
    outs = []
    for step in range(steps):
        embeds.copy_(lm.speech_embedding.weight[torch.arange(batch, device="cuda") * 7 + step])
        positions.copy_(torch.arange(batch, device="cuda") * 3 + 100 + step)
        graph.replay()
        outs.append(hidden.clone())
    torch.cuda.synchronize()
    return outs, cache


@needs_pdl
@pytest.mark.parametrize("batch", [1, 16])
def test_pdl_decode_steps_equal_plain_launches_at_full_size(batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    lm = SpeechLM(DIMS_05B).to("cuda", torch.bfloat16)
    with torch.inference_mode():
        for p in lm.parameters():  # weights of the real model's scale, so activations stay finite
            p.normal_(0, 0.02)
        want, want_cache = _graphed_steps(lm, batch, 12, pdl=False, monkeypatch=monkeypatch)
        got, got_cache = _graphed_steps(lm, batch, 12, pdl=True, monkeypatch=monkeypatch)
    assert all(torch.isfinite(h).all() for h in want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(got_cache.k, want_cache.k, rtol=0, atol=0)
    torch.testing.assert_close(got_cache.v, want_cache.v, rtol=0, atol=0)


def _pooled_flow_chunks(checkpoint, f, pdl: bool, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Velocity outputs of two streams' chunks through the graphed pooled ODE (captured with PDL or not)."""
    monkeypatch.setitem(kernels.PDL, "flow", pdl)
    flow = load_flow(checkpoint, "cuda", torch.bfloat16)
    stream = FlowStream(flow, final_attention="chunk")
    prompt = stream.build_prompt_cache(f["prompt_token"].cuda(), f["prompt_feat"].cuda(), f["embedding"].cuda())
    runner = FlowRunner(flow, num_slots=3, max_frames=512, use_graphs=True)
    token_sets = [f["token"][0][:100].cuda(), ((f["token"][0][:100] * 5 + 11) % 6561).cuda()]
    states = [runner.open(prompt) for _ in token_sets]
    planners = [ChunkPlanner(ChunkSchedule(), f["prompt_token"].shape[1]) for _ in token_sets]
    outs = []
    while (plan := planners[0].next_plan(100, done=True)) is not None and not plan.is_final:
        planners[1].next_plan(100, done=True)
        windows = [stream._window(s, t[: plan.token_end].unsqueeze(0), finalize=False)
                   for s, t in zip(states, token_sets, strict=True)]
        outs += [o.clone() for o in runner.advance(states, windows)]
    torch.cuda.synchronize()
    return outs


@needs_pdl
def test_pdl_pooled_flow_chunks_equal_plain_launches(checkpoint, load_fixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    f = load_fixture("stream")
    with torch.inference_mode():
        want = _pooled_flow_chunks(checkpoint, f, pdl=False, monkeypatch=monkeypatch)
        got = _pooled_flow_chunks(checkpoint, f, pdl=True, monkeypatch=monkeypatch)
    assert len(want) >= 4 and all(torch.isfinite(w).all() for w in want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
