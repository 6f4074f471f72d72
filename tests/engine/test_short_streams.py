"""Streams whose LM stops after very few tokens, and first chunks shorter than the vocoder's cross-fade overlap
(first_hop under 4 tokens): every token is voiced, once (tiny fixture model)."""

from __future__ import annotations

import numpy as np
import pytest

from cosystream.params import SamplingParams, SynthesisParams


@pytest.fixture(scope="module")
def voice(engine, fixture_dir):
    engine.run(engine.async_engine.add_voice("short", str(fixture_dir / "prompt_24k.wav"),
                                             "Hello there. This is a short synthetic prompt."))
    return "short"


@pytest.mark.parametrize("tokens", [1, 2, 3])
@pytest.mark.parametrize("stream", [True, False])
def test_a_stream_of_a_few_tokens_voices_them(engine, voice, tokens, stream):
    params = SynthesisParams(text="hi.", voice=voice, force_tokens=tokens, stream=stream,
                             sampling=SamplingParams(greedy=True, seed=3))
    result = engine.synthesize(params)
    assert result.times.num_tokens == tokens
    assert result.pcm.shape[0] == tokens * _samples_per_token(engine)
    assert np.isfinite(result.pcm).all()


@pytest.mark.parametrize("tokens", [1, 2])
def test_streamed_text_of_a_few_tokens_voices_them(engine, voice, tokens):
    async def scenario() -> tuple[int, int]:
        async def pieces():
            yield "hi."

        params = SynthesisParams(text=pieces(), voice=voice, force_tokens=tokens,
                                 sampling=SamplingParams(greedy=True, seed=3))
        chunks = [c async for c in engine.async_engine.synthesize(params)]
        return sum(c.pcm.shape[0] for c in chunks), chunks[-1].times.num_tokens

    samples, num_tokens = engine.run(scenario())
    assert num_tokens == tokens
    assert samples == tokens * _samples_per_token(engine)


def _samples_per_token(engine) -> int:
    return engine.async_engine.hparams.token_mel_ratio * engine.async_engine.token2wav.hift.upsample_scale


@pytest.mark.parametrize(("first_hop", "tokens"), [(1, 2), (1, 6), (2, 5), (3, 8), (4, 9)])
def test_first_chunks_shorter_than_the_overlap_voice_every_token(engine, voice, first_hop, tokens):
    chunks = list(engine.stream(SynthesisParams(text="hi there.", voice=voice, force_tokens=tokens, first_hop=first_hop,
                                                sampling=SamplingParams(greedy=True, seed=3))))
    pcm = np.concatenate([c.pcm for c in chunks])
    assert pcm.shape[0] == tokens * _samples_per_token(engine)
    assert np.isfinite(pcm).all()
    assert all(c.pcm.shape[0] > 0 for c in chunks[:-1])  # audio withheld is not sent as an empty chunk
    assert [c.index for c in chunks] == list(range(len(chunks)))
