"""A fake engine for server tests that need control over timing (admission, timeouts) or speed (fuzzing).

It has the AsyncEngine methods the server calls. Each request yields `num_chunks` chunks of silence; a
test can hold every request before its first chunk (`gate`) to keep streams open as long as it likes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
from server_live import Live, run_server

from cosystream.errors import BadInput, UnknownVoice, VoiceExists
from cosystream.outputs import AudioChunk, StageTimes
from cosystream.params import SynthesisParams
from cosystream.server.app import build_app
from cosystream.server.state import ServerSettings

SAMPLES_PER_CHUNK = 960
TTS = {"text": "Hello.", "voice": "alice", "response_format": "pcm"}  # a /v1/tts body the fake engine serves


@dataclass
class FakeVoice:
    name: str
    prompt_text: str
    num_prompt_tokens: int = 50
    created_at: float | None = None


@dataclass
class FakeEngine:
    max_streams: int = 4
    num_chunks: int = 2
    samples_per_chunk: int = SAMPLES_PER_CHUNK
    chunk_delay_s: float = 0.0  # sleep before each chunk
    times: StageTimes = field(default_factory=lambda: StageTimes(first_audio_s=0.1, total_s=0.5, audio_s=0.08))
    gate: threading.Event = field(default_factory=threading.Event)  # requests wait here before audio
    voices: dict[str, FakeVoice] = field(default_factory=lambda: {"alice": FakeVoice("alice", "hi")})
    num_waiting: int = 0  # requests held at the gate now
    aborted: list[str] = field(default_factory=list)
    refuse: Exception | None = None  # raised by synthesize before any work (the engine's admission refusing)

    def __post_init__(self) -> None:
        self.gate.set()
        self.config = SimpleNamespace(max_streams=self.max_streams, max_text_chars=5000)
        self.core = SimpleNamespace(num_active=0, queue_depth=0, error=None)

    async def synthesize(self, params: SynthesisParams) -> AsyncIterator[AudioChunk]:
        if self.refuse is not None:
            raise self.refuse
        if params.voice is not None and params.voice not in self.voices and params.prompt_audio is None:
            raise UnknownVoice(f"voice: no voice named {params.voice!r}")
        self.num_waiting += 1
        is_held, finished = True, False
        try:
            while not self.gate.is_set():  # polled: the gate is set from test threads
                await asyncio.sleep(0.005)
            is_held = False
            self.num_waiting -= 1
            if not isinstance(params.text, str):  # text streamed in: like the engine, finish after its end
                async for _ in params.text:
                    pass
            for index in range(self.num_chunks):
                await asyncio.sleep(self.chunk_delay_s)
                is_final = index == self.num_chunks - 1
                yield AudioChunk(pcm=np.zeros(self.samples_per_chunk, np.float32), index=index, is_final=is_final,
                                 times=self.times if is_final else None, request_id=params.request_id or "")
            finished = True
        finally:
            if is_held:
                self.num_waiting -= 1
            if not finished:
                self.aborted.append(params.request_id or "")

    async def add_voice(self, name: str, audio: Any, prompt_text: str) -> FakeVoice:
        if name in self.voices:
            raise VoiceExists(f"name: a voice named {name!r} already exists")
        if not audio.startswith(b"RIFF"):
            raise BadInput("prompt_wav: not a readable audio file")
        self.voices[name] = FakeVoice(name, prompt_text)
        return self.voices[name]

    async def delete_voice(self, name: str) -> None:
        if self.voices.pop(name, None) is None:
            raise UnknownVoice(f"voice: no voice named {name!r}")

    def get_voice(self, name: str) -> FakeVoice:
        if name not in self.voices:
            raise UnknownVoice(f"voice: no voice named {name!r}")
        return self.voices[name]

    def list_voices(self) -> list[FakeVoice]:
        return list(self.voices.values())

    def stats(self) -> dict[str, float]:
        return {"num_active": 0.0, "queue_depth": 0.0}


@contextmanager
def fake_server(settings: ServerSettings, engine: FakeEngine | None = None) -> Iterator[FakeServer]:
    """A uvicorn server around a FakeEngine (ready at once: no warm-up)."""
    engine = engine or FakeEngine()
    app = build_app(engine, replace(settings, warmup=False, close_engine=False))
    with run_server(app) as base_url:
        yield FakeServer(base_url, app, engine)


@dataclass
class FakeServer(Live):
    """A live server around a FakeEngine (urls, state and clients as `Live`)."""

    engine: FakeEngine

    def count(self, endpoint: str, outcome: str) -> float:
        value = self.state.metrics.registry.get_sample_value(
            "cosystream_requests_total", {"endpoint": endpoint, "outcome": outcome})
        return value or 0.0

    def wait_until(self, condition: Any, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, "condition not reached in time"
            time.sleep(0.005)


class Held:
    """A request started in a thread, which stays open while the fake engine's gate is shut."""

    def __init__(self, server: FakeServer, body: dict | None = None, headers: dict | None = None,
                 path: str = "/v1/tts") -> None:
        self.response: httpx.Response | None = None
        self.thread = threading.Thread(target=self._run, args=(server, path, body or TTS, headers or {}))
        self.thread.start()

    def _run(self, server: FakeServer, path: str, body: dict, headers: dict) -> None:
        with server.client() as client:
            self.response = client.post(path, json=body, headers=headers)

    def join(self) -> httpx.Response:
        self.thread.join(timeout=30)
        assert self.response is not None
        return self.response
