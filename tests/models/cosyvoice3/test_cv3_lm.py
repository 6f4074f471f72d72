"""CosyVoice3LM against llm.safetensors / sampling.safetensors of the CosyVoice3 set (§C2)."""

from __future__ import annotations

import pytest
import torch

from cosystream.models.cosyvoice3.lm import (
    ENDOFPROMPT_ID,
    MAX_SILENT_RUN,
    SILENT_TOKENS,
    SilentTokenFilter,
    text_length_limits,
)
from cosystream.models.qwen2 import KVCache
from cosystream.models.sampling import SamplingBatch, nucleus_candidates, ras_sample_reference, sample_tokens

LOGP_ATOL = 1e-4  # README §C3: LM step logp


def _inputs(lm, e2e: dict, mode: str) -> torch.Tensor:
    text = e2e[f"{mode}_in_text"][0]
    prompt_text = e2e.get(f"{mode}_in_prompt_text")
    speech = e2e.get(f"{mode}_in_llm_prompt_speech_token")
    return lm.embed_prompt(text, speech[0] if speech is not None else torch.zeros(0, dtype=torch.long),
                           prompt_text[0] if prompt_text is not None else None)


class Decoder:
    """KV-cached stepping of the LM: prefill, then one speech token at a time."""

    def __init__(self, lm, embeds: torch.Tensor, max_len: int) -> None:
        self.lm = lm
        self.cache = KVCache(lm.dims, 1, embeds.shape[0] + max_len + 1, "cpu", torch.float32)
        n = embeds.shape[0]
        self.hidden = lm(embeds.unsqueeze(0), torch.zeros(1, dtype=torch.long), self.cache, n)[:, -1]
        self.pos = n

    def logp(self) -> torch.Tensor:
        return self.lm.logp(self.hidden)[0]

    def feed(self, token: int) -> None:
        emb = self.lm.speech_embedding.weight[token].view(1, 1, -1)
        self.hidden = self.lm(emb, torch.tensor([self.pos]), self.cache, self.pos + 1)[:, -1]
        self.pos += 1


@pytest.mark.parity
@pytest.mark.parametrize("mode,key", [("zero_shot", "zs"), ("cross_lingual", "xl"), ("instruct2", "ins")])
def test_lm_input_assembly(cv3_lm, cv3_load, mode, key):
    with torch.no_grad():
        got = _inputs(cv3_lm, cv3_load("e2e"), mode)
    want = cv3_load("llm")[f"{key}_lm_input"][0]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parity
def test_zero_shot_teacher_forced_logp(cv3_lm, cv3_load):
    llm = cv3_load("llm")
    forced = llm["zs_forced_tokens"].tolist()
    want = llm["zs_step_logp"]
    with torch.no_grad():
        dec = Decoder(cv3_lm, llm["zs_lm_input"][0], len(forced))
        got = []
        for token in forced[: want.shape[0]]:
            got.append(dec.logp())
            dec.feed(token)
    assert want.shape[1] == cv3_lm.num_speech_classes
    torch.testing.assert_close(torch.stack(got), want, rtol=0, atol=LOGP_ATOL)


@pytest.mark.parity
@pytest.mark.parametrize("key", ["xl", "ins"])
def test_first_step_logp_without_prompt_speech(cv3_lm, cv3_load, key):
    llm = cv3_load("llm")
    with torch.no_grad():
        got = Decoder(cv3_lm, llm[f"{key}_lm_input"][0], 1).logp()
    torch.testing.assert_close(got, llm[f"{key}_step_logp"][0], rtol=0, atol=LOGP_ATOL)


@pytest.mark.parity
def test_greedy_tokens_and_stop_rule(cv3_lm, cv3_load, cv3_manifest):
    """Argmax of what the official sampler receives (only SOS masked before min_len), official stop rule."""
    llm, info = cv3_load("llm"), cv3_manifest["llm"]
    min_len, max_len = text_length_limits(info["text_len"])
    assert (min_len, max_len) == (info["min_len"], info["max_len"])
    assert cv3_lm.ignore_eos_index == info["ignore_eos_masks_index"] == cv3_lm.sos
    assert (cv3_lm.sos, cv3_lm.eos, cv3_lm.task_id, cv3_lm.fill) == (info["sos"], info["eos"], info["task_id"],
                                                                      info["fill"])
    out: list[int] = []
    with torch.no_grad():
        dec = Decoder(cv3_lm, llm["zs_lm_input"][0], max_len)
        for step in range(max_len):
            logp = dec.logp()
            token = int(cv3_lm.sampler_scores(logp, step, min_len).argmax())
            if cv3_lm.is_stop(token):
                break
            out.append(token)
            dec.feed(token)
    assert out == llm["zs_greedy_tokens"].tolist()
    assert token == info["greedy_stop_token"]
    torch.testing.assert_close(logp, llm["zs_greedy_stop_step_logp"][0], rtol=0, atol=LOGP_ATOL)


@pytest.mark.parity
def test_stop_set_is_every_id_from_speech_token_size(cv3_lm, cv3_manifest):
    low, high = cv3_manifest["llm"]["stop_token_ids"]
    assert [cv3_lm.is_stop(i) for i in (low - 1, low, low + 1, high)] == [False, True, True, True]
    assert high == cv3_lm.num_speech_classes - 1


@pytest.mark.parity
def test_missing_endofprompt_is_refused(cv3_lm, cv3_load):
    text = cv3_load("e2e")["zero_shot_in_text"][0]
    with pytest.raises(ValueError, match="endofprompt"):
        cv3_lm.embed_prompt(text, torch.zeros(0, dtype=torch.long), text[:5])


@pytest.mark.parity
def test_sampler_masks_only_the_ignore_eos_index(cv3_lm, cv3_load):
    """The shared batched sampler, given the CosyVoice3 masked index, sees what the official sampler sees."""
    logp = cv3_load("llm")["zs_step_logp"][0]
    batch = SamplingBatch(
        seeds=torch.zeros(1, dtype=torch.int64), steps=torch.zeros(1, dtype=torch.int64),
        min_len=torch.full((1,), 10, dtype=torch.int64), top_p=torch.full((1,), 0.8),
        top_k=torch.full((1,), 25, dtype=torch.int64), repeat_threshold=torch.full((1,), 1.0),
        window=torch.full((1,), 10, dtype=torch.int64), history=torch.full((1, 10), -1, dtype=torch.int64),
        forced=torch.full((1,), -1, dtype=torch.int64), greedy=torch.ones(1, dtype=torch.bool),
        ban_special=torch.zeros(1, dtype=torch.bool))
    peaked = logp.clone()
    peaked[cv3_lm.ignore_eos_index] = 50.0  # would win if it were not masked
    token = sample_tokens(peaked.unsqueeze(0), batch, cv3_lm.ignore_eos_index)
    assert int(token) == int(cv3_lm.sampler_scores(peaked, 0, 10).argmax()) != cv3_lm.ignore_eos_index
    peaked[cv3_lm.eos] = 60.0  # EOS is not masked: the official quirk lets it stop early
    assert int(sample_tokens(peaked.unsqueeze(0), batch, cv3_lm.ignore_eos_index)) == cv3_lm.eos


@pytest.mark.parity
@pytest.mark.parametrize("case", [0, 1])
def test_nucleus_candidates(cv3_lm, cv3_load, cv3_manifest, case):
    samp = cv3_load("sampling")
    params = cv3_manifest["sampling"]["ras_params"]
    scores = cv3_lm.sampler_scores(cv3_load("llm")["zs_step_logp"][case], 0, 1)
    ids, vals, keep = nucleus_candidates(scores.softmax(-1).unsqueeze(0), torch.tensor([params["top_p"]]),
                                         torch.tensor([params["top_k"]]))
    n = int(keep.sum())
    expected = cv3_manifest["sampling"]["nucleus_cases"][case]["n_candidates"]
    assert n == expected == samp[f"nucleus_case{case}_ids"].numel()
    assert ids[0, :n].tolist() == samp[f"nucleus_case{case}_ids"].tolist()
    torch.testing.assert_close(vals[0, :n], samp[f"nucleus_case{case}_probs"], rtol=1e-5, atol=1e-7)


@pytest.mark.parity
@pytest.mark.parametrize("name", ["top_in_last10", "top_only_11_back"])
def test_ras_rule_on_the_cv3_vocabulary(cv3_load, cv3_manifest, name):
    case = cv3_manifest["sampling"]["ras_cases"][name]
    params = cv3_manifest["sampling"]["ras_params"]
    logp = cv3_load("sampling")["ras_peaked_logp"]
    got = []
    for seed in range(len(case["torch_seeded_outputs_seed0_19"])):
        torch.manual_seed(seed)
        got.append(ras_sample_reference(logp, case["history"], params["top_p"], params["top_k"],
                                        params["win_size"], params["tau_r"]))
    assert got == case["torch_seeded_outputs_seed0_19"]


def test_silent_token_filter_drops_runs_longer_than_five():
    silent = sorted(SILENT_TOKENS)[0]
    stream = [silent] * (MAX_SILENT_RUN + 3) + [100] + [silent] * 2
    filt = SilentTokenFilter()
    kept = [t for t in stream if filt.keep(t)]
    assert kept == [silent] * MAX_SILENT_RUN + [100] + [silent] * 2


def test_bistream_prompt_starts_with_the_system_prefix(cv3_lm, cv3_load):
    """Text streaming: SOS, then the prompt text through `<|endofprompt|>` outside the interleave, then groups
    of 5 text (rest of the prompt text first) and 15 prompt speech embeddings (official inference_bistream)."""
    from cosystream.engine.bistream import BistreamState, Feed

    e2e = cv3_load("e2e")
    prompt_text = e2e["zero_shot_in_prompt_text"][0]
    speech = e2e["zero_shot_in_llm_prompt_speech_token"][0]
    cut = prompt_text.tolist().index(ENDOFPROMPT_ID) + 1
    with torch.no_grad():
        prefix, rest, speech_emb = cv3_lm.bistream_prompt(prompt_text, speech)
        sos, task = cv3_lm.special_rows()
        state = BistreamState(sos, task, rest, speech_emb, cv3_lm.fill, cv3_lm.dims.mix_ratio, prefix=prefix)
        text = cv3_lm.text_embedding(e2e["zero_shot_in_text"][0].long())
        state.add_text(text)
    fed = list(state.pending)
    assert state.next_feed() is Feed.extend  # with enough text every prompt speech group is paired
    assert torch.equal(fed[0], cv3_lm.speech_embedding.weight[cv3_lm.sos])
    n_text, n_speech = cv3_lm.dims.mix_ratio
    assert all(torch.equal(a, b) for a, b in zip(fed[1:1 + cut], prefix, strict=True))
    first_group = fed[1 + cut:1 + cut + n_text]
    assert all(torch.equal(a, b) for a, b in zip(first_group, rest[:n_text], strict=True))
    speech_group = fed[1 + cut + n_text:1 + cut + n_text + n_speech]
    assert all(torch.equal(a, b) for a, b in zip(speech_group, speech_emb[:n_speech], strict=True))
    with pytest.raises(ValueError, match="endofprompt"):
        cv3_lm.bistream_prompt(prompt_text[cut:], speech)
