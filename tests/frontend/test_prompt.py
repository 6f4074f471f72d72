"""Per-mode model inputs, voice prompts and spk2info (spec/frontend.md §7-§9, checkpoints.md §6)."""

from __future__ import annotations

import shutil

import pytest
import torch

from cosystream.checkpoint import load_checkpoint
from cosystream.errors import BadInput, CheckpointError, UnknownVoice
from cosystream.frontend import Frontend, ModelInputs, VoicePrompt
from cosystream.frontend.prompt import load_spk2info
from cosystream.frontend.text import MERGE_LEN, TOKEN_MAX_N
from cosystream.frontend.tokenizer import END_OF_PROMPT

MEL_ATOL = 2e-4  # matcha mel, fixtures README §3
XVECTOR_ATOL = 1e-4


@pytest.fixture(scope="module")
def voice(frontend, prompt_wav, manifest) -> VoicePrompt:
    return frontend.make_voice_prompt(prompt_wav, manifest["frontend"]["prompt_text_input"])


@pytest.mark.parity
def test_zero_shot_inputs_match_official(frontend, voice, manifest, load_fixture):
    fx = load_fixture("frontend")
    segments = frontend.segments(manifest["frontend"]["tts_text_input"])
    assert segments == manifest["frontend"]["tts_text_segments"]
    model_input = frontend.inputs_zero_shot(segments[0], voice).as_official_dict()
    for key in sorted(k for k in fx if k.startswith("zs_")):
        ours, expected = model_input[key.removeprefix("zs_")], fx[key]
        assert ours.shape == expected.shape and ours.dtype == expected.dtype, key
        if key == "zs_prompt_speech_feat":
            torch.testing.assert_close(ours, expected, atol=MEL_ATOL, rtol=0)
        elif ours.is_floating_point():
            torch.testing.assert_close(ours, expected, atol=XVECTOR_ATOL, rtol=XVECTOR_ATOL)
        else:
            assert torch.equal(ours, expected), key


@pytest.mark.parity
def test_voice_prompt_is_aligned_like_official(voice, manifest):
    aligned = manifest["frontend"]["aligned_token_len"]
    assert voice.prompt_speech_tokens.shape == (aligned,)
    assert voice.prompt_mel.shape == (2 * aligned, 80)


def test_cross_lingual_has_no_lm_prompt(frontend, voice):
    inputs = frontend.inputs_cross_lingual("Hello world.", voice)
    assert inputs.mode == "cross_lingual"
    assert inputs.prompt_text_ids.numel() == 0 and inputs.llm_prompt_speech_tokens.numel() == 0
    assert torch.equal(inputs.flow_prompt_speech_tokens, voice.prompt_speech_tokens)
    assert torch.equal(inputs.prompt_mel, voice.prompt_mel)


def test_instruct2_uses_the_instruction_verbatim_with_end_of_prompt(frontend, voice):
    inputs = frontend.inputs_instruct2("Hello world.", "Speak 2 times faster", voice)
    assert inputs.prompt_text_ids.tolist() == frontend.encode_text("Speak 2 times faster" + END_OF_PROMPT)
    assert inputs.llm_prompt_speech_tokens.numel() == 0
    already = frontend.inputs_instruct2("Hello world.", "用四川话说这句话" + END_OF_PROMPT, voice)
    assert already.prompt_text_ids.tolist() == frontend.encode_text("用四川话说这句话" + END_OF_PROMPT)
    with pytest.raises(BadInput, match="^instruct: "):
        frontend.inputs_instruct2("Hello world.", "   ", voice)


def test_vc_tokenises_the_source(frontend, voice, write_audio, speech_like):
    source = write_audio("source.wav", speech_like(2.0, 22050, channels=2), 22050)
    inputs = frontend.inputs_vc(source, voice)
    assert inputs.mode == "vc" and inputs.text_ids.numel() == 0
    assert abs(inputs.source_speech_tokens.numel() - 50) <= 1
    assert torch.equal(inputs.flow_prompt_speech_tokens, voice.prompt_speech_tokens)
    silent = write_audio("silent.wav", speech_like(2.0, 16000) * 0, 16000)
    with pytest.raises(BadInput, match="^source_wav: "):
        frontend.inputs_vc(silent, voice)


def test_zero_shot_needs_a_transcript(frontend, prompt_wav):
    wordless = frontend.make_voice_prompt(prompt_wav, "")
    assert wordless.prompt_text_ids.numel() == 0
    with pytest.raises(BadInput, match="^prompt_text: "):
        frontend.inputs_zero_shot("Hello.", wordless)
    assert frontend.inputs_cross_lingual("Hello.", wordless).text_ids.numel() > 0


def test_prompt_text_is_normalised_like_official(frontend, prompt_wav):
    voice = frontend.make_voice_prompt(prompt_wav, "I have 3 apples.")
    normalized = frontend.normalize("I have 3 apples.", split=False)[0]
    assert "three" in normalized
    assert voice.prompt_text_ids.tolist() == frontend.encode_text(normalized)


def test_8k_stereo_prompt_makes_a_voice(frontend, write_audio, speech_like):
    voice = frontend.make_voice_prompt(write_audio("phone.wav", speech_like(3.0, 8000, channels=2), 8000), "hello")
    assert abs(voice.prompt_speech_tokens.numel() - 75) <= 1
    assert voice.prompt_mel.shape == (2 * voice.prompt_speech_tokens.numel(), 80)
    assert torch.isfinite(voice.xvector).all() and voice.xvector.shape == (192,)


# text a user may send

def test_long_text_is_split_within_limits(frontend):
    sentence = "The 3 quick brown foxes jumped over 12 lazy dogs again. "
    text = (sentence * (5000 // len(sentence) + 1))[:5000]
    segments = frontend.segments(text)
    assert len(segments) > 10
    assert all(len(frontend.encode_text(segment)) <= TOKEN_MAX_N + MERGE_LEN for segment in segments)
    assert not any(char.isdigit() for segment in segments for char in segment)


@pytest.mark.parametrize("text", ["", "   ", "...!?", "。，！？", "😀🎉👍"])
def test_nothing_to_say_is_bad_input(frontend, text):
    with pytest.raises(BadInput, match="^text: nothing to synthesise"):
        frontend.segments(text)


def test_emoji_and_mixed_scripts_are_kept(frontend, voice):
    segments = frontend.segments("I love it 😀! Привет, 你好 123, γειά σου.")
    joined = "".join(segments)
    assert "😀" in joined and "Привет" in joined and "你好" in joined and "γειά" in joined
    assert not any(char.isdigit() for char in joined)
    for segment in segments:
        assert frontend.inputs_zero_shot(segment, voice).text_ids.numel() > 0


def test_non_string_text_is_bad_input(frontend):
    with pytest.raises(BadInput, match="^text: expected a string"):
        frontend.segments(None)  # type: ignore[arg-type]


# dataclasses

def test_voice_prompt_rejects_misaligned_tensors(voice):
    with pytest.raises(ValueError, match="prompt_mel"):
        VoicePrompt(voice.prompt_text_ids, voice.prompt_speech_tokens, voice.prompt_mel[:-1], voice.xvector)
    with pytest.raises(ValueError, match="prompt_speech_tokens"):
        VoicePrompt(voice.prompt_text_ids, voice.prompt_speech_tokens.long(), voice.prompt_mel, voice.xvector)
    rebuilt = VoicePrompt.from_tensors(voice.tensors())
    assert all(torch.equal(a, b) for a, b in zip(rebuilt.tensors().values(), voice.tensors().values(), strict=True))


def test_model_inputs_official_dict_has_empty_defaults(voice):
    inputs = ModelInputs(mode="sft", text_ids=torch.tensor([1, 2], dtype=torch.int32), xvector=voice.xvector)
    model_input = inputs.as_official_dict()
    assert model_input["prompt_speech_feat"].shape == (1, 0, 80)
    assert model_input["llm_prompt_speech_token"].shape == (1, 0)
    assert model_input["text_len"].tolist() == [2] and model_input["flow_embedding"].shape == (1, 192)
    with pytest.raises(ValueError, match="mode"):
        ModelInputs(mode="karaoke", text_ids=inputs.text_ids, xvector=voice.xvector)


# spk2info.pt

def _zero_shot_entry(voice: VoicePrompt) -> dict[str, torch.Tensor]:
    # Written by the official add_zero_shot_spk: the zero-shot model_input minus text (checkpoints.md §6).
    inputs = ModelInputs(mode="zero_shot", text_ids=torch.zeros(0, dtype=torch.int32), xvector=voice.xvector,
                         prompt_text_ids=voice.prompt_text_ids, llm_prompt_speech_tokens=voice.prompt_speech_tokens,
                         flow_prompt_speech_tokens=voice.prompt_speech_tokens, prompt_mel=voice.prompt_mel)
    entry = inputs.as_official_dict()
    for key in ("text", "text_len", "source_speech_token", "source_speech_token_len"):
        del entry[key]
    return entry


@pytest.fixture(scope="module")
def model_dir_with_speakers(model_dir, tmp_path_factory, voice):
    copy = tmp_path_factory.mktemp("with_spk2info") / "model"
    shutil.copytree(model_dir, copy)
    table = {"sft_speaker": {"embedding": torch.randn(1, 192)}, "zs_speaker": _zero_shot_entry(voice)}
    torch.save(table, copy / "spk2info.pt")
    return copy


def test_spk2info_both_layouts(model_dir_with_speakers, voice):
    frontend = Frontend(load_checkpoint(model_dir_with_speakers))
    assert sorted(frontend.speakers) == ["sft_speaker", "zs_speaker"]
    sft = frontend.inputs_sft("Hello world.", "sft_speaker")
    assert sft.mode == "sft" and sft.prompt_mel.shape == (0, 80) and sft.xvector.shape == (192,)
    builtin = frontend.builtin_voice("zs_speaker").tensors()
    assert all(torch.equal(builtin[name], tensor) for name, tensor in voice.tensors().items())
    assert torch.equal(frontend.inputs_sft("Hi.", "zs_speaker").xvector, voice.xvector)
    with pytest.raises(BadInput, match="only an embedding"):
        frontend.builtin_voice("sft_speaker")
    with pytest.raises(UnknownVoice, match="nobody"):
        frontend.inputs_sft("Hi.", "nobody")


def test_spk2info_without_file_means_no_speakers(frontend):
    assert frontend.speakers == {}
    with pytest.raises(UnknownVoice):
        frontend.inputs_sft("Hi.", "anyone")


def test_spk2info_with_code_is_refused(tmp_path):
    path = tmp_path / "spk2info.pt"
    torch.save({"x": {"embedding": torch.zeros(1, 192)}, "payload": _Pickled()}, path)
    with pytest.raises(CheckpointError, match="spk2info.pt"):
        load_spk2info(path)


class _Pickled:
    """Any non-tensor object: weights_only loading must refuse it."""
