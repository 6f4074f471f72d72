"""The engine's LMRunner, unchanged, decoding CosyVoice3LM: greedy tokens of the official run (llm.safetensors)."""

from __future__ import annotations

import pytest

from cosystream.engine.lm_runner import LMRunner, RowSampling

pytestmark = pytest.mark.parity


@pytest.mark.parametrize("fused", [False, True])
def test_lm_runner_greedy_tokens(cv3_lm, cv3_load, cv3_manifest, fused):
    llm, info = cv3_load("llm"), cv3_manifest["llm"]
    embeds = llm["zs_lm_input"][0]
    runner = LMRunner(cv3_lm, max_slots=1, max_len=embeds.shape[0] + info["greedy_len"] + 8, use_graphs=False,
                      fused_kernels=fused)
    assert runner.eos == cv3_lm.ignore_eos_index  # the one id masked before min_len, as the official
    runner.set_row_sampling(0, RowSampling(seed=0, top_p=0.8, top_k=25, win_size=10, tau_r=0.1,
                                           min_len=info["min_len"], greedy=True))
    token = runner.prefill(0, embeds)
    runner.set_active(0, True)
    out = []
    while not cv3_lm.is_stop(token) and len(out) < info["max_len"]:
        out.append(token)
        [token] = runner.decode(1, runner.max_len - 1)
    assert out == llm["zs_greedy_tokens"].tolist()
    assert token == info["greedy_stop_token"]
