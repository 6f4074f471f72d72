"""On a GPU, at the 0.5B size, graphed: programmatic dependent launch of the decode kernels
(cosystream.kernels.pdl_launch) changes no number. It is pure scheduling, so the outputs must be identical bit
for bit; a missing wait in a PDL kernel would show here as a race (a kernel reading its predecessor's output
before that one has finished), as would an early load (made before the wait) of something the kernel before
writes. The L2 prefetch branch (cosystream.kernels.prefetch) changes no number either, and is really there."""

from __future__ import annotations

import pytest
import torch

from cosystream import kernels
from cosystream.checkpoint.hparams import LLMDims
from cosystream.engine.lm_runner import LMRunner, RowSampling
from cosystream.kernels import decode, prefetch
from cosystream.models.qwen2 import KVCache, SpeechLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# CosyVoice2-0.5B's backbone (a small text vocabulary: the decode step never reads it)
DIMS_05B = LLMDims(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                   intermediate_size=4864, rms_norm_eps=1e-6, rope_theta=1e6, text_vocab_size=16,
                   speech_token_size=6561, mix_ratio=(5, 15), top_p=0.8, top_k=25, win_size=10, tau_r=0.1)


_PDL_CAPABLE = kernels._pdl_capable

needs_pdl = pytest.mark.skipif(not (torch.cuda.is_available() and kernels._pdl_capable(torch.cuda.current_device())),
                               reason="programmatic dependent launch needs Hopper and grid dependency control")


def _launch_with_pdl(pdl: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels traced from now on launch with PDL where the GPU supports it (pdl) or plainly, as on a GPU
    without it (read when a step is traced, so at graph capture)."""
    monkeypatch.setattr(kernels, "_pdl_capable", _PDL_CAPABLE if pdl else (lambda _index: False))


def _graphed_steps(lm: SpeechLM, batch: int, steps: int, pdl: bool, monkeypatch: pytest.MonkeyPatch
                   ) -> tuple[list[torch.Tensor], KVCache]:
    """`steps` replays of one captured decode step (rows [0, batch)), each at a new position."""
    _launch_with_pdl(pdl, monkeypatch)
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


def _lm_05b() -> SpeechLM:
    torch.manual_seed(0)
    lm = SpeechLM(DIMS_05B).to("cuda", torch.bfloat16)
    with torch.inference_mode():
        for p in lm.parameters():  # weights of the real model's scale, so activations stay finite
            p.normal_(0, 0.02)
    return lm


@needs_pdl
@pytest.mark.parametrize("batch", [1, 16])
def test_pdl_decode_steps_equal_plain_launches_at_full_size(batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    lm = _lm_05b()
    with torch.inference_mode():
        want, want_cache = _graphed_steps(lm, batch, 12, pdl=False, monkeypatch=monkeypatch)
        got, got_cache = _graphed_steps(lm, batch, 12, pdl=True, monkeypatch=monkeypatch)
    assert all(torch.isfinite(h).all() for h in want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(got_cache.k, want_cache.k, rtol=0, atol=0)
    torch.testing.assert_close(got_cache.v, want_cache.v, rtol=0, atol=0)


def _runner_tokens(lm: SpeechLM, batch: int, steps: int, pdl: bool, monkeypatch: pytest.MonkeyPatch
                   ) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Tokens of `steps` graphed runner steps with top-p sampling (the fused sampler after the head), and the
    rows' history and positions after them."""
    _launch_with_pdl(pdl, monkeypatch)
    d = lm.dims
    runner = LMRunner(lm, max_slots=batch, max_len=512)
    g = torch.Generator(device="cuda").manual_seed(3)
    prompt = torch.randn(40, d.hidden_size, device="cuda", generator=g).to(torch.bfloat16) * 0.02
    for slot in range(batch):
        runner.set_row_sampling(slot, RowSampling(seed=slot, top_p=d.top_p, top_k=d.top_k, win_size=d.win_size,
                                                  tau_r=d.tau_r, min_len=0))
        runner.prefill(slot, prompt[: 20 + slot])
        runner.set_active(slot, True)
    tokens = [runner.decode(batch, 100) for _ in range(steps)]
    return tokens, runner.sampling.history[:batch].clone(), runner.positions[:batch].clone()


@needs_pdl
@pytest.mark.parametrize("batch", [1, 16])
def test_pdl_sampler_draws_the_plain_launches_tokens(batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler follows the head with PDL and loads its rows' state early: same draws, same state."""
    lm = _lm_05b()
    with torch.inference_mode():
        want = _runner_tokens(lm, batch, 12, pdl=False, monkeypatch=monkeypatch)
        got = _runner_tokens(lm, batch, 12, pdl=True, monkeypatch=monkeypatch)
    assert len({t for step in want[0] for t in step}) > 1  # really sampling
    assert got[0] == want[0]
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


needs_bulk_prefetch = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
    reason="the bulk L2 prefetch needs a Hopper (sm_90) or newer GPU")


@needs_bulk_prefetch
@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("window_mb", [8.0, 24.0])
def test_prefetching_decode_steps_equal_plain_ones(batch: int, window_mb: float,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    lm = _lm_05b()
    with torch.inference_mode():
        monkeypatch.setattr(prefetch, "WINDOW_MB", 0.0)
        want, want_cache = _graphed_steps(lm, batch, 12, pdl=True, monkeypatch=monkeypatch)
        monkeypatch.setattr(prefetch, "WINDOW_MB", window_mb)
        got, got_cache = _graphed_steps(lm, batch, 12, pdl=True, monkeypatch=monkeypatch)
    assert all(torch.isfinite(h).all() for h in want)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
    assert torch.equal(want_cache.k, got_cache.k) and torch.equal(want_cache.v, got_cache.v)


@needs_bulk_prefetch
def test_every_decode_weight_is_prefetched_once_on_a_side_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    lm = _lm_05b()
    launched: list[int] = []
    streams: set[int] = set()
    real = prefetch._prefetch

    def spy(weights: list[torch.Tensor]) -> None:
        launched.extend(w.data_ptr() for w in weights)
        streams.add(torch.cuda.current_stream().stream_id)
        real(weights)

    monkeypatch.setattr(prefetch, "WINDOW_MB", 16.0)
    monkeypatch.setattr(prefetch, "_prefetch", spy)
    with torch.inference_mode():
        _graphed_steps(lm, 1, 1, pdl=True, monkeypatch=monkeypatch)
    weights = [w.data_ptr() for w in lm.decode_weights()]
    # two traces (the warm-up and the capture), each asking for every weight once, in reading order
    assert launched == weights + weights
    assert torch.cuda.current_stream().stream_id not in streams
