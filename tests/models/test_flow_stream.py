"""Incremental streaming flow: exact against the official streaming calls and against recomputation."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch

from cosystream.checkpoint import check_and_load
from cosystream.models.cfm import build_noise_table
from cosystream.models.estimator import chunk_attention_bias
from cosystream.models.flow import Flow
from cosystream.models.flow_stream import FlowStream, FlowStreamState, PromptCache, cache_bytes_per_frame

pytestmark = pytest.mark.parity
ATOL_MEL = 1e-4


@pytest.fixture(scope="module")
def flow(checkpoint, cfm_noise) -> Flow:
    model = Flow(checkpoint.hparams.flow)
    check_and_load(model, checkpoint.flow_state(), "flow.pt")
    model.decoder.set_noise_table(cfm_noise)
    return model.eval()


@pytest.fixture(scope="module")
def flow_long(flow) -> Flow:
    """The same weights with the whole 15000-frame noise table, for schedules of our own (self-consistency
    tests need no official noise, and must not depend on the stored prefix's length)."""
    model = copy.deepcopy(flow)
    model.decoder.set_noise_table(build_noise_table(flow.dims.output_size))
    return model


@pytest.fixture(scope="module")
def s(load_fixture) -> dict[str, torch.Tensor]:
    return load_fixture("stream")


def _tokens(s: dict[str, torch.Tensor], num_tokens: int) -> torch.Tensor:
    """At least num_tokens target tokens: the stream fixture's tokens, tiled if the set has fewer."""
    token = s["token"]
    return token.repeat(1, math.ceil(num_tokens / token.shape[1]))[:, :num_tokens]


def _other_prompt_len(num_prompt: int) -> int:
    """A shorter prompt length that is not a multiple of 25 (so the first hop is padded)."""
    n = max(num_prompt - 7, 1)
    return n - 1 if n % 25 == 0 else n


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL_MEL, rtol=0)


def _ends(num_prompt: int, hops: list[int], chunk: int) -> list[int]:
    """Target-token offsets after each hop, the first hop padded so P + offset hits a chunk boundary."""
    pad = math.ceil(num_prompt / chunk) * chunk - num_prompt
    ends, offset = [], 0
    for i, hop in enumerate(hops):
        offset += hop + (pad if i == 0 else 0)
        ends.append(offset)
    return ends


@dataclass
class Run:
    """A request streamed up to its final chunk: the state before `finish` and what it emitted."""

    state: FlowStreamState
    mels: list[torch.Tensor]
    ends: list[int]  # target-token offset after each non-final chunk
    tokens: torch.Tensor  # all target tokens; the final chunk uses them all
    prompt: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # prompt tokens, prompt mel, x-vector


def _stream(flow: Flow, prompt: tuple[torch.Tensor, ...], ends: list[int], tokens: torch.Tensor) -> Run:
    stream = FlowStream(flow)
    voice = stream.build_prompt_cache(*prompt)
    assert voice.num_tokens == stream.prompt_cache_tokens(prompt[0].shape[1])
    state = stream.start(voice, max_target_tokens=tokens.shape[1] // 2)  # the caches must grow once
    mels = [stream.feed(state, tokens[:, :end + 3]) for end in ends]
    return Run(state, mels, ends, tokens, prompt)


def _finish(flow: Flow, run: Run, final_attention: str) -> torch.Tensor:
    state = copy.deepcopy(run.state)
    mel = FlowStream(flow, final_attention).finish(state, run.tokens)
    assert state.is_finished
    return mel


@pytest.fixture(scope="module")
def official_run(flow, s, manifest) -> Run:
    """The recorded official schedule (manifest stream.schedule), streamed incrementally."""
    schedule = manifest["stream"]["schedule"]
    assert schedule[-1]["flow_finalize"] and not any(c["flow_finalize"] for c in schedule[:-1])
    ends = [c["n_tokens"] - 3 for c in schedule[:-1]]
    tokens = s["token"][:, :schedule[-1]["n_tokens"]]
    return _stream(flow, (s["prompt_token"], s["prompt_feat"], s["embedding"]), ends, tokens)


def test_incremental_chunks_match_official_calls(official_run, s):
    for i, mel in enumerate(official_run.mels):
        _close(mel, s[f"call{i}_flow_mel_sliced"])


def test_incremental_final_full_attention_matches_official_final_call(flow, official_run, s):
    last = len(official_run.mels)
    _close(_finish(flow, official_run, "full"), s[f"call{last}_flow_mel_sliced"])


def test_incremental_final_chunk_attention_equals_streaming_finalize_call(flow, official_run, s):
    """The documented deviation: chunk masks for the tail == the official streaming=True, finalize=True."""
    mel = _finish(flow, official_run, "chunk")
    assert mel.shape == s[f"call{len(official_run.mels)}_flow_mel_sliced"].shape
    ref = flow.inference(official_run.tokens, *official_run.prompt, streaming=True, finalize=True)
    _close(mel, ref[:, :, 2 * official_run.ends[-1]:])


@pytest.fixture(scope="module", params=["shorter_prompt", "no_prompt"])
def other_run(request, flow_long, s) -> Run:
    """Hops of one chunk each after a padded first hop, with a prompt length that is not a multiple of 25
    (or no prompt at all); the caches start too small and must grow."""
    num_prompt = _other_prompt_len(s["prompt_token"].shape[1]) if request.param == "shorter_prompt" else 0
    prompt = (s["prompt_token"][:, :num_prompt], s["prompt_feat"][:, :2 * num_prompt], s["embedding"])
    hop = flow_long.dims.encoder.static_chunk_size
    ends = _ends(num_prompt, [hop, hop, hop], hop)
    return _stream(flow_long, prompt, ends, _tokens(s, ends[-1] + 3 + 11))


def test_incremental_chunks_equal_recomputation(flow_long, other_run):
    offset = 0
    for end, mel in zip(other_run.ends, other_run.mels, strict=True):
        tokens = other_run.tokens[:, :end + 3]
        ref = flow_long.inference(tokens, *other_run.prompt, streaming=True, finalize=False)
        assert mel.shape[2] == 2 * (end - offset)
        _close(mel, ref[:, :, 2 * offset:])
        offset = end


@pytest.mark.parametrize("final_attention", ["full", "chunk"])
def test_incremental_final_equals_recomputation(flow_long, other_run, final_attention):
    ref = flow_long.inference(other_run.tokens, *other_run.prompt, streaming=final_attention == "chunk",
                              finalize=True)
    _close(_finish(flow_long, other_run, final_attention), ref[:, :, 2 * other_run.ends[-1]:])


def test_batched_chunks_equal_each_alone(flow_long, s):
    """Two requests (different prompts, speakers, tokens, cache lengths) batched == each alone."""
    stream = FlowStream(flow_long)
    num_prompt = s["prompt_token"].shape[1]
    prompts = [(s["prompt_token"], s["prompt_feat"], s["embedding"]),
               (s["prompt_token"][:, 3:], s["prompt_feat"][:, 6:], s["embedding"].flip(1))]
    # Request 1's first hop is 2 chunks longer, so the two caches differ in length during the batched hops.
    hop = stream.chunk_tokens
    firsts = [_ends(num_prompt, [hop], hop)[0], _ends(num_prompt - 3, [3 * hop], hop)[0]]
    ends = [[f, f + hop, f + 2 * hop] for f in firsts]
    assert num_prompt + firsts[0] != num_prompt - 3 + firsts[1]
    tokens = _tokens(s, max(firsts) + 2 * hop + 3)
    token_sets = [tokens, tokens.flip(1)]

    def run(batched: bool) -> list[list[torch.Tensor]]:
        states = [stream.start(stream.build_prompt_cache(*p)) for p in prompts]
        outs = [[stream.feed(st, tok[:, :e[0] + 3])]
                for st, tok, e in zip(states, token_sets, ends, strict=True)]
        for idx in (1, 2):
            chunks = [tok[:, :e[idx] + 3] for tok, e in zip(token_sets, ends, strict=True)]
            mels = (stream.feed_batch(states, chunks) if batched
                    else [stream.feed(st, c) for st, c in zip(states, chunks, strict=True)])
            for out, mel in zip(outs, mels, strict=True):
                out.append(mel)
        return outs

    alone, together = run(batched=False), run(batched=True)
    for a_req, t_req in zip(alone, together, strict=True):
        for a, t in zip(a_req, t_req, strict=True):
            assert a.shape == t.shape
            _close(t, a)


def test_prompt_cache_is_reusable_and_serialisable(flow_long, s):
    stream = FlowStream(flow_long)
    voice = stream.build_prompt_cache(s["prompt_token"], s["prompt_feat"], s["embedding"])
    restored = PromptCache.from_tensors({k: v.clone() for k, v in voice.to_tensors().items()})
    assert restored.num_tokens == voice.num_tokens
    end = _ends(s["prompt_token"].shape[1], [stream.chunk_tokens], stream.chunk_tokens)[0]
    tokens = _tokens(s, end + 3)
    first = stream.feed(stream.start(voice), tokens)
    again = stream.feed(stream.start(voice), tokens)  # the voice cache was not modified by a request
    from_store = stream.feed(stream.start(restored), tokens)
    assert torch.equal(first, again)
    assert torch.equal(first, from_store)


def test_prompts_with_nothing_encoded_share_zeros_no_stream_writes(flow_long, s):
    """Empty prompts (where a prompt cache starts, and a stream that recomputes its prompt) share one set of
    zero states; streams started from them, fed chunks and used to build a cache leave them zeros."""
    stream = FlowStream(flow_long)
    a = stream.empty_prompt(s["prompt_token"], s["prompt_feat"], s["embedding"])
    b = stream.without_cache(a)
    assert a.encoder is b.encoder and a.kv is b.kv and a.conv is b.conv and a.num_tokens == 0
    end = _ends(s["prompt_token"].shape[1], [stream.chunk_tokens], stream.chunk_tokens)[0]
    state = stream.start(a, max_target_tokens=end + 3)
    stream.feed(state, _tokens(s, end + 3))
    stream.build_prompt_cache(s["prompt_token"], s["prompt_feat"], s["embedding"])
    e = a.encoder
    for t in (e.kv_tokens, e.kv_frames, e.lookahead_tail, e.up_tail, a.kv, a.conv):
        assert not t.any()
    assert e.num_tokens == 0


def test_misaligned_chunk_is_rejected(flow_long, s):
    stream = FlowStream(flow_long)
    state = stream.start(stream.build_prompt_cache(s["prompt_token"], s["prompt_feat"], s["embedding"]))
    end = _ends(s["prompt_token"].shape[1], [stream.chunk_tokens], stream.chunk_tokens)[0]
    with pytest.raises(ValueError, match="boundary"):
        stream.feed(state, _tokens(s, end + 3 + 1))
    assert state.num_tokens == stream.prompt_cache_tokens(s["prompt_token"].shape[1])  # untouched
    with pytest.raises(ValueError, match="final_attention"):
        FlowStream(flow_long, final_attention="none")


def test_cache_bytes_per_frame_matches_allocation(flow, s):
    stream = FlowStream(flow)
    state = stream.start(stream.build_prompt_cache(s["prompt_token"], s["prompt_feat"], s["embedding"]))
    enc = state.encoder
    per_frame = (state.kv[..., 0, :].numel() * state.kv.element_size()
                 + enc.kv_frames[:, :, 0].numel() * enc.kv_frames.element_size()
                 + enc.kv_tokens[:, :, 0].numel() * enc.kv_tokens.element_size() // 2)
    assert per_frame == cache_bytes_per_frame(flow.dims, torch.float32)


def test_padded_cache_view_with_validity_bias_equals_exact_view(flow):
    """A cache view longer than the valid frames (garbage tail, as in a CUDA-graph bucket) changes nothing."""
    est = flow.decoder.estimator
    gen = torch.Generator().manual_seed(1)
    start, num_new, pad = 70, 30, 17
    kv = torch.randn(est.num_attention_blocks, 2, 2, start + num_new + pad, est.inner_dim, generator=gen)
    conv = torch.randn(2, est.conv_state_channels, 2, generator=gen)
    bins = flow.dims.output_size
    x, mu, cond = (torch.randn(2, bins, num_new, generator=gen) for _ in range(3))
    spks, t = torch.randn(2, bins, generator=gen), torch.full((2,), 0.4)
    pos = torch.arange(start, start + num_new)
    outs = []
    with torch.no_grad():
        for num_keys in (start + num_new, start + num_new + pad):
            bias = chunk_attention_bias(pos, num_keys, est.dims.static_chunk_size, kv.dtype)
            outs.append(est.step(x, mu, spks, cond, t, [kv.clone()], conv.clone(), pos[None], [bias]))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=0)
