"""More streams than flow-pool slots: the extra ones wait for a slot instead of falling to the eager path.

On the H100 every stream beyond the pool that opened in the same batch as the one taking the last free
slot went to the eager per-request flow, whose own key/value cache (≈ 2.3 MB per frame) ran the GPU
out of memory at 64 streams. The pool exists on CUDA only, so here a one-slot CPU pool stands in.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_threads import synthesize_together

from cosystream.config import ChunkSchedule
from cosystream.engine.chunking import ChunkPlanner
from cosystream.engine.flow_runner import FlowRunner
from cosystream.engine.sync_engine import Engine
from cosystream.params import SamplingParams, SynthesisParams


def test_streams_beyond_the_pool_wait_for_a_slot(model_dir, fixture_dir, tmp_path, monkeypatch):
    eng = Engine.from_pretrained(model_dir, voices_db=str(tmp_path / "v.db"), max_streams=4)
    try:
        eng.run(eng.async_engine.add_voice("v", str(fixture_dir / "prompt_24k.wav"), "Hello there."))
        t2w = eng.async_engine.core.t2w
        t2w.pool = FlowRunner(t2w.flow, num_slots=1, max_frames=512, use_graphs=False)
        opened = []  # the kind of flow state each new stream got
        real_open = t2w.open_streams

        def open_streams(items):
            states = real_open(items)
            opened.extend(type(state.flow).__name__ for state in states)
            return states

        monkeypatch.setattr(t2w, "open_streams", open_streams)
        params = [SynthesisParams(text="a line to say.", voice="v", force_tokens=30,
                                  sampling=SamplingParams(greedy=True, seed=i)) for i in range(3)]
        results = synthesize_together(eng, params)
        assert all(not isinstance(r, Exception) for r in results), results
        assert all(len(r.pcm) > 0 for r in results)
        assert opened == ["PooledStream"] * 3  # every stream ran in the pool's one slot, one after another
        assert t2w.pool.free == [0]
    finally:
        eng.close()


@pytest.mark.parametrize(("final_attention", "slot", "first_hop"), [
    ("full", "first chunk", None), ("chunk", "first chunk", None), ("full", "shorter than the prompt", None),
    ("full", "shorter than the prompt", 15)])  # 15: a provisional first chunk (ends inside a block)
def test_a_stream_of_unknown_length_starts_in_the_pool_and_sounds_as_the_eager_path(model_dir, fixture_dir, tmp_path,
                                                                                   monkeypatch, final_attention,
                                                                                   slot, first_hop):
    """A request without a forced length may run to 20 tokens per text token (spec/llm.md §4), far past a
    slot; with real weights the LM stops long before. The stream still opens in the pool (its first chunk
    fits); the official final pass runs there longer than the slot ("full"), an incremental final chunk
    that would outgrow the slot recomputes every frame as the official code does ("chunk"). A voice whose
    prompt is longer than a slot opens there too, without its encoded prompt, and recomputes every chunk.
    The audio is the eager path's."""
    eng = Engine.from_pretrained(model_dir, voices_db=str(tmp_path / "v.db"), max_streams=4,
                                 final_attention=final_attention)
    try:
        eng.run(eng.async_engine.add_voice("v", str(fixture_dir / "prompt_24k.wav"), "Hello there."))
        num_prompt = int(eng.async_engine.voice_prompt("v").prompt_speech_tokens.shape[0])
        params = SynthesisParams(text="Here is a somewhat longer line of text to say out loud today.", voice="v",
                                 sampling=SamplingParams(greedy=True, seed=0), first_hop=first_hop)
        want = eng.synthesize(params)  # no pool on the CPU: the eager path
        t2w = eng.async_engine.core.t2w
        planner = ChunkPlanner(ChunkSchedule(), num_prompt, block=eng.async_engine.hparams.chunk_size)
        first_chunk_frames = 2 * (num_prompt + planner.first_chunk_tokens)
        frames = first_chunk_frames + 8 if slot == "first chunk" else num_prompt
        t2w.pool = FlowRunner(t2w.flow, num_slots=1, max_frames=frames, use_graphs=False)
        opened = []
        real_start = t2w.start

        def start(*args, **kwargs):
            state = real_start(*args, **kwargs)
            opened.append(type(state.flow).__name__)
            return state

        recomputed = []  # finalize flag of each chunk recomputed
        real_recompute = t2w.pool.recompute_many
        monkeypatch.setattr(t2w, "start", start)
        monkeypatch.setattr(t2w.pool, "recompute_many",
                            lambda items: recomputed.extend(f for _, _, f in items) or real_recompute(items))
        got = eng.synthesize(params)
        assert opened == ["PooledStream"]
        if slot == "first chunk":
            assert recomputed == ([True] if final_attention == "chunk" else [])
        else:
            assert len(recomputed) == got.num_chunks - 1 >= 1 and not any(recomputed)
        assert want.times.num_tokens == got.times.num_tokens and 2 * (num_prompt + got.times.num_tokens) > \
            t2w.pool.max_frames  # the utterance is longer than the slot it ran in
        assert len(got.pcm) == len(want.pcm)
        np.testing.assert_allclose(got.pcm, want.pcm, atol=2e-3)
        assert t2w.pool.free == [0]
    finally:
        eng.close()


def test_a_voice_prompt_longer_than_a_slot_is_not_encoded(checkpoint, load_fixture):
    """Its streams recompute every chunk, so building its prompt's keys (a flow pass; on the GPU an eager
    one, as no slot holds them) would be wasted: the voice gets its prompt unencoded."""
    from types import SimpleNamespace

    from cosystream.config import EngineConfig
    from cosystream.engine.loader import load_flow, load_hift
    from cosystream.engine.token2wav import Token2WavRunner

    f = load_fixture("stream")
    t2w = Token2WavRunner(load_flow(checkpoint), load_hift(checkpoint), EngineConfig())
    inputs = SimpleNamespace(flow_prompt_speech_tokens=f["prompt_token"][0], prompt_mel=f["prompt_feat"][0],
                             xvector=f["embedding"][0])
    t2w.pool = FlowRunner(t2w.flow, num_slots=1, max_frames=f["prompt_token"].shape[1], use_graphs=False)
    assert t2w._build_prompt_cache(inputs).num_tokens == 0
    t2w.pool = FlowRunner(t2w.flow, num_slots=1, max_frames=512, use_graphs=False)
    assert t2w._build_prompt_cache(inputs).num_tokens > 0
