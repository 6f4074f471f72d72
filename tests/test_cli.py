"""The `cosystream` command: make-random-model, say, and one-line errors naming the flag or file."""

from __future__ import annotations

import soundfile as sf

from cosystream.cli import main


def test_make_random_model_then_say(tmp_path, fixture_dir, capsys):
    model = tmp_path / "tiny"
    assert main(["make-random-model", str(model), "--size", "tiny", "--seed", "1"]) == 0
    assert (model / "llm.pt").is_file() and (model / "CosyVoice-BlankEN" / "vocab.json").is_file()
    out = tmp_path / "hello.wav"
    code = main(["say", "hello there.", "--model-dir", str(model), "--device", "cpu",
                 "--prompt-wav", str(fixture_dir / "prompt_24k.wav"), "--prompt-text", "hello there",
                 "--db", str(tmp_path / "v.db"), "-o", str(out), "--stream", "--force-tokens", "30"])
    assert code == 0
    audio, rate = sf.read(out)
    assert rate == 24000 and audio.shape == (960 * 30,)
    printed = capsys.readouterr().out
    assert "first_audio_s" in printed and "rtf" in printed and "chunk 0" in printed


def test_errors_name_the_flag_or_file(tmp_path, capsys):
    assert main(["make-random-model", str(tmp_path / "m"), "--size", "tiny"]) == 0
    assert main(["make-random-model", str(tmp_path / "m"), "--size", "tiny"]) == 2
    assert "OUT" in capsys.readouterr().err
    code = main(["say", "hi", "--model-dir", str(tmp_path / "m"), "--device", "cpu", "--prompt-wav",
                 str(tmp_path / "missing.wav"), "-o", str(tmp_path / "o.wav")])
    assert code == 2 and "--prompt-wav" in capsys.readouterr().err
    assert main(["say", "hi", "--model-dir", str(tmp_path / "nope"), "--device", "cpu", "--voice", "v",
                 "-o", str(tmp_path / "o.wav")]) == 2
    assert "not a directory" in capsys.readouterr().err
