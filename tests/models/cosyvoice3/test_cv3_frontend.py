"""The CosyVoice3 frontend deltas against frontend.safetensors / text_frontend.json of the CosyVoice3 set."""

from __future__ import annotations

import json

import pytest
import torch

from cosystream.frontend import CV3_SYSTEM_PROMPT, Frontend
from cosystream.frontend.audio import kaldi_fbank, prepare_prompt_audio, prompt_mel, whisper_log_mel
from cosystream.frontend.tokenizer import END_OF_PROMPT
from cosystream.models.cosyvoice3.lm import ENDOFPROMPT_ID

pytestmark = pytest.mark.parity

# README §C3: as CV2 for whisper / fbank; matcha mel with fmax=null 5e-3 (near-Nyquist bins).
WHISPER_ATOL = 1e-4
FBANK_ATOL = 2e-3
MEL_FMAX_NULL_ATOL = 5e-3


@pytest.fixture(scope="module")
def frontend(cv3_checkpoint) -> Frontend:
    return Frontend(cv3_checkpoint)


@pytest.fixture(scope="module")
def text_fx(cv3_dir) -> dict:
    return json.loads((cv3_dir / "text_frontend.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def prompt_wav(cv3_dir, cv3_manifest):
    names = [n for n, info in cv3_manifest["wav"].items() if isinstance(info, dict) and info.get("sr") == 24000]
    return cv3_dir / names[0]


def test_special_tokens_have_the_official_ids(frontend, text_fx):
    for token, token_id in text_fx["special_token_ids"].items():
        assert frontend.tokenizer.token_id(token) == token_id, token
    assert len(frontend.tokenizer) == text_fx["tokenizer_len_after_specials"]
    assert frontend.tokenizer.token_id(END_OF_PROMPT) == ENDOFPROMPT_ID


def test_tokenizer_cases(frontend, text_fx):
    assert text_fx["tokenizer"]
    for case in text_fx["tokenizer"]:
        ids = frontend.encode_text(case["text"])
        assert ids == case["ids"], case["text"]
        assert frontend.tokenizer.decode(ids) == case["decoded_skip_special"]


def test_text_normalize_cases(frontend, text_fx):
    for case in text_fx["text_normalize"]:
        assert frontend.normalize(case["input"]) == case["split_true"], case["name"]
        assert frontend.normalize(case["input"], split=False) == [case["split_false"]], case["name"]
        ids = [frontend.encode_text(segment) for segment in frontend.normalize(case["input"])]
        assert ids == case["segment_token_ids"], case["name"]


def test_prompt_audio_features(frontend, cv3_load, prompt_wav, cv3_checkpoint):
    fx = cv3_load("frontend")
    audio = prepare_prompt_audio(prompt_wav, cv3_checkpoint.hparams.mel.sampling_rate)
    torch.testing.assert_close(audio.wav_16k, fx["speech_16k_from_24k"][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(whisper_log_mel(fx["speech_16k_from_24k"][0]), fx["whisper_logmel128"][0],
                               atol=WHISPER_ATOL, rtol=0)
    torch.testing.assert_close(kaldi_fbank(fx["speech_16k_from_24k"][0]), fx["fbank80_raw"], atol=FBANK_ATOL, rtol=0)
    mel = prompt_mel(audio.wav_24k, cv3_checkpoint.hparams.mel)
    assert cv3_checkpoint.hparams.mel.fmax is None
    torch.testing.assert_close(mel, fx["speech_feat_24k_fmax_null"][0], atol=MEL_FMAX_NULL_ATOL, rtol=0)
    tokens = frontend.speech_tokenizer.tokenize(audio.wav_16k)
    assert torch.equal(tokens, fx["speech_token_raw"][0])
    xvector = frontend.speaker_encoder.embed(audio.wav_16k)
    torch.testing.assert_close(xvector, fx["spk_embedding"][0], atol=1e-4, rtol=1e-4)


def test_zero_shot_voice_gets_the_system_prompt_rule(frontend, cv3_load, cv3_manifest, prompt_wav):
    """A bare transcript becomes the official example's prompt text; features align 2:1 like the official."""
    fx, e2e = cv3_load("frontend"), cv3_load("e2e")
    passed = cv3_manifest["frontend"]["prompt_text_passed"]
    transcript = passed.split(END_OF_PROMPT, 1)[1]
    voice = frontend.make_voice_prompt(prompt_wav, transcript)
    assert voice.prompt_text_ids.tolist() == e2e["zero_shot_in_prompt_text"][0].tolist()
    assert voice.prompt_text_ids.tolist() == frontend.encode_text(passed)
    assert torch.equal(voice.prompt_speech_tokens.view(1, -1), fx["zs_flow_prompt_speech_token"])
    torch.testing.assert_close(voice.prompt_mel.unsqueeze(0), fx["zs_prompt_speech_feat"],
                               atol=MEL_FMAX_NULL_ATOL, rtol=0)
    explicit = frontend.make_voice_prompt(prompt_wav, passed)
    assert explicit.prompt_text_ids.tolist() == voice.prompt_text_ids.tolist()


def test_cross_lingual_and_instruct2_get_endofprompt(frontend, prompt_wav):
    voice = frontend.make_voice_prompt(prompt_wav, "")
    segment = frontend.segments("Good morning, how are you today?")[0]
    inputs = frontend.inputs_cross_lingual(segment, voice)
    prefix = frontend.encode_text(CV3_SYSTEM_PROMPT + END_OF_PROMPT)
    assert inputs.text_ids.tolist()[:len(prefix)] == prefix
    inputs = frontend.inputs_instruct2(segment, "Please speak slowly.", voice)
    assert inputs.prompt_text_ids.tolist() == frontend.encode_text(
        f"{CV3_SYSTEM_PROMPT} Please speak slowly.{END_OF_PROMPT}")


def test_sft_speaker_of_spk2info_gets_endofprompt(cv3_checkpoint, cv3_model_dir, tmp_path):
    """A `spk2info.pt` beside a CosyVoice3 model gives sft voices; their text carries the system prefix the LM
    requires (the official inference_sft would fail its `<|endofprompt|>` assertion)."""
    from cosystream.checkpoint import load_checkpoint

    model = tmp_path / "model"
    for path in cv3_model_dir.rglob("*"):
        if path.is_file():
            (model / path.relative_to(cv3_model_dir)).parent.mkdir(parents=True, exist_ok=True)
            (model / path.relative_to(cv3_model_dir)).symlink_to(path)
    xvector = torch.randn(1, 192)
    torch.save({"speaker-a": {"embedding": xvector}}, model / "spk2info.pt")
    frontend = Frontend(load_checkpoint(model))
    inputs = frontend.inputs_sft("Good morning.", "speaker-a")
    assert inputs.text_ids.tolist() == frontend.encode_text(CV3_SYSTEM_PROMPT + END_OF_PROMPT + "Good morning.")
    assert torch.equal(inputs.xvector, xvector[0])
