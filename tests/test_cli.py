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
                 "--db", str(tmp_path / "v.db"), "-o", str(out), "--stream", "--force-tokens", "60"])
    assert code == 0
    audio, rate = sf.read(out)
    assert rate == 24000 and audio.shape == (960 * 60,)
    captured = capsys.readouterr()
    printed = captured.out
    assert "first_audio_s" in printed and "rtf" in printed and "chunk 0" in printed
    arrivals = [float(line.split("arrived ")[1].split(" ms")[0]) for line in printed.splitlines()
                if line.startswith("chunk ")]
    assert len(arrivals) >= 2 and arrivals == sorted(arrivals)  # each chunk: when it arrived, in order
    for part in ("checkpoint", "frontend", "llm.pt", "flow.pt", "hift.pt"):  # what loads, and how long it took
        assert any("event=loaded" in line and part in line and "load_s=" in line
                   for line in captured.err.splitlines()), part


def test_errors_name_the_flag_or_file(tmp_path, capsys):
    assert main(["make-random-model", str(tmp_path / "m"), "--size", "tiny"]) == 0
    assert main(["make-random-model", str(tmp_path / "m"), "--size", "tiny"]) == 2
    assert "OUT" in capsys.readouterr().err
    code = main(["say", "hi", "--model-dir", str(tmp_path / "m"), "--device", "cpu", "--prompt-wav",
                 str(tmp_path / "missing.wav"), "-o", str(tmp_path / "o.wav")])
    assert code == 2 and "--prompt-wav" in capsys.readouterr().err
    assert main(["say", "hi", "--model-dir", str(tmp_path / "nope"), "--device", "cpu", "--voice", "v",
                 "--db", str(tmp_path / "v.db"), "-o", str(tmp_path / "o.wav")]) == 2
    err = capsys.readouterr().err
    assert "--model-dir" in err and "no directory" in err and "nope" in err


def test_say_checks_the_cheap_inputs_before_loading(tmp_path, model_dir, capsys, monkeypatch):
    from cosystream.engine.sync_engine import Engine

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(Engine, "from_pretrained", no_load)
    common = ["--model-dir", str(model_dir), "--device", "cpu", "--db", str(tmp_path / "v.db")]
    assert main(["say", "hi", *common, "--voice", "nobody", "-o", str(tmp_path / "o.wav")]) == 2
    err = capsys.readouterr().err
    assert "--voice" in err and "'nobody'" in err and str(tmp_path / "v.db") in err
    assert main(["say", "hi", *common, "--prompt-wav", str(tmp_path / "none.wav"), "-o", str(tmp_path / "o.wav")]) == 2
    assert "none.wav" in capsys.readouterr().err
    wav = tmp_path / "p.wav"
    wav.write_bytes(b"RIFF")
    assert main(["say", "hi", *common, "--prompt-wav", str(wav), "-o", str(tmp_path / "no_dir" / "o.wav")]) == 2
    assert "--output" in capsys.readouterr().err


def test_voices_add_checks_the_recording_before_loading(tmp_path, model_dir, capsys, monkeypatch):
    import cosystream.checkpoint

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the recording was checked")

    monkeypatch.setattr(cosystream.checkpoint, "load_checkpoint", no_load)
    code = main(["voices", "add", "alice", "--model-dir", str(model_dir), "--db", str(tmp_path / "v.db"),
                 "--prompt-wav", str(tmp_path / "missing.wav"), "--prompt-text", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "--prompt-wav" in err and "missing.wav" in err


def test_python_dash_m_cosystream_runs_the_command():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "cosystream", "serve", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    help_text = " ".join(done.stdout.split())  # argparse wraps lines
    assert "(default: 127.0.0.1)" in help_text and "(default: 8000)" in help_text
    assert "FunAudioLLM/CosyVoice2-0.5B" in help_text


def test_the_default_model_is_the_same_everywhere():
    from cosystream.checkpoint.hub import DEFAULT_MODEL_ID
    from cosystream.server.cli import DEFAULT_MODEL

    assert DEFAULT_MODEL == DEFAULT_MODEL_ID


def test_voices_add_list_and_say_on_a_cosyvoice3_model(tmp_path, cv3_model_dir, cv3_dir, capsys):
    db, out = tmp_path / "v.db", tmp_path / "hello.wav"
    assert main(["voices", "add", "carol", "--model-dir", str(cv3_model_dir), "--device", "cpu", "--db", str(db),
                 "--prompt-wav", str(cv3_dir / "prompt_24k.wav"), "--prompt-text", "Hello there."]) == 0
    assert main(["voices", "list", "--db", str(db)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split()[:2] == ["carol", "cosyvoice3"]
    assert main(["say", "Hello there, how are you?", "--model-dir", str(cv3_model_dir), "--device", "cpu",
                 "--voice", "carol", "--db", str(db), "-o", str(out), "--stream", "--force-tokens", "40"]) == 0
    audio, rate = sf.read(out)
    assert rate == 24000 and audio.shape == (960 * 40,)
