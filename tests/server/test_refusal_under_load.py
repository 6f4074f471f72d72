"""Admission's refusals on a loaded server (real engine, fixture model): answered while the admitted streams
play on, before any work on the refused request (its prompt recording is never analysed), with the
server's own answer time in `Server-Timing` and `cosystream_refusal_seconds`."""

from __future__ import annotations

import dataclasses
import re
import threading
import time

import httpx
import pytest
from server_live import VOICE, make_wav

from cosystream.engine.scheduler import Scheduler

LOADED_STREAMS = 2
LONG_TOKENS = 120  # each admitted stream plays on long after the refusals
REFUSALS = 4


def _server_time_s(response: httpx.Response) -> float:
    match = re.fullmatch(r"app;dur=([0-9.]+)", response.headers["server-timing"])
    assert match, response.headers["server-timing"]
    return float(match.group(1)) / 1000


def _refusals_counted(client: httpx.Client) -> float:
    text = client.get("/metrics").text
    match = re.search(r'^cosystream_refusal_seconds_count\{status="503"\} ([0-9.e+]+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


class _Stream(threading.Thread):
    """One admitted stream, read to its end; `started` once its first audio bytes came."""

    def __init__(self, base_url: str, seed: int) -> None:
        super().__init__(daemon=True)
        self.base_url, self.seed = base_url, seed
        self.started = threading.Event()
        self.status: int | None = None
        self.num_bytes = 0
        self.finished_at: float | None = None

    def run(self) -> None:
        body = {"text": "A long line that keeps the engine busy.", "voice": VOICE, "force_tokens": LONG_TOKENS,
                "seed": self.seed, "response_format": "pcm"}
        with httpx.Client(base_url=self.base_url, timeout=300) as client, \
                client.stream("POST", "/v1/tts", json=body) as response:
            self.status = response.status_code
            for data in response.iter_bytes():
                self.num_bytes += len(data)
                self.started.set()
        self.finished_at = time.perf_counter()
        self.started.set()


@pytest.fixture
def admission_on(live, monkeypatch):
    """The live engine with admission on (a budget every stream meets), restored after the test."""
    engine = live.engine
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, first_audio_budget_s=600.0))
    monkeypatch.setattr(engine.core, "scheduler", Scheduler(engine.core.scheduler.cost, budget_s=600.0))
    # the session's server runs with admission off: its decision counters go back to what they were
    monkeypatch.setattr(engine.core, "admitted", engine.core.admitted)
    monkeypatch.setattr(engine.core, "refused_by", dict(engine.core.refused_by))
    return engine


def test_a_loaded_server_refuses_at_once_and_before_any_work_while_admitted_streams_play_on(live, admission_on):
    engine = admission_on
    streams = [_Stream(live.base_url, seed) for seed in range(LOADED_STREAMS)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(120) and stream.status == 200
    engine.core.scheduler.budget_s = 1e-6  # no stream can start that soon: every newcomer is refused
    added_before, uploads_before = engine.core.added_total, len(engine._uploads)
    with live.client() as client:
        counted_before = _refusals_counted(client)
        answered = []
        for i in range(REFUSALS):
            t0 = time.perf_counter()
            if i % 2:  # a zero-shot request with a recording of its own: refused before it is analysed
                response = client.post("/v1/tts", data={"text": "Refuse me.", "prompt_text": "Hello there.",
                                                        "force_tokens": "20"},
                                       files={"prompt_wav": ("new.wav", make_wav(seconds=2.0 + i), "audio/wav")})
            else:
                response = client.post("/v1/tts", json={"text": "Refuse me.", "voice": VOICE, "force_tokens": 20})
            client_s = time.perf_counter() - t0
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "overloaded"
            assert float(response.headers["retry-after"]) >= 1
            assert _server_time_s(response) <= client_s  # the server's share of what the client waited
            answered.append(time.perf_counter())
        # the refused requests never reached the engine nor the frontend's prompt analysis
        assert engine.core.added_total == added_before
        assert len(engine._uploads) == uploads_before
        assert _refusals_counted(client) - counted_before == REFUSALS
    # every refusal was answered while each admitted stream was still playing
    assert all(stream.finished_at is None or stream.finished_at > answered[-1] for stream in streams)
    for stream in streams:
        stream.join(300)
        assert stream.status == 200 and stream.num_bytes == 2 * 960 * LONG_TOKENS  # whole, 16-bit PCM
