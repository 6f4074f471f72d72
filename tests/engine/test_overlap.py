"""The experimental overlapped token-to-wave worker gives the same audio as the inline path."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest

from cosystream.config import EngineConfig
from cosystream.engine.sync_engine import Engine
from cosystream.params import SamplingParams, SynthesisParams

TEXTS = ["hello there.", "good morning to you.", "a short line.", "the quick brown fox."]


@pytest.fixture(scope="module")
def overlapped(model_dir, fixture_dir, tmp_path_factory):
    eng = Engine.from_pretrained(model_dir, voices_db=str(tmp_path_factory.mktemp("voices") / "v.db"),
                                 max_streams=8, overlap_token2wav=True)
    eng.run(eng.async_engine.add_voice("fixture", str(fixture_dir / "prompt_24k.wav"),
                                       "Hello there. This is a short synthetic prompt."))
    yield eng
    eng.close()


def test_overlapped_concurrent_requests_equal_inline_ones(overlapped, engine, fixture_dir):
    engine.run(engine.async_engine.add_voice("fixture_inline", str(fixture_dir / "prompt_24k.wav"),
                                             "Hello there. This is a short synthetic prompt."))
    params = [SynthesisParams(text=t, sampling=SamplingParams(greedy=True, seed=i)) for i, t in enumerate(TEXTS)]
    inline = [engine.synthesize(replace(p, voice="fixture_inline")) for p in params]
    results: list = [None] * len(params)

    def worker(i: int) -> None:
        results[i] = overlapped.synthesize(replace(params[i], voice="fixture"))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(params))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for a, b in zip(inline, results, strict=True):
        assert b is not None and a.num_chunks == b.num_chunks and a.times.num_tokens == b.times.num_tokens
        np.testing.assert_allclose(b.pcm, a.pcm, atol=5e-4, rtol=0)
    assert overlapped.async_engine.core._in_flight is None


def test_overlap_is_refused_on_cuda():
    with pytest.raises(ValueError, match="overlap_token2wav"):
        EngineConfig(device="cuda", overlap_token2wav=True)
