"""VoiceStore (SQLite + safetensors) and the `cosystream voices` CLI."""

from __future__ import annotations

import argparse
import ast
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from cosystream import cli_voices
from cosystream.engine import voices
from cosystream.engine.voices import VoiceStore, default_db_path
from cosystream.errors import BadInput, UnknownVoice, VoiceExists
from cosystream.frontend.prompt import VoicePrompt

REPO = Path(__file__).resolve().parents[2]


def make_prompt(num_tokens: int = 12, seed: int = 0) -> VoicePrompt:
    generator = torch.Generator().manual_seed(seed)
    return VoicePrompt(
        prompt_text_ids=torch.randint(0, 1500, (7,), generator=generator, dtype=torch.int32),
        prompt_speech_tokens=torch.randint(0, 6561, (num_tokens,), generator=generator, dtype=torch.int32),
        prompt_mel=torch.randn(2 * num_tokens, 80, generator=generator),
        xvector=torch.randn(192, generator=generator),
    )


def assert_same_prompt(a: VoicePrompt, b: VoicePrompt) -> None:
    for name, tensor in a.tensors().items():
        assert torch.equal(tensor, b.tensors()[name]), name


@pytest.fixture
def store(tmp_path: Path):
    with VoiceStore(tmp_path / "voices.db") as opened:
        yield opened


# basic operations

def test_a_voice_keeps_the_family_of_the_model_that_analysed_it(store):
    import dataclasses

    from safetensors.torch import save

    store.add("cv3", dataclasses.replace(make_prompt(), family="cosyvoice3"), "hello")
    assert store.get("cv3").prompt.family == "cosyvoice3"
    # a record written before voices had a family: its tensors lack the key, and it is CosyVoice2's
    legacy = {k: v for k, v in make_prompt(seed=1).tensors().items() if k != "family"}
    store.add("old", make_prompt(seed=1), "hello")
    with sqlite3.connect(str(store.path)) as conn:
        conn.execute("UPDATE voice_blobs SET data = ? WHERE name = 'old' AND kind = 'prompt'", (save(legacy),))
    old = store.get("old").prompt
    assert old.family == "cosyvoice2"
    assert all(torch.equal(old.tensors()[k], v) for k, v in legacy.items())
    # the listing names each voice's family without loading its tensors
    assert {info.name: info.family for info in store.list()} == {"cv3": "cosyvoice3", "old": "cosyvoice2"}
    assert store.get("cv3").info.family == "cosyvoice3"


def test_a_version_1_database_gains_the_family_of_each_voice(tmp_path):
    """A store written before voices listed their family: opening it adds the column, read from each prompt."""
    import dataclasses

    from safetensors.torch import save

    path = tmp_path / "v1.db"
    prompts = {"carol": dataclasses.replace(make_prompt(seed=2), family="cosyvoice3").tensors(),
               "dave": {k: v for k, v in make_prompt(seed=3).tensors().items() if k != "family"}}  # pre-CV3 record
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE voices (name TEXT PRIMARY KEY, prompt_text TEXT NOT NULL, "
                     "num_prompt_tokens INTEGER NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL)")
        conn.execute("CREATE TABLE voice_blobs (name TEXT NOT NULL REFERENCES voices(name) ON DELETE CASCADE, "
                     "kind TEXT NOT NULL, data BLOB NOT NULL, PRIMARY KEY (name, kind))")
        for name, tensors in prompts.items():
            conn.execute("INSERT INTO voices VALUES (?, 'hi', 12, 1.0, 2.0)", (name,))
            conn.execute("INSERT INTO voice_blobs VALUES (?, 'prompt', ?)", (name, save(tensors)))
            conn.execute("INSERT INTO voice_blobs VALUES (?, 'extras', ?)", (name, save({})))
        conn.execute("PRAGMA user_version=1")
    for _ in range(2):  # upgraded once; the second open finds it done
        with VoiceStore(path) as store:
            assert [(i.name, i.family, i.num_prompt_tokens, i.created_at) for i in store.list()] == [
                ("carol", "cosyvoice3", 12, 1.0), ("dave", "cosyvoice2", 12, 1.0)]
            assert store.get("carol").prompt.family == "cosyvoice3"
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == voices.SCHEMA_VERSION


def test_add_then_get_round_trips_every_tensor(store):
    prompt, extras = make_prompt(), {"flow_cache": torch.randn(3, 4).to(torch.bfloat16)}
    info = store.add("alice", prompt, "hello there", extras)
    record = store.get("alice")
    assert record.name == "alice" and record.prompt_text == "hello there"
    assert info.num_prompt_tokens == record.info.num_prompt_tokens == 12
    assert_same_prompt(record.prompt, prompt)
    assert torch.equal(record.extras["flow_cache"], extras["flow_cache"])
    assert record.extras["flow_cache"].dtype == torch.bfloat16


def test_list_is_sorted_and_has_no_tensors(store):
    for name in ("zed", "amy", "Bob"):
        store.add(name, make_prompt(), f"{name} speaking")
    listed = store.list()
    assert [info.name for info in listed] == sorted(["zed", "amy", "Bob"])
    assert all(info.created_at == info.updated_at for info in listed)


def test_delete_removes_the_voice_and_its_blobs(store):
    store.add("alice", make_prompt(), "hi")
    store.delete("alice")
    assert "alice" not in store and store.list() == []
    with pytest.raises(UnknownVoice):
        store.get("alice")
    with pytest.raises(UnknownVoice, match="'alice'"):
        store.delete("alice")
    assert sqlite3.connect(store.path).execute("SELECT COUNT(*) FROM voice_blobs").fetchone()[0] == 0


def test_duplicate_names_are_refused(store):
    store.add("alice", make_prompt(), "first")
    with pytest.raises(VoiceExists, match="'alice'"):
        store.add("alice", make_prompt(seed=1), "second")
    assert store.get("alice").prompt_text == "first"


@pytest.mark.parametrize("name", ["", "x" * 65, "bad/name", "naïve", "two words", "../up", None, 7])
def test_bad_names_are_bad_input(store, name):
    with pytest.raises(BadInput, match="^name: "):
        store.add(name, make_prompt(), "text")
    assert name not in store


@pytest.mark.parametrize("name", ["a", "A-b_c.1", "x" * 64])
def test_allowed_names(store, name):
    store.add(name, make_prompt(), "text")
    assert name in store


def test_bad_arguments_are_bad_input(store):
    with pytest.raises(BadInput, match="^prompt: "):
        store.add("alice", {"not": "a prompt"}, "text")  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="^extras: "):
        store.add("alice", make_prompt(), "text", {"x": [1, 2]})  # type: ignore[dict-item]
    assert "alice" not in store


def test_set_extras_replaces_the_extras(store):
    store.add("alice", make_prompt(), "hi", {"old": torch.ones(2)})
    created = store.get("alice").info
    store.set_extras("alice", {"new": torch.zeros(5)})
    record = store.get("alice")
    assert list(record.extras) == ["new"] and record.info.updated_at >= created.updated_at
    assert record.info.created_at == created.created_at
    with pytest.raises(UnknownVoice):
        store.set_extras("bob", {})


def test_voices_persist_across_reopen(tmp_path):
    path = tmp_path / "voices.db"
    prompt = make_prompt()
    with VoiceStore(path) as first:
        first.add("alice", prompt, "hi", {"cache": torch.arange(4)})
    with VoiceStore(path) as second:
        assert_same_prompt(second.get("alice").prompt, prompt)
        assert torch.equal(second.get("alice").extras["cache"], torch.arange(4))


def test_two_open_stores_see_each_others_writes(tmp_path):
    with VoiceStore(tmp_path / "v.db") as server, VoiceStore(tmp_path / "v.db") as cli:
        cli.add("alice", make_prompt(), "hi")
        assert "alice" in server
        server.delete("alice")
        assert cli.list() == []


def test_a_newer_schema_is_refused(tmp_path):
    path = tmp_path / "v.db"
    sqlite3.connect(path).execute(f"PRAGMA user_version={voices.SCHEMA_VERSION + 1}")
    with pytest.raises(BadInput, match="^db: .*schema version"):
        VoiceStore(path)


def test_default_location(monkeypatch, tmp_path):
    monkeypatch.setenv("COSYSTREAM_HOME", str(tmp_path / "home"))
    assert default_db_path() == tmp_path / "home" / "voices.db"
    monkeypatch.delenv("COSYSTREAM_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_db_path() == tmp_path / ".cache" / "cosystream" / "voices.db"
    with VoiceStore() as store:
        assert store.path == tmp_path / ".cache" / "cosystream" / "voices.db" and store.path.is_file()


# atomicity and concurrency

def _fail_on_call(monkeypatch, call_index: int) -> None:
    real, calls = voices.encode_tensors, []

    def failing(tensors):
        calls.append(1)
        if len(calls) == call_index:
            raise OSError("disk full (simulated)")
        return real(tensors)

    monkeypatch.setattr(voices, "encode_tensors", failing)


def test_a_failed_add_leaves_nothing_behind(tmp_path, monkeypatch):
    path = tmp_path / "v.db"
    with VoiceStore(path) as store:
        store.add("keeper", make_prompt(), "kept")
        _fail_on_call(monkeypatch, 2)  # the voice row and its prompt are written, the extras fail
        with pytest.raises(OSError, match="simulated"):
            store.add("alice", make_prompt(), "lost", {"x": torch.ones(1)})
        monkeypatch.undo()
        store.add("other", make_prompt(), "still writable")
    with VoiceStore(path) as reopened:
        assert [info.name for info in reopened.list()] == ["keeper", "other"]


def test_a_failed_set_extras_keeps_the_old_extras(tmp_path, monkeypatch):
    path = tmp_path / "v.db"
    with VoiceStore(path) as store:
        store.add("alice", make_prompt(), "hi", {"old": torch.ones(3)})
        before = store.get("alice").info
        _fail_on_call(monkeypatch, 1)  # after updated_at has been written
        with pytest.raises(OSError):
            store.set_extras("alice", {"new": torch.zeros(1)})
    with VoiceStore(path) as reopened:
        record = reopened.get("alice")
        assert list(record.extras) == ["old"] and record.info == before


def test_a_process_killed_mid_write_leaves_the_old_state(tmp_path):
    path = tmp_path / "v.db"
    with VoiceStore(path) as store:
        store.add("keeper", make_prompt(), "kept")
    script = textwrap.dedent(f"""
        import os, torch
        from cosystream.engine import voices
        from cosystream.frontend.prompt import VoicePrompt
        prompt = VoicePrompt(torch.zeros(2, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                             torch.zeros(8, 80), torch.zeros(192))
        real, calls = voices.encode_tensors, []
        def dying(tensors):
            calls.append(1)
            if len(calls) == 2:
                os._exit(17)  # no rollback, no close: as if the power went out
            return real(tensors)
        voices.encode_tensors = dying
        voices.VoiceStore({str(path)!r}).add("crashy", prompt, "never committed")
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 17, result.stderr
    with VoiceStore(path) as reopened:
        assert [info.name for info in reopened.list()] == ["keeper"]
        reopened.add("crashy", make_prompt(), "now it works")


def test_concurrent_threads(store):
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(5):
                name = f"w{worker}-{i}"
                store.add(name, make_prompt(seed=worker), name)
                assert store.get(name).prompt_text == name
                store.set_extras(name, {"i": torch.tensor([i])})
        except BaseException as exc:  # surfaced below; a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(store.list()) == 40


def test_voices_module_imports_no_cuda_and_no_model_code():
    tree = ast.parse((REPO / "cosystream" / "engine" / "voices.py").read_text())
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert not [name for name in imported if "cuda" in name or name.startswith("cosystream.models")]


# CLI

@pytest.fixture
def cli(tmp_path):
    parser = argparse.ArgumentParser(prog="cosystream")
    cli_voices.add_parser(parser.add_subparsers(dest="command", required=True))
    db = tmp_path / "cli.db"

    def run(*argv: str) -> int:
        args = parser.parse_args(["voices", *argv, "--db", str(db)])
        return args.handler(args)

    return run


@pytest.fixture
def prompt_file(fixture_dir, manifest) -> Path:
    return fixture_dir / manifest["frontend"]["prompt_wav_passed"]


def test_cli_add_list_delete(cli, capsys, model_dir, prompt_file, manifest):
    text = manifest["frontend"]["prompt_text_input"]
    assert cli("add", "alice", "--model-dir", str(model_dir), "--prompt-wav", str(prompt_file),
               "--prompt-text", text) == 0
    assert "added voice 'alice'" in capsys.readouterr().out
    assert cli("list") == 0
    listing = capsys.readouterr().out
    assert "alice" in listing and text[:20] in listing
    assert listing.splitlines()[1].split()[:2] == ["alice", "cosyvoice2"]  # the family of the model that analysed it
    assert cli("delete", "alice") == 0 and cli("list") == 0
    assert "no voices" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "flag"), [
    (["add", "bad/name", "--model-dir", "M", "--prompt-wav", "W", "--prompt-text", "t"], "NAME"),
    (["add", "bob", "--model-dir", "/nonexistent/model", "--prompt-wav", "W", "--prompt-text", "t"], "--model-dir"),
    (["add", "bob", "--model-dir", "MODEL", "--prompt-wav", "/nonexistent.wav", "--prompt-text", "t"], "--prompt-wav"),
    (["delete", "nobody"], "NAME"),
])
def test_cli_errors_are_one_line_naming_the_flag(cli, capsys, model_dir, argv, flag):
    argv = [str(model_dir) if arg == "MODEL" else arg for arg in argv]
    assert cli(*argv) == cli_voices.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"error: {flag}: " in err


def test_cli_add_rejects_a_text_file_as_prompt(cli, capsys, model_dir, tmp_path):
    fake = tmp_path / "fake.wav"
    fake.write_text("not audio\n" * 100)
    assert cli("add", "bob", "--model-dir", str(model_dir), "--prompt-wav", str(fake), "--prompt-text", "t") == 2
    assert "--prompt-wav: " in capsys.readouterr().err and cli("list") == 0


# several processes at once, and processes killed mid-write

_CLIENT = textwrap.dedent("""
    import random, sys, torch
    from cosystream.engine.voices import VoiceStore
    from cosystream.errors import UnknownVoice, VoiceExists
    from cosystream.frontend.prompt import VoicePrompt
    path, worker, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(worker)
    store = VoiceStore(path)
    print("ready", flush=True)
    for _ in range(rounds):
        name, n = f"v{rng.randrange(4)}", rng.randrange(8, 40)  # four names, so clients collide
        prompt = VoicePrompt(torch.zeros(3, dtype=torch.int32), torch.full((n,), worker, dtype=torch.int32),
                             torch.full((2 * n, 80), float(worker)), torch.full((192,), float(n)))
        op = rng.random()
        try:
            if op < 0.4:
                store.add(name, prompt, f"{worker}:{n}", {"cache": torch.full((n, 16), float(n))})
            elif op < 0.7:
                store.delete(name)
            elif op < 0.85:
                store.set_extras(name, {"cache": torch.full((n + 1, 16), float(n + 1))})
            else:
                store.get(name)
        except (UnknownVoice, VoiceExists):  # another client got there first: expected
            pass
    print("done", flush=True)
""")


def _start_clients(path: Path, num_clients: int, rounds: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", _CLIENT, str(path), str(w), str(rounds)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(num_clients)]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return procs


def _assert_consistent(path: Path) -> None:
    """Every listed voice loads whole, all of its parts from one write; no blob without its voice."""
    with VoiceStore(path) as store:
        for info in store.list():
            record = store.get(info.name)
            worker, n = (int(x) for x in info.prompt_text.split(":"))
            prompt = record.prompt
            assert info.num_prompt_tokens == n == prompt.prompt_speech_tokens.shape[0] == int(prompt.xvector[0])
            assert torch.equal(prompt.prompt_speech_tokens, torch.full((n,), worker, dtype=torch.int32))
            cache = record.extras["cache"]  # from add or a later set_extras: [m, 16] filled with m
            assert cache.shape == (int(cache[0, 0]), 16) and bool((cache == cache[0, 0]).all())
        store.add("after", make_prompt(), "still writable")
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    orphans = conn.execute("SELECT COUNT(*) FROM voice_blobs WHERE name NOT IN (SELECT name FROM voices)").fetchone()
    per_voice = conn.execute("SELECT COUNT(*) FROM voices v WHERE (SELECT COUNT(*) FROM voice_blobs b "
                             "WHERE b.name = v.name) != 2").fetchone()
    assert orphans[0] == 0 and per_voice[0] == 0
    conn.close()


@pytest.mark.slow  # ~10 s: several processes
def test_concurrent_processes_leave_a_consistent_store(tmp_path):
    path = tmp_path / "v.db"
    VoiceStore(path).close()  # created once, as a server would before clients arrive
    procs = _start_clients(path, num_clients=4, rounds=60)
    for proc in procs:
        proc.wait(timeout=120)
        out, err = proc.stdout.read(), proc.stderr.read()  # the pipes' buffers, not communicate(): "ready" was read
        assert proc.returncode == 0 and out.strip() == "done", err  # no "database is locked", no other error
    _assert_consistent(path)


@pytest.mark.slow  # ~7 s: processes killed
def test_clients_killed_mid_write_leave_a_consistent_store(tmp_path):
    path = tmp_path / "v.db"
    VoiceStore(path).close()
    procs = _start_clients(path, num_clients=3, rounds=100_000)  # still writing when they are killed
    time.sleep(1.0)
    for proc in procs:
        proc.kill()  # SIGKILL: no rollback, no close, WAL and locks left as they are
        assert proc.wait(timeout=30) == -9, proc.stderr.read()
    _assert_consistent(path)
