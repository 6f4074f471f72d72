"""Prompt speech tokens through speech_tokenizer_v2.onnx (spec/frontend.md §4)."""

from __future__ import annotations

import pytest
import torch

from cosystream.frontend.audio import prepare_prompt_audio


@pytest.mark.parity
@pytest.mark.parametrize(("rate", "key"), [(24000, "speech_token_raw_from_24k"), (16000, "speech_token_raw_from_16k")])
def test_speech_tokens_match_official(frontend, load_fixture, prompt_wav_at, rate, key):
    expected = load_fixture("frontend")[key][0]
    tokens = frontend.speech_tokenizer.tokenize(prepare_prompt_audio(prompt_wav_at(rate)).wav_16k)
    assert tokens.dtype == torch.int32
    assert torch.equal(tokens, expected)


def test_token_rate_is_25_hz(frontend, speech_like):
    wav = torch.from_numpy(speech_like(2.0, 16000))
    tokens = frontend.speech_tokenizer.tokenize(wav)
    assert abs(tokens.numel() - 50) <= 1
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 6561
