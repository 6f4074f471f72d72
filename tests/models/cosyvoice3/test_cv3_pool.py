"""The static-shape, batched CosyVoice3 flow (models/cosyvoice3/pool.py) against the eager `FlowStream`.

Mixed batches: streams with different prompts (registered-voice prompt blocks or none), offsets, chunk
sizes and finals, padded to a common frame count and attending over a common key length. The eager
`FlowStream` reproduces the official chunks (test_cv3_stream.py), so equality with it within float32
rounding ties the pooled path to the fixtures too.
"""

from __future__ import annotations

import pytest
import torch

from cosystream.kernels import reference as reference_kernels
from cosystream.models.cosyvoice3.flow import FlowStream, encode_prompt_blocks
from cosystream.models.cosyvoice3.pool import FlowSlotPool, PooledFlowStream, pack_chunks, run_chunks
from cosystream.models.cosyvoice3.stream import StreamSchedule

pytestmark = pytest.mark.parity

ATOL = 2e-5  # float32 rounding: other batch shapes and a longer softmax over masked keys (mel values up to ~7)


def _streams(cv3_load, cv3_manifest, cv3_flow) -> list[tuple[torch.Tensor, ...]]:
    """(prompt tokens, prompt mel, x-vector, target tokens) of every e2e run of the set."""
    e2e = cv3_load("e2e")
    out = []
    for mode, run in cv3_manifest["e2e"].items():
        src = run.get("prompt_inputs_from", mode)
        out.append(tuple(e2e[f"{src}_in_{k}"] for k in ("flow_prompt_speech_token", "prompt_speech_feat",
                                                        "flow_embedding")) + (e2e[f"{mode}_speech_tokens"],))
    return out


def _pool_for(flow, streams, slots: int) -> FlowSlotPool:
    longest = max(flow.ratio * (p.shape[1] + t.shape[1]) for p, _, _, t in streams)
    return FlowSlotPool(flow, slots, longest + flow.decoder.estimator.dims.static_chunk_size, ops=reference_kernels)


@pytest.mark.parametrize("final_chunk", [False, True])
def test_mixed_batches_equal_the_eager_stream(cv3_flow, cv3_load, cv3_manifest, final_chunk):
    """Every stream's schedule runs round by round, all streams' chunks of a round in one batched call."""
    streams = _streams(cv3_load, cv3_manifest, cv3_flow)
    streams = streams + streams[:1]  # the same voice twice: one with its prompt blocks, one without
    pool = _pool_for(cv3_flow, streams, len(streams))
    eager, pooled, calls = [], [], []
    with torch.no_grad():
        for i, (prompt, feat, xvec, tokens) in enumerate(streams):
            blocks = encode_prompt_blocks(cv3_flow, prompt, feat, xvec) if i % 2 == 0 else None
            eager.append(FlowStream(cv3_flow, prompt, feat, xvec, blocks))
            pooled.append(PooledFlowStream(pool, prompt, feat, xvec, blocks))
            schedule = StreamSchedule(prompt.shape[1])
            # every stream's calls, the final one block-causal (the "chunk" final attention) or left out
            all_calls = schedule.all_calls(tokens.shape[1])
            calls.append(all_calls if final_chunk else all_calls[:-1])
        assert len({p.slot for p in pooled}) == len(pooled)
        for r in range(max(len(c) for c in calls)):
            live = [i for i in range(len(streams)) if r < len(calls[i])]
            chunks = [pooled[i].prepare(streams[i][3][:, :calls[i][r].num_tokens], calls[i][r].token_offset,
                                        calls[i][r].finalize) for i in live]
            got = run_chunks(pool, chunks)
            for i, mel in zip(live, got, strict=True):
                call = calls[i][r]
                want = eager[i].push(streams[i][3][:, :call.num_tokens], call.token_offset, call.finalize)
                assert mel.shape == want.shape
                torch.testing.assert_close(mel, want, rtol=0, atol=ATOL)
                assert pool.lengths[pooled[i].slot] == eager[i].state.caches[0].length


def test_padding_and_spare_keys_do_not_change_a_chunk(cv3_flow, cv3_load, cv3_manifest):
    """One stream's chunk alone, then padded to more frames and attending over more (stale) key frames,
    after a first run of the same chunk that was not committed (a CUDA graph's warm-up before its
    replay: the slot must not change until `finish_chunks`)."""
    prompt, feat, xvec, tokens = _streams(cv3_load, cv3_manifest, cv3_flow)[0]
    block = cv3_flow.decoder.estimator.dims.static_chunk_size
    pool = _pool_for(cv3_flow, [(prompt, feat, xvec, tokens)], 2)
    call = StreamSchedule(prompt.shape[1]).all_calls(tokens.shape[1])[0]
    outs = []
    with torch.no_grad():
        for extra in (0, block):
            stream = PooledFlowStream(pool, prompt, feat, xvec)
            pool.keys.normal_()  # stale garbage everywhere a real query must not look
            pool.values.normal_()
            chunk = stream.prepare(tokens[:, :call.num_tokens], call.token_offset, call.finalize)
            frames = chunk.valid + extra
            key_frames = min(chunk.start + frames, pool.max_frames + 1)
            if extra:
                pool.chunk(*pack_chunks(pool, [chunk], frames), key_frames=key_frames)
            outs.append(run_chunks(pool, [chunk], frames=frames, key_frames=min(chunk.start + frames,
                                                                                pool.max_frames + 1))[0])
            stream.close()
        want = FlowStream(cv3_flow, prompt, feat, xvec).push(tokens[:, :call.num_tokens], call.token_offset,
                                                             call.finalize)
    for mel in outs:
        torch.testing.assert_close(mel, want, rtol=0, atol=ATOL)


def test_slots_are_exported_to_an_eager_stream_and_given_back(cv3_flow, cv3_load, cv3_manifest):
    """A stream can leave the pool mid-utterance: its slot as eager caches continues exactly."""
    prompt, feat, xvec, tokens = _streams(cv3_load, cv3_manifest, cv3_flow)[0]
    pool = _pool_for(cv3_flow, [(prompt, feat, xvec, tokens)], 1)
    calls = StreamSchedule(prompt.shape[1]).all_calls(tokens.shape[1])
    with torch.no_grad():
        pooled = PooledFlowStream(pool, prompt, feat, xvec)
        with pytest.raises(RuntimeError, match="no free slot"):
            PooledFlowStream(pool, prompt, feat, xvec)
        eager = FlowStream(cv3_flow, prompt, feat, xvec)
        first = calls[0]
        run_chunks(pool, [pooled.prepare(tokens[:, :first.num_tokens], first.token_offset, first.finalize)])
        eager.push(tokens[:, :first.num_tokens], first.token_offset, first.finalize)
        moved = FlowStream(cv3_flow, prompt, feat, xvec)
        moved.state.caches = pool.export(pooled.slot)
        pooled.close()
        pooled.close()  # idempotent
        assert pool.free == [0]
        for call in calls[1:]:
            got = moved.push(tokens[:, :call.num_tokens], call.token_offset, call.finalize)
            want = eager.push(tokens[:, :call.num_tokens], call.token_offset, call.finalize)
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_final_full_passes_of_several_streams_equal_the_official_call(cv3_flow, cv3_load, cv3_manifest):
    """The official final call (full attention over every frame) of each stream, batched in the slots the
    streams' earlier chunks filled (their conv tails and keys must not leak in)."""
    streams = _streams(cv3_load, cv3_manifest, cv3_flow)
    pool = _pool_for(cv3_flow, streams, len(streams))
    chunks, wants = [], []
    with torch.no_grad():
        for prompt, feat, xvec, tokens in streams:
            pooled = PooledFlowStream(pool, prompt, feat, xvec, encode_prompt_blocks(cv3_flow, prompt, feat, xvec))
            calls = StreamSchedule(prompt.shape[1]).all_calls(tokens.shape[1])
            for call in calls[:-1]:
                run_chunks(pool, [pooled.prepare(tokens[:, :call.num_tokens], call.token_offset, call.finalize)])
            final = calls[-1]
            chunks.append(pooled.prepare_full(tokens[:, :final.num_tokens], final.token_offset))
            mel = cv3_flow.inference(tokens[:, :final.num_tokens], prompt, feat, xvec, streaming=False, finalize=True)
            wants.append(mel[:, :, cv3_flow.ratio * final.token_offset:])
        block = cv3_flow.decoder.estimator.dims.static_chunk_size
        got = run_chunks(pool, chunks, frames=max(c.valid for c in chunks) + block)
    for mel, want in zip(got, wants, strict=True):
        assert mel.shape == want.shape
        torch.testing.assert_close(mel, want, rtol=0, atol=ATOL)
