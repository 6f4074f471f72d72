"""On a GPU: the CosyVoice3 paths on CUDA against the official numbers and the CPU float32 path.

Needs CUDA (CI is CPU only: skipped there); run on the lent GPU:
    python -m pytest -q tests/models/cosyvoice3/test_cv3_cuda.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosystream.config import ChunkSchedule
from cosystream.engine.chunking import ChunkPlan, ChunkPlanner
from cosystream.engine.cv3_loader import load_cv3_flow, load_cv3_hift, load_cv3_llm
from cosystream.engine.cv3_token2wav import CV3Token2WavRunner
from cosystream.engine.lm_runner import LMRunner, RowSampling
from cosystream.frontend.prompt import ModelInputs
from cosystream.kernels import decode
from cosystream.models.cosyvoice3.hift import HiftStream
from cosystream.models.cosyvoice3.stream import StreamSchedule, Token2WavStream
from cosystream.models.qwen2 import KVCache

pytestmark = [pytest.mark.parity, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

AUDIO_ATOL = 5e-3  # README §C3: e2e streamed audio per call
MEL_ATOL = 1e-4  # README §C3: e2e flow mel per call
BF16_REL_RMS = 0.05  # ‖Δmel‖/‖mel‖ between two bf16 passes that batch and round differently


def test_graphed_decode_gives_the_official_greedy_tokens(cv3_checkpoint, cv3_load, cv3_manifest):
    llm, info = cv3_load("llm"), cv3_manifest["llm"]
    lm = load_cv3_llm(cv3_checkpoint, "cuda")
    embeds = llm["zs_lm_input"][0].cuda()
    runner = LMRunner(lm, max_slots=1, max_len=embeds.shape[0] + info["greedy_len"] + 8, use_graphs=True)
    runner.set_row_sampling(0, RowSampling(seed=0, top_p=0.8, top_k=25, win_size=10, tau_r=0.1,
                                           min_len=info["min_len"], greedy=True))
    token = runner.prefill(0, embeds)
    runner.set_active(0, True)
    out = []
    while not lm.is_stop(token) and len(out) < info["max_len"]:
        out.append(token)
        [token] = runner.decode(1, runner.max_len - 1)
    assert out == llm["zs_greedy_tokens"].tolist()


def test_bf16_decode_distributions_close_to_the_official(cv3_checkpoint, cv3_load):
    """Total-variation distance of the bf16 fused decode's next-token distributions from the official
    float32 ones (teacher forcing), the bound the CosyVoice2 GPU test uses."""
    llm = cv3_load("llm")
    lm = load_cv3_llm(cv3_checkpoint, "cuda", torch.bfloat16)
    x, forced, want = llm["zs_lm_input"], llm["zs_forced_tokens"].tolist(), llm["zs_step_logp"].exp()
    n0 = x.shape[1]
    cache = KVCache(lm.dims, 1, n0 + len(forced) + 8, "cuda", torch.bfloat16)
    h = lm(x.cuda().bfloat16(), torch.tensor([0], device="cuda"), cache, attn_len=n0,
           slots=torch.tensor([0], device="cuda"))[:, -1]
    probs = [lm.logp(h).exp().float().cpu()]
    for step, token in enumerate(forced[: want.shape[0] - 1]):
        emb = lm.speech_embedding.weight[token][None]
        h = lm.decode(emb, torch.tensor([n0 + step], device="cuda"), cache, cache.max_len, decode)
        probs.append(lm.logp(h).exp().float().cpu())
    tv = 0.5 * (torch.cat(probs) - want).abs().sum(-1)
    assert float(tv.max()) < 0.05


# vc_long on CUDA: every call's mel is within MEL_ATOL, and the vocoder fed the official mels passes (next test),
# yet 4 of 96,000 samples of the 8.4 s stream end 7.0e-3 (H100) and 7.4e-3 (H200) off: the CUDA mel differences,
# larger than the CPU's 6.9e-6 that README §C3's audio tolerance was measured with, move f0, and the float32
# source phase integrates that over seconds. Expected to fail until the phase is carried so that it cannot drift.
_PHASE_DRIFT = pytest.mark.xfail(strict=False, reason="CUDA mel differences integrated by the source phase")


@pytest.mark.parametrize("mode", ["zero_shot", pytest.param("vc_long", marks=_PHASE_DRIFT)])
def test_float32_cuda_stream_matches_the_official_chunks(cv3_checkpoint, cv3_load, cv3_manifest, cv3_noise_table,
                                                         mode, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # float32 convolutions, as on the CPU
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    e2e, run = cv3_load("e2e"), cv3_manifest["e2e"][mode]
    src = run.get("prompt_inputs_from", mode)
    flow = load_cv3_flow(cv3_checkpoint, "cuda")
    if cv3_noise_table is not None:
        flow.decoder.set_noise_table(cv3_noise_table)
    hift = load_cv3_hift(cv3_checkpoint, "cuda", noise_seconds=max(c["hift_in_frames"] for c in run["schedule"]) / 50
                         + 1)
    prompt = [e2e[f"{src}_in_{k}"].cuda() for k in ("flow_prompt_speech_token", "prompt_speech_feat",
                                                      "flow_embedding")]
    tokens = e2e[f"{mode}_speech_tokens"].cuda()
    stream = Token2WavStream(flow, hift, *prompt)
    schedule = StreamSchedule(prompt[0].shape[1])
    with torch.no_grad():
        for i, _ in enumerate(run["schedule"]):
            out = stream.push(tokens, schedule.next_call(tokens.shape[1], done=True))
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
            # the mel first: the source phase amplifies any mel difference in the audio (README §C3)
            torch.testing.assert_close(out.mel.cpu(), e2e[f"{mode}_call{i}_flow_mel_new"], rtol=0, atol=MEL_ATOL)
            torch.testing.assert_close(out.wav.cpu(), e2e[f"{mode}_call{i}_yield"], rtol=0, atol=AUDIO_ATOL)


@pytest.mark.parametrize("mode", ["zero_shot", "vc_long"])
def test_float32_cuda_vocoder_on_the_official_mels(cv3_checkpoint, cv3_load, cv3_manifest, mode, monkeypatch):
    """The incremental vocoder alone on CUDA, fed the official per-call mels: separates a vocoder
    difference from a flow difference that the source phase amplifies."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    e2e, run = cv3_load("e2e"), cv3_manifest["e2e"][mode]
    hift = load_cv3_hift(cv3_checkpoint, "cuda", noise_seconds=max(c["hift_in_frames"] for c in run["schedule"]) / 50
                         + 1)
    stream = HiftStream(hift)
    with torch.no_grad():
        for i, call in enumerate(run["schedule"]):
            wav = stream.push(e2e[f"{mode}_call{i}_flow_mel_new"].cuda(), call["finalize"])
            torch.testing.assert_close(wav.cpu(), e2e[f"{mode}_call{i}_yield"], rtol=0, atol=AUDIO_ATOL)


def _runs(e2e: dict, manifest: dict, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    out = []
    for mode, run in manifest["e2e"].items():
        src = run.get("prompt_inputs_from", mode)
        prompt = [e2e[f"{src}_in_{k}"].cuda() for k in ("flow_prompt_speech_token", "prompt_speech_feat",
                                                         "flow_embedding")]
        prompt[1] = prompt[1].to(dtype)
        out.append((*prompt, e2e[f"{mode}_speech_tokens"].cuda()))
    return out


@pytest.mark.parametrize("final_attention", ["full", "chunk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_pool_matches_the_eager_stream(cv3_checkpoint, cv3_load, cv3_manifest, cv3_noise_table, dtype,
                                               final_attention, monkeypatch):
    """Every e2e run of the set as one stream, all voiced together through the runner's pooled CUDA graphs,
    against each stream's eager `Token2WavStream.new_mel` on the same GPU (float32: the e2e mel tolerance;
    bf16: a relative RMS bound, as a batched pass rounds differently)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    e2e = cv3_load("e2e")
    flow = load_cv3_flow(cv3_checkpoint, "cuda", dtype)
    if cv3_noise_table is not None:
        flow.decoder.set_noise_table(cv3_noise_table)
    hift = load_cv3_hift(cv3_checkpoint, "cuda", dtype, noise_seconds=4)
    runs = _runs(e2e, cv3_manifest, dtype)
    block = flow.decoder.estimator.dims.static_chunk_size
    frames = max(flow.ratio * (p.shape[1] + t.shape[1]) for p, _, _, t in runs) + block
    runner = CV3Token2WavRunner(flow, hift, final_attention=final_attention, flow_slots=len(runs),
                                slot_frames=frames, cuda_graphs=True)
    states, eager = [], []
    for prompt, feat, xvec, _ in runs:
        inputs = ModelInputs(mode="zero_shot", text_ids=torch.zeros(0, dtype=torch.int32), xvector=xvec[0].cpu(),
                             flow_prompt_speech_tokens=prompt[0].cpu().int(), prompt_mel=feat[0].float().cpu())
        states.append(runner.start(inputs, voice_key=None))
        eager.append(Token2WavStream(flow, hift, prompt, feat, xvec, final_full_attention=final_attention == "full"))
    calls = [StreamSchedule(p.shape[1]).all_calls(t.shape[1]) for p, _, _, t in runs]
    with torch.inference_mode():
        for r in range(max(len(c) for c in calls)):
            live = [i for i in range(len(runs)) if r < len(calls[i])]
            jobs = [(states[i], runs[i][3][0].tolist(),
                     ChunkPlan(r, calls[i][r].token_offset, 0, calls[i][r].num_tokens, calls[i][r].finalize))
                    for i in live]
            mels, _ = runner.flow_chunks(jobs)
            for i, mel in zip(live, mels, strict=True):
                c = calls[i][r]
                want = eager[i].new_mel(runs[i][3], c)
                if dtype == torch.float32:
                    torch.testing.assert_close(mel, want, rtol=0, atol=MEL_ATOL)
                else:
                    assert float((mel - want).norm() / want.norm()) < BF16_REL_RMS
    assert runner.pooled_chunks == sum(len(c) for c in calls)
    assert len(runner.graphs.graphs) > 0


def test_warmup_captures_every_graph_a_standard_stream_uses(cv3_checkpoint, cv3_load, cv3_manifest):
    """After `warmup`, registered-voice streams of the warmed shape capture nothing mid-traffic."""
    e2e, run = cv3_load("e2e"), cv3_manifest["e2e"]["vc_long"]
    flow = load_cv3_flow(cv3_checkpoint, "cuda", torch.bfloat16)
    hift = load_cv3_hift(cv3_checkpoint, "cuda", torch.bfloat16,
                         noise_seconds=max(c["hift_in_frames"] for c in run["schedule"]) / 50 + 1)
    src = run.get("prompt_inputs_from", "vc_long")
    inputs = ModelInputs(mode="zero_shot", text_ids=torch.zeros(0, dtype=torch.int32),
                         xvector=e2e[f"{src}_in_flow_embedding"][0],
                         flow_prompt_speech_tokens=e2e[f"{src}_in_flow_prompt_speech_token"][0].int(),
                         prompt_mel=e2e[f"{src}_in_prompt_speech_feat"][0])
    tokens = e2e["vc_long_speech_tokens"][0].tolist()
    block = flow.decoder.estimator.dims.static_chunk_size
    frames = flow.ratio * (inputs.flow_prompt_speech_tokens.numel() + len(tokens)) + block
    runner = CV3Token2WavRunner(flow, hift, flow_slots=4, slot_frames=frames)
    assert runner.warmup(inputs.flow_prompt_speech_tokens.numel(), len(tokens)) > 0
    warmed = len(runner.graphs.graphs) + len(runner.vocoder_graphs.graphs)
    states = [runner.start(inputs, voice_key="voice") for _ in range(3)]
    planner = ChunkPlanner(ChunkSchedule(), inputs.flow_prompt_speech_tokens.numel(), block=block // flow.ratio)
    while (plan := planner.next_plan(len(tokens), done=True)) is not None:
        for pcm, _, _ in runner.run([(s, tokens, plan) for s in states]):
            assert np.isfinite(pcm).all()
    assert len(runner.graphs.graphs) + len(runner.vocoder_graphs.graphs) == warmed
    assert runner.free_slots() == 4
