"""CAM++ x-vector (spec/frontend.md §5)."""

from __future__ import annotations

import pytest
import torch

from cosystream.frontend.audio import prepare_prompt_audio


@pytest.mark.parity
@pytest.mark.parametrize(("rate", "key"), [(24000, "spk_embedding_from_24k"), (16000, "spk_embedding_from_16k")])
def test_speaker_embedding_matches_official(frontend, load_fixture, prompt_wav_at, rate, key):
    expected = load_fixture("frontend")[key][0]
    xvector = frontend.speaker_encoder.embed(prepare_prompt_audio(prompt_wav_at(rate)).wav_16k)
    assert xvector.dtype == torch.float32 and xvector.shape == expected.shape
    # fbank differs from the reference by up to 2e-3 in low-energy bins; the embedding by far less.
    torch.testing.assert_close(xvector, expected, atol=1e-4, rtol=1e-4)


def test_embedding_is_deterministic_and_depends_on_the_voice(frontend, speech_like):
    first = torch.from_numpy(speech_like(2.0, 16000, seed=1))
    other = torch.from_numpy(speech_like(2.0, 16000, seed=2)) * 0.3
    assert torch.equal(frontend.speaker_encoder.embed(first), frontend.speaker_encoder.embed(first))
    assert not torch.allclose(frontend.speaker_encoder.embed(first), frontend.speaker_encoder.embed(other))
