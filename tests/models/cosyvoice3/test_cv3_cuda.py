"""On a GPU: the CosyVoice3 paths on CUDA against the official numbers and the CPU float32 path.

Needs CUDA (CI is CPU only: skipped there); run on the lent GPU:
    python -m pytest -q tests/models/cosyvoice3/test_cv3_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from cosystream.engine.cv3_loader import load_cv3_flow, load_cv3_hift, load_cv3_llm
from cosystream.engine.lm_runner import LMRunner, RowSampling
from cosystream.kernels import decode
from cosystream.models.cosyvoice3.stream import StreamSchedule, Token2WavStream
from cosystream.models.qwen2 import KVCache

pytestmark = [pytest.mark.parity, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

AUDIO_ATOL = 5e-3  # README §C3: e2e streamed audio per call


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


@pytest.mark.parametrize("mode", ["zero_shot", "vc_long"])
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
            torch.testing.assert_close(out.wav.cpu(), e2e[f"{mode}_call{i}_yield"], rtol=0, atol=AUDIO_ATOL)
