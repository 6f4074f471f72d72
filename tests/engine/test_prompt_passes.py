"""New recordings sent with requests that arrive together: their flow prompt passes run batched.

The flow pool exists on CUDA only; a CPU FlowRunner stands in for it (as in test_flow_slots.py), so the
engine's decisions are those of a GPU run. The requests are held at the engine's inbox until all of them are
in (a call that blocks the engine thread), so "together" does not depend on this machine's timing.
"""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import soundfile as sf
from engine_threads import synthesize_together

from cosystream.engine.flow_runner import FlowRunner
from cosystream.engine.sync_engine import Engine
from cosystream.models.flow import UPSAMPLE
from cosystream.params import Mode, SamplingParams, SynthesisParams

TOKENS = 30  # forced: every request's length is known


def _recordings(wav_path, count: int) -> list[bytes]:
    """`count` distinct recordings of the fixture prompt: each its own few samples nudged, the last one also
    trimmed by 0.2 s (fewer prompt tokens, the same cache boundary for a prompt of this length)."""
    samples, rate = sf.read(str(wav_path), dtype="int16")
    out = []
    for i in range(count):
        own = samples.copy()
        own[-8:] += np.int16(i + 1)
        if i == count - 1:
            own = own[: len(own) - rate // 5]
        buffer = io.BytesIO()
        sf.write(buffer, own, rate, format="WAV", subtype="PCM_16")
        out.append(buffer.getvalue())
    return out


def _hold_until_submitted(core, count: int) -> threading.Thread:
    """Block the engine thread (a Call) until `count` requests have been submitted behind it."""
    submitted, all_in, real_submit = [0], threading.Event(), core.submit

    def submit(req):
        real_submit(req)
        submitted[0] += 1
        if submitted[0] >= count:
            all_in.set()

    core.submit = submit
    entered = threading.Event()

    def hold() -> None:
        entered.set()
        all_in.wait(timeout=120)

    thread = threading.Thread(target=core.call, args=(hold,), daemon=True)
    thread.start()
    entered.wait(timeout=30)
    return thread


@pytest.mark.parametrize("overlap", [False, True])
def test_new_recordings_arriving_together_get_one_batched_prompt_pass(model_dir, fixture_dir, tmp_path, overlap):
    count = 3
    eng = Engine.from_pretrained(model_dir, voices_db=str(tmp_path / "v.db"), max_streams=4,
                                 overlap_token2wav=overlap)
    try:
        core, t2w = eng.async_engine.core, eng.async_engine.core.t2w
        t2w.pool = FlowRunner(t2w.flow, num_slots=count + 1, max_frames=512, use_graphs=False)
        params = [SynthesisParams(text="a line to say.", mode=Mode.zero_shot, prompt_audio=audio,
                                  prompt_text="Hello there.", force_tokens=TOKENS,
                                  sampling=SamplingParams(greedy=True, seed=i))
                  for i, audio in enumerate(_recordings(fixture_dir / "prompt_24k.wav", count))]
        holder = _hold_until_submitted(core, count)
        results = synthesize_together(eng, params)
        holder.join(timeout=30)
        assert all(not isinstance(r, Exception) for r in results), results
        samples_per_token = UPSAMPLE * t2w.hift.upsample_scale
        assert all(len(r.pcm) == TOKENS * samples_per_token for r in results)
        stats = core.stats()
        # three new voices, one flow call over their prompts (the trimmed one has fewer tokens, one boundary)
        assert stats["flow_prompts_built"] == count
        assert stats["flow_prompt_build_calls"] == 1 and stats["flow_prompt_build_largest"] == count
        # admission knows what such a pass costs now, whether the worker ran it ahead of the first chunks (a
        # phase of its own) or the first chunks' phase did (inline)
        assert core.scheduler.prompt_costs.passes_s(count) > 0.0
        assert sorted(t2w.pool.free) == list(range(count + 1))
        assert len({bytes(np.asarray(r.pcm[:4800]).tobytes()) for r in results}) == count  # three voices
    finally:
        eng.close()

