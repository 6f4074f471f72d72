"""VoiceStore: registered voices and their precomputed prompt artefacts, persisted in SQLite.

A voice is registered once (the frontend's `VoicePrompt`, spec/frontend.md §7-§9) and reused by
every request of a model of its family (CosyVoice2 or CosyVoice3: listed with the voice). Each
record holds the prompt tensors and an `extras` dict where the engine keeps per-voice caches (e.g.
the flow's encoded prompt); tensors are stored as safetensors bytes in the rows, so every write is one
SQLite transaction: a crash leaves the previous state.
Plain Python + CPU tensors: no CUDA, no model code.
"""

from __future__ import annotations

import os
import re
import sqlite3
import threading
import time
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from cosystream.errors import BadInput, UnknownVoice, VoiceExists
from cosystream.frontend.prompt import DEFAULT_FAMILY, VoicePrompt

DB_FILE_NAME = "voices.db"
SCHEMA_VERSION = 2  # 2: voices.family (a version-1 database gains it when opened, read from each prompt)
MAX_VOICE_NAME_CHARS = 64
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # registration: names that are safe in any file system
NAME_RULE = "registered voices use only A-Z a-z 0-9 _ . -"
SPEECH_TOKENS_PER_S = 25  # prompt tokens -> seconds of prompt audio
BUSY_TIMEOUT_MS = 5000  # another process (e.g. the CLI) may hold the write lock briefly

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS voices (
        name TEXT PRIMARY KEY,
        prompt_text TEXT NOT NULL,
        num_prompt_tokens INTEGER NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        family TEXT NOT NULL DEFAULT 'cosyvoice2')""",
    """CREATE TABLE IF NOT EXISTS voice_blobs (
        name TEXT NOT NULL REFERENCES voices(name) ON DELETE CASCADE,
        kind TEXT NOT NULL,
        data BLOB NOT NULL,
        PRIMARY KEY (name, kind))""",
)
_COLUMNS = "name, prompt_text, num_prompt_tokens, created_at, updated_at, family"  # VoiceInfo's field order
_PROMPT = "prompt"  # voice_blobs.kind of the VoicePrompt tensors
_EXTRAS = "extras"  # voice_blobs.kind of the engine's caches


def default_db_path() -> Path:
    """`$COSYSTREAM_HOME/voices.db`, else `~/.cache/cosystream/voices.db`."""
    home = os.environ.get("COSYSTREAM_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "cosystream"
    return base / DB_FILE_NAME


@dataclass(frozen=True)
class VoiceInfo:
    """A voice as listed: no tensors."""

    name: str
    prompt_text: str
    num_prompt_tokens: int  # 25 Hz speech tokens of the prompt
    created_at: float  # unix seconds
    updated_at: float  # unix seconds; changes with set_extras
    family: str = DEFAULT_FAMILY  # the model family whose frontend made the prompt (the models it serves)

    @property
    def prompt_seconds(self) -> float:
        return self.num_prompt_tokens / SPEECH_TOKENS_PER_S


@dataclass(frozen=True)
class VoiceRecord:
    """A stored voice: its prompt, its transcript, and the engine's cached extras (CPU tensors)."""

    info: VoiceInfo
    prompt: VoicePrompt
    extras: dict[str, torch.Tensor]

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def prompt_text(self) -> str:
        return self.info.prompt_text


def voice_name_problem(name: object) -> str | None:
    """Why `name` cannot name a voice (registered, or a built-in sft speaker, whose names need not be ASCII),
    or None. The one voice-name rule of every entry point. Names are looked up, never used as paths, but a
    path-like or control-character name is refused anyway so that no log line, file name or store a name
    may reach later can be tricked by one."""
    if not isinstance(name, str):
        return "must be a string"
    if not 1 <= len(name) <= MAX_VOICE_NAME_CHARS:
        return f"must be 1-{MAX_VOICE_NAME_CHARS} characters"
    if "/" in name or "\\" in name or name.strip(".") == "":
        return "must not look like a path (no / or \\, not only dots)"
    if any(unicodedata.category(ch).startswith("C") for ch in name):
        return "must not contain control or invisible format characters"
    if name != name.strip():
        return "must not start or end with white space"
    return None


def check_voice_name(name: object, field: str = "name") -> str:
    """A name a new voice may be registered under: a valid voice name (voice_name_problem) from the
    registration alphabet only (NAME_RULE)."""
    problem = voice_name_problem(name)
    if problem is None and NAME_PATTERN.fullmatch(name) is None:
        problem = NAME_RULE
    if problem is not None:
        raise BadInput(f"{field}: {name!r} is not a valid voice name ({problem})")
    return name


def encode_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """safetensors bytes of CPU copies (safetensors refuses shared or strided storage)."""
    return save_tensors({key: value.detach().to("cpu").contiguous().clone() for key, value in tensors.items()})


def _check_extras(extras: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    extras = {} if extras is None else extras
    if not isinstance(extras, dict):
        raise BadInput(f"extras: expected a dict of tensors, got {type(extras).__name__}")
    for key, value in extras.items():
        if not isinstance(key, str) or not key or not isinstance(value, torch.Tensor):
            raise BadInput(f"extras: entry {key!r} must map a non-empty string to a tensor")
    return extras


def _upgrade(conn: sqlite3.Connection) -> None:
    """A version-1 database (no family column): add it, each voice's family read from its stored prompt (one
    transaction: another process opening the file meanwhile sees it before or after, never half done)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        if "family" in {row[1] for row in conn.execute("PRAGMA table_info(voices)")}:  # new, or upgraded meanwhile
            conn.execute("COMMIT")
            return
        conn.execute(f"ALTER TABLE voices ADD COLUMN family TEXT NOT NULL DEFAULT '{DEFAULT_FAMILY}'")
        prompts = conn.execute("SELECT name, data FROM voice_blobs WHERE kind = ?", (_PROMPT,)).fetchall()
        for name, data in prompts:
            family = VoicePrompt.from_tensors(load_tensors(data)).family
            conn.execute("UPDATE voices SET family = ? WHERE name = ?", (family, name))
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


class VoiceStore:
    """Persistent voices. Safe to share between threads (one connection behind a lock) and with
    other processes (SQLite WAL; writers wait up to 5 s for each other).
    """

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path).expanduser() if path is not None else default_db_path()
        self._lock = threading.RLock()
        self._conn = self._open()

    def _open(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False,
                                   timeout=BUSY_TIMEOUT_MS / 1000)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA foreign_keys=ON")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                conn.close()
                raise BadInput(f"db: {self.path} has schema version {version}, newer than this "
                               f"cosystream supports ({SCHEMA_VERSION})")
            for statement in _SCHEMA:
                conn.execute(statement)
            if version < SCHEMA_VERSION:
                _upgrade(conn)
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except (sqlite3.Error, OSError) as exc:
            raise BadInput(f"db: cannot open {self.path} as a voice database ({exc})") from None
        return conn

    @contextmanager
    def _transaction(self, write: bool) -> Iterator[sqlite3.Connection]:
        # IMMEDIATE takes the write lock up front, so two writers never deadlock on upgrade.
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def add(self, name: str, prompt: VoicePrompt, prompt_text: str,
            extras: dict[str, torch.Tensor] | None = None) -> VoiceInfo:
        """Register a new voice; VoiceExists if the name is taken."""
        check_voice_name(name)
        if not isinstance(prompt, VoicePrompt):
            raise BadInput(f"prompt: expected a VoicePrompt, got {type(prompt).__name__}")
        if not isinstance(prompt_text, str):
            raise BadInput(f"prompt_text: expected a string, got {type(prompt_text).__name__}")
        extras = _check_extras(extras)
        now = time.time()
        info = VoiceInfo(name, prompt_text, int(prompt.prompt_speech_tokens.shape[0]), now, now, prompt.family)
        with self._transaction(write=True) as conn:
            if conn.execute("SELECT 1 FROM voices WHERE name = ?", (name,)).fetchone():
                raise VoiceExists(f"name: a voice named {name!r} already exists (delete it first)")
            conn.execute(f"INSERT INTO voices ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
                         (name, prompt_text, info.num_prompt_tokens, now, now, info.family))
            conn.execute("INSERT INTO voice_blobs VALUES (?, ?, ?)", (name, _PROMPT, encode_tensors(prompt.tensors())))
            conn.execute("INSERT INTO voice_blobs VALUES (?, ?, ?)", (name, _EXTRAS, encode_tensors(extras)))
        return info

    def get(self, name: str) -> VoiceRecord:
        """The full record; UnknownVoice if absent."""
        check_voice_name(name)
        with self._transaction(write=False) as conn:
            row = conn.execute(f"SELECT {_COLUMNS} FROM voices WHERE name = ?", (name,)).fetchone()
            blobs = dict(conn.execute("SELECT kind, data FROM voice_blobs WHERE name = ?", (name,)).fetchall())
        if row is None:
            raise UnknownVoice(f"voice: no voice named {name!r} (see `cosystream voices list`)")
        prompt = VoicePrompt.from_tensors(load_tensors(blobs[_PROMPT]))
        return VoiceRecord(info=VoiceInfo(*row), prompt=prompt, extras=load_tensors(blobs[_EXTRAS]))

    def list(self) -> list[VoiceInfo]:
        """Every voice, sorted by name."""
        with self._transaction(write=False) as conn:
            rows = conn.execute(f"SELECT {_COLUMNS} FROM voices ORDER BY name").fetchall()
        return [VoiceInfo(*row) for row in rows]

    def delete(self, name: str) -> None:
        """Remove a voice and its extras; UnknownVoice if absent."""
        check_voice_name(name)
        with self._transaction(write=True) as conn:
            conn.execute("DELETE FROM voice_blobs WHERE name = ?", (name,))
            if conn.execute("DELETE FROM voices WHERE name = ?", (name,)).rowcount == 0:
                raise UnknownVoice(f"voice: no voice named {name!r}")

    def set_extras(self, name: str, extras: dict[str, torch.Tensor]) -> None:
        """Replace the voice's extras as a whole (pass the merged dict to keep older entries)."""
        check_voice_name(name)
        extras = _check_extras(extras)
        with self._transaction(write=True) as conn:
            updated = conn.execute("UPDATE voices SET updated_at = ? WHERE name = ?", (time.time(), name))
            if updated.rowcount == 0:
                raise UnknownVoice(f"voice: no voice named {name!r}")
            conn.execute("UPDATE voice_blobs SET data = ? WHERE name = ? AND kind = ?",
                         (encode_tensors(extras), name, _EXTRAS))

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str) or NAME_PATTERN.fullmatch(name) is None:
            return False
        with self._transaction(write=False) as conn:
            return conn.execute("SELECT 1 FROM voices WHERE name = ?", (name,)).fetchone() is not None

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> VoiceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
