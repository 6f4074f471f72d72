"""benchmarks/workload.py: the prompt really is 6.00 s, the texts have the stated lengths, output is deterministic."""

from __future__ import annotations

import json
import re
import wave
from pathlib import Path

import numpy as np
import pytest
from benchmark_scripts import import_benchmark


@pytest.fixture(scope="module")
def workload():
    return import_benchmark("workload")


@pytest.mark.parametrize("sample_rate", [24000, 16000])
def test_prompt_wav_is_six_seconds(workload, tmp_path: Path, sample_rate: int) -> None:
    path = workload.write_workload_wav(tmp_path / "voice.wav", sample_rate)
    with wave.open(str(path)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, sample_rate)
        num_samples = wav.getnframes()
        pcm = np.frombuffer(wav.readframes(num_samples), dtype="<i2")
    assert num_samples == 6 * sample_rate and num_samples / sample_rate == workload.PROMPT_SECONDS == 6.0
    # 100 whisper frames/s -> 600; 25 tokens/s -> 150; 50 mel frames/s -> 300
    assert num_samples * 16000 // sample_rate // 160 == 600  # whisper hop: 160 samples at 16 kHz
    assert workload.PROMPT_NUM_TOKENS == 6 * 25 and workload.PROMPT_NUM_MEL_FRAMES == 6 * 50
    peak = np.abs(pcm).max() / 32767
    assert 0.3 < peak < 0.51 and np.abs(pcm[:sample_rate // 2]).mean() > 0  # voiced, not silent, not clipped


def test_prompt_wav_is_deterministic(workload, tmp_path: Path) -> None:
    first = workload.write_workload_wav(tmp_path / "a.wav").read_bytes()
    assert workload.write_workload_wav(tmp_path / "b.wav").read_bytes() == first


def test_texts_have_the_stated_token_counts(workload) -> None:
    # byte-level BPE without merges (the random models): one token per ASCII character
    for text, num_tokens in ((workload.PROMPT_TEXT, 20), (workload.TARGET_TEXT, 40)):
        assert len(text) == len(text.encode()) == num_tokens
        assert re.fullmatch(r"[a-z ]+\.", text), text  # no digits, nothing the normaliser rewrites
    assert workload.FORCE_TOKENS * workload.SAMPLES_PER_TOKEN == 10 * 24000
    assert workload.SCHEDULE.first_hop == 25 and workload.PROMPT_NUM_TOKENS % 25 == 0  # no prompt padding


def test_workload_json(workload, tmp_path: Path) -> None:
    data = json.loads(workload.write_workload(tmp_path / "wl").read_text())
    assert data["texts"] == [workload.TARGET_TEXT] and data["force_tokens"] == 250
    assert data["voice"] == workload.VOICE_NAME and Path(data["prompt_wav"]).is_file()


def test_a_longer_prompt_variant(workload, tmp_path: Path, capsys) -> None:
    """--prompt-seconds writes a prompt of that length (e.g. longer than a flow-pool slot); 0 is refused."""
    assert workload.main([str(tmp_path / "wl"), "--prompt-seconds", "20"]) == 0
    with wave.open(str(tmp_path / "wl" / "voice.wav")) as wav:
        assert wav.getnframes() == 20 * wav.getframerate()
    with pytest.raises(SystemExit) as exit_info:
        workload.main([str(tmp_path / "bad"), "--prompt-seconds", "0"])
    assert exit_info.value.code == 2 and "--prompt-seconds: must be > 0" in capsys.readouterr().err


@pytest.mark.slow  # ~6 s: writes a random model and runs the real frontend
def test_counts_with_the_random_model_frontend(workload, tmp_path: Path) -> None:
    """The stated counts, measured: text tokens with the model's tokenizer, prompt tokens and mel frames."""
    from cosystream.checkpoint import load_checkpoint
    from cosystream.frontend import Frontend
    from cosystream.testing.random_model import random_checkpoint

    frontend = Frontend(load_checkpoint(random_checkpoint(tmp_path / "model", "tiny")))
    for text, num_tokens in ((workload.PROMPT_TEXT, 20), (workload.TARGET_TEXT, 40)):
        assert frontend.segments(text) == [text]  # the normaliser leaves it as it is
        assert len(frontend.encode_text(text)) == num_tokens
    prompt = frontend.make_voice_prompt(workload.write_workload_wav(tmp_path / "voice.wav"), workload.PROMPT_TEXT)
    assert prompt.prompt_speech_tokens.shape[0] == workload.PROMPT_NUM_TOKENS
    assert prompt.prompt_mel.shape[0] == workload.PROMPT_NUM_MEL_FRAMES
    assert prompt.prompt_text_ids.shape[0] == 20
