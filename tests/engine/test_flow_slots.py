"""More streams than flow-pool slots: the extra ones wait for a slot instead of falling to the eager path.

On the H100 every stream beyond the pool that opened in the same batch as the one taking the last free
slot went to the eager per-request flow, whose own key/value cache (≈ 2.3 MB per frame) ran the GPU
out of memory at 64 streams. The pool exists on CUDA only, so here a one-slot CPU pool stands in.
"""

from __future__ import annotations

from engine_threads import synthesize_together

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
        real_start = t2w.start

        def start(*args, **kwargs):
            state = real_start(*args, **kwargs)
            opened.append(type(state.flow).__name__)
            return state

        monkeypatch.setattr(t2w, "start", start)
        params = [SynthesisParams(text="a line to say.", voice="v", force_tokens=30,
                                  sampling=SamplingParams(greedy=True, seed=i)) for i in range(3)]
        results = synthesize_together(eng, params)
        assert all(not isinstance(r, Exception) for r in results), results
        assert all(len(r.pcm) > 0 for r in results)
        assert opened == ["PooledStream"] * 3  # every stream ran in the pool's one slot, one after another
        assert t2w.pool.free == [0]
    finally:
        eng.close()
