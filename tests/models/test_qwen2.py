"""Parity of the speech LM with the official Qwen2LM (fixtures: llm.safetensors, manifest llm)."""

from __future__ import annotations

import pytest
import torch

from cosystream.engine.loader import load_llm
from cosystream.models.qwen2 import KVCache, SpeechLM

pytestmark = pytest.mark.parity
ATOL_LOGP = 1e-4


@pytest.fixture(scope="module")
def lm(checkpoint) -> SpeechLM:
    return load_llm(checkpoint)


def _prefill_and_step(lm: SpeechLM, lm_input: torch.Tensor, feed: list[int], max_len: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced run: logp and hidden state at each step [steps, V], [steps, d]."""
    cache = KVCache(lm.dims, max_slots=1, max_len=max_len, device="cpu", dtype=torch.float32)
    slot = torch.tensor([0])
    h = lm(lm_input, torch.tensor([0]), cache, attn_len=lm_input.shape[1], slots=slot)[:, -1]
    hiddens, logps, pos = [h], [lm.logp(h)], lm_input.shape[1]
    for token in feed:
        emb = lm.speech_embedding.weight[token].view(1, 1, -1)
        h = lm(emb, torch.tensor([pos]), cache, attn_len=pos + 1, slots=slot)[:, -1]
        hiddens.append(h)
        logps.append(lm.logp(h))
        pos += 1
    return torch.cat(logps), torch.cat(hiddens)


def test_input_assembly(lm, load_fixture):
    f = load_fixture("llm")
    emb = lm.embed_prompt(f["text_token"][0], f["prompt_speech_token"][0], f["prompt_text_token"][0])
    torch.testing.assert_close(emb.unsqueeze(0), f["lm_input"], atol=1e-6, rtol=0)
    xl = lm.embed_prompt(f["text_token"][0], torch.zeros(0, dtype=torch.int32))
    torch.testing.assert_close(xl.unsqueeze(0), f["xl_lm_input"], atol=1e-6, rtol=0)


def test_teacher_forced_logp(lm, load_fixture):
    f = load_fixture("llm")
    forced = f["forced_tokens"].tolist()
    logp, hidden = _prefill_and_step(lm, f["lm_input"], forced[:-1], f["lm_input"].shape[1] + len(forced))
    torch.testing.assert_close(logp, f["step_logp"], atol=ATOL_LOGP, rtol=0)
    torch.testing.assert_close(hidden, f["step_hidden_last"][0], atol=ATOL_LOGP, rtol=0)
    torch.testing.assert_close(lm.llm_decoder(hidden), f["step_logits"], atol=ATOL_LOGP, rtol=0)


def test_teacher_forced_logp_without_prompt(lm, load_fixture):
    f = load_fixture("llm")
    forced = f["xl_forced_tokens"].tolist()
    logp, _ = _prefill_and_step(lm, f["xl_lm_input"], forced[:-1], f["xl_lm_input"].shape[1] + len(forced))
    torch.testing.assert_close(logp, f["xl_step_logp"], atol=ATOL_LOGP, rtol=0)


def test_step_matches_full_causal_forward(lm, load_fixture):
    """The cached step path equals one causal pass over the whole sequence."""
    f = load_fixture("llm")
    forced = f["forced_tokens"].tolist()
    step_logp, _ = _prefill_and_step(lm, f["lm_input"], forced[:-1], f["lm_input"].shape[1] + len(forced))
    seq = torch.cat([f["lm_input"][0], lm.speech_embedding.weight[forced[:-1]]]).unsqueeze(0)
    cache = KVCache(lm.dims, max_slots=1, max_len=seq.shape[1], device="cpu", dtype=torch.float32)
    full = lm.logp(lm(seq, torch.tensor([0]), cache, attn_len=seq.shape[1], slots=torch.tensor([0])))[0]
    torch.testing.assert_close(full[-len(forced):], step_logp, atol=ATOL_LOGP, rtol=0)


def test_greedy_sequence(lm, load_fixture, manifest):
    """Argmax of the scores the sampler sees (EOS masked below min_len) with the official stop rule."""
    f, info = load_fixture("llm"), manifest["llm"]
    min_len, max_len, eos = info["min_len"], info["max_len"], info["eos_token"]
    assert min_len == 2 * f["text_token"].shape[1] and max_len == 20 * f["text_token"].shape[1]
    stop = set(info["stop_token_ids"])
    cache = KVCache(lm.dims, max_slots=1, max_len=f["lm_input"].shape[1] + max_len, device="cpu",
                    dtype=torch.float32)
    slot, pos, out = torch.tensor([0]), f["lm_input"].shape[1], []
    h = lm(f["lm_input"], torch.tensor([0]), cache, attn_len=pos, slots=slot)[:, -1]
    for step in range(max_len):
        scores = lm.logp(h)[0]
        if step < min_len:
            scores[eos] = float("-inf")
        token = int(scores.argmax())
        if token in stop:
            break
        out.append(token)
        h = lm(lm.speech_embedding.weight[token].view(1, 1, -1), torch.tensor([pos]), cache, attn_len=pos + 1,
               slots=slot)[:, -1]
        pos += 1
    assert out == f["greedy_tokens"].tolist()


def test_batched_decode_rows_are_independent(lm, load_fixture):
    """Two streams decoded in one batch (slots 0 and 1, different lengths) equal each decoded alone."""
    f = load_fixture("llm")
    forced = f["forced_tokens"].tolist()[:6]
    alone_a, _ = _prefill_and_step(lm, f["lm_input"], forced, 256)
    alone_b, _ = _prefill_and_step(lm, f["xl_lm_input"], forced, 256)
    cache = KVCache(lm.dims, max_slots=2, max_len=256, device="cpu", dtype=torch.float32)
    pos = []
    for slot, seq in enumerate((f["lm_input"], f["xl_lm_input"])):
        lm(seq, torch.tensor([0]), cache, attn_len=seq.shape[1], slots=torch.tensor([slot]))
        pos.append(seq.shape[1])
    for i, token in enumerate(forced):
        emb = lm.speech_embedding.weight[[token, token]].unsqueeze(1)
        h = lm(emb, torch.tensor(pos), cache, attn_len=256)[:, -1]
        logp = lm.logp(h)
        torch.testing.assert_close(logp[0], alone_a[i + 1], atol=ATOL_LOGP, rtol=0)
        torch.testing.assert_close(logp[1], alone_b[i + 1], atol=ATOL_LOGP, rtol=0)
        pos = [p + 1 for p in pos]


def test_fused_decode_step_matches_fixture_logp(lm, load_fixture):
    """The decode path of the engine (`SpeechLM.decode` over the fused ops' torch statements) reproduces
    the official teacher-forced log-probs, with its two rows at different positions in one batch."""
    from cosystream.kernels import reference

    f = load_fixture("llm")
    forced = f["forced_tokens"].tolist()
    n0 = f["lm_input"].shape[1]
    max_len = n0 + len(forced) + 8
    cache = KVCache(lm.dims, max_slots=2, max_len=max_len, device="cpu", dtype=torch.float32)
    lm(f["lm_input"], torch.tensor([0]), cache, attn_len=n0, slots=torch.tensor([0]))
    lm(f["lm_input"][:, :n0 - 1], torch.tensor([0]), cache, attn_len=n0 - 1, slots=torch.tensor([1]))
    # row 1 lags one position behind: it first re-feeds the prompt's last input, then follows row 0
    feed_1 = [f["lm_input"][0, n0 - 1]] + [lm.speech_embedding.weight[t] for t in forced[:-2]]
    logps = []
    for step, token in enumerate(forced[:-1]):
        emb = torch.stack([lm.speech_embedding.weight[token], feed_1[step]])
        h = lm.decode(emb, torch.tensor([n0 + step, n0 - 1 + step]), cache, max_len, reference)
        logps.append(lm.logp(h))
    logp = torch.stack(logps)  # [steps, 2, V]
    torch.testing.assert_close(logp[:, 0], f["step_logp"][1:], atol=ATOL_LOGP, rtol=0)
    torch.testing.assert_close(logp[1:, 1], f["step_logp"][1:-1], atol=ATOL_LOGP, rtol=0)


def _prefill_both_ways(lm, ops):
    """New prompts of 9 positions into cache rows 3 and 1: the fused prefill and `forward`."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 9, lm.dims.hidden_size, generator=g) * 0.5
    slots = torch.tensor([3, 1])
    caches = [KVCache(lm.dims, max_slots=4, max_len=16, device="cpu", dtype=torch.float32) for _ in range(2)]
    fused = lm.prefill(x, slots, caches[0], ops)
    plain = lm(x, torch.zeros(2, dtype=torch.long), caches[1], attn_len=9, slots=slots)
    return fused, plain, caches


def test_fused_prefill_computes_forwards_numbers(lm):
    from cosystream.kernels import reference

    fused, plain, (c_fused, c_plain) = _prefill_both_ways(lm, reference)
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c_fused.k, c_plain.k, atol=1e-5, rtol=1e-5)  # same rows, same positions
    torch.testing.assert_close(c_fused.v, c_plain.v, atol=1e-5, rtol=1e-5)
    assert c_fused.k[:, [0, 2]].abs().sum() == 0  # rows not prefilled stay untouched
