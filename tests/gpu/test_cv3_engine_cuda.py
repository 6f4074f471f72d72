"""On a GPU: the engine on the CosyVoice3 fixture model with its CUDA-only parts (bfloat16, the LM's CUDA
graphs, the token-to-wave worker beside LM decode on two CUDA streams, the prompt analysis in torch). Needs
CUDA; CI (CPU only) does not run it. Lengths are forced: N speech tokens → 960·N samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosystream.engine.sync_engine import Engine
from cosystream.params import SamplingParams, SynthesisParams
from cosystream.testing.concurrency import synthesize_concurrently

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SAMPLES_PER_TOKEN = 960


@pytest.fixture(scope="module")
def engine(cv3_model_dir, cv3_dir, tmp_path_factory):
    eng = Engine.from_pretrained(cv3_model_dir, device="cuda", dtype="bfloat16", max_streams=8,
                                 voices_db=str(tmp_path_factory.mktemp("cv3_cuda") / "voices.db"))
    try:
        assert eng.async_engine.config.overlap  # the token-to-wave worker runs beside the LM
        eng.async_engine.warmup(prompt_tokens=80, target_tokens=100)
        eng.run(eng.async_engine.add_voice("v", str(cv3_dir / "prompt_24k.wav"),
                                           "Hello there, this is a short synthetic prompt."))
        yield eng
    finally:
        eng.close()


@pytest.mark.parametrize("extra", [dict(mode="zero_shot"), dict(mode="cross_lingual"),
                                   dict(mode="instruct2", instruct_text="Speak slowly."),
                                   dict(mode="zero_shot", stream=False)])
def test_every_mode_on_cuda(engine, extra):
    result = engine.synthesize(SynthesisParams(text="Hello there, how are you today?", voice="v", force_tokens=80,
                                               **extra))
    assert result.pcm.shape == (80 * SAMPLES_PER_TOKEN,) and np.isfinite(result.pcm).all()
    assert result.num_chunks >= (2 if extra.get("stream", True) else 1)


def test_text_streaming_and_voice_conversion_on_cuda(engine, cv3_dir):
    async def pieces():
        for piece in ("Hello there, ", "how are ", "you today?"):
            yield piece

    streamed = engine.synthesize(SynthesisParams(text=pieces(), voice="v", force_tokens=60))
    assert streamed.pcm.shape == (60 * SAMPLES_PER_TOKEN,) and np.isfinite(streamed.pcm).all()
    converted = engine.synthesize(SynthesisParams(text="", voice="v", mode="vc",
                                                  source_audio=str(cv3_dir / "prompt_24k.wav")))
    assert converted.pcm.shape[0] > 0 and np.isfinite(converted.pcm).all()


def test_concurrent_streams_on_cuda_keep_their_lengths(engine):
    params = [SynthesisParams(text=f"Sentence number {i} is here.", voice="v", force_tokens=40 + 10 * i,
                              sampling=SamplingParams(seed=i)) for i in range(6)]
    results = synthesize_concurrently(engine, params)
    for p, r in zip(params, results, strict=True):
        assert r is not None and r.pcm.shape == (p.force_tokens * SAMPLES_PER_TOKEN,)
    assert engine.async_engine.core.num_active == 0
