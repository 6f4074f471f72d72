"""Fuzzing, bounded and deterministic: the HTTP API from its own OpenAPI schema (schemathesis) and the
WebSocket protocol with random frames, both against the real engine on the tiny model.

Generated requests that name the test voice reach real synthesis (text normalisation, tokenizer, LM
sampling, flow, HiFT); each is cut to a few speech tokens so the run stays short. docs/reliability.md#fuzzing
has the figures.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from server_live import VOICE, EngineProxy, Live, run_server
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from cosystream.errors import UnknownVoice
from cosystream.params import Mode, SynthesisParams
from cosystream.server.app import build_app
from cosystream.server.state import ServerSettings

MAX_TOKENS = 3  # speech tokens per fuzzed synthesis: enough to run every stage once
HTTP_EXAMPLES = {"/v1/audio/speech": 150, "/v1/tts": 150, "/v1/voices": 40, "/v1/voices/{name}": 30}
OTHER_EXAMPLES = 3  # /health, /ready, /metrics: no input to speak of
WS_SESSIONS = 200
WS_MAX_BYTES, WS_BURST = 4096, 20
WS_QUIET_S = 0.3  # a session the server keeps open this long is waiting for more text: the client hangs up
SETTINGS = ServerSettings(warmup=False, close_engine=False, ws_max_message_bytes=WS_MAX_BYTES,
                          ws_message_burst=WS_BURST)
POSITIVE_CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
NEGATIVE_CHECKS = [*POSITIVE_CHECKS, negative_data_rejection]


class FuzzEngine(EngineProxy):
    """The real engine, with every synthesis cut to MAX_TOKENS and the shared test voice kept from deletion."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine, self._synthesize)

    def _synthesize(self, params: SynthesisParams) -> Any:
        return self._engine.synthesize(replace(params, force_tokens=min(params.force_tokens or MAX_TOKENS, MAX_TOKENS)))

    async def delete_voice(self, name: str) -> None:
        if name == VOICE:
            raise UnknownVoice(f"voice: no voice named {name!r}")  # as if absent: other tests need it
        await self._engine.delete_voice(name)


@pytest.fixture(scope="module")
def fuzz_app(live: Live) -> Iterator[tuple[FastAPI, str]]:
    app = build_app(FuzzEngine(live.engine), SETTINGS)
    with run_server(app) as base_url:
        yield app, base_url


def outcomes(app: FastAPI, endpoint: str) -> dict[str, float]:
    registry = app.state.server.metrics.registry
    return {sample.labels["outcome"]: sample.value for metric in registry.collect() for sample in metric.samples
            if sample.name == "cosystream_requests_total" and sample.labels["endpoint"] == endpoint}


def towards_synthesis(case: Any, steer: bool) -> Any:
    """Steer most valid synthesis bodies past the cross-field rules the schema cannot express (a
    registered voice; text unless vc; vc and sft need other inputs; speed != 1 needs stream=false), so they
    reach the engine."""
    if not steer or not isinstance(case.body, dict) or case.operation.path not in ("/v1/audio/speech", "/v1/tts"):
        return case
    body = case.body
    body["voice"] = VOICE
    if case.operation.path == "/v1/tts" and not str(body.get("text") or "").strip():  # empty only for vc
        body["text"] = "Hi."
    if body.get("mode") in ("vc", "sft"):
        body["mode"] = "zero_shot"
    if body.get("speed", 1) not in (1, "1", "1.0"):
        body["stream"] = False
    return case


def has_inputs(operation: Any) -> bool:
    return bool(len(operation.body) or len(operation.path_parameters) or len(operation.query))


@pytest.mark.slow  # a fuzzer: ~10-30 s of CPU per mode
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_http_api_against_its_openapi_schema(fuzz_app, mode):
    app, base_url = fuzz_app
    schema = schemathesis.openapi.from_dict(app.openapi())
    operations = [result.ok() for result in schema.get_all_operations()]
    checks = POSITIVE_CHECKS if mode == GenerationMode.POSITIVE else NEGATIVE_CHECKS
    num_calls = 0
    for operation in operations:
        if operation.path == "/v1/tts/stream" or (mode == GenerationMode.NEGATIVE and not has_inputs(operation)):
            continue  # the WebSocket (documented as a GET) is fuzzed below; no input, nothing to make invalid
        strategy = operation.as_strategy(generation_mode=mode)
        if mode == GenerationMode.POSITIVE:  # an invalid body must stay invalid
            strategy = st.builds(towards_synthesis, strategy, st.integers(0, 3).map(bool))  # 3 in 4

        @given(case=strategy)
        @settings(max_examples=HTTP_EXAMPLES.get(operation.path, OTHER_EXAMPLES), derandomize=True, deadline=None,
                  suppress_health_check=list(HealthCheck), database=None)
        def call(case: Any) -> None:
            nonlocal num_calls
            num_calls += 1
            case.call_and_validate(base_url=base_url, checks=checks, timeout=60)

        call()
    assert num_calls >= sum(HTTP_EXAMPLES.values())  # the budget was spent, not skipped
    assert "internal" not in outcomes(app, "speech") and "internal" not in outcomes(app, "tts")


# ---------------------------------------------------------------- WebSocket

_VALID = [{"type": "start", "voice": VOICE, "text": "Hello there."}, {"type": "start", "voice": VOICE},
          {"type": "text", "text": "More words, "}, {"type": "end"}]
_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                             max_size=3), max_leaves=6)
_MESSAGES = st.fixed_dictionaries(
    {"type": st.sampled_from(["start", "text", "end", "stop", ""]) | _JSON},
    optional={"voice": st.sampled_from([VOICE, "nobody", "../x", "a\x00b"]) | st.text(max_size=6),
              "text": st.text(max_size=40), "mode": st.sampled_from([m.value for m in Mode] + ["karaoke"]),
              "response_format": st.sampled_from(["pcm", "wav", "mp3", "opus", "flac", "aac"]),
              "speed": st.floats(), "seed": st.integers(), "top_k": st.integers(), "top_p": st.floats(),
              "first_hop": st.integers(-5, 200), "stream": _SCALARS, "bogus": _JSON})
FRAMES = st.one_of(
    st.sampled_from(_VALID).map(json.dumps),
    _MESSAGES.map(json.dumps),  # NaN and Infinity come out as JSON's non-standard literals
    _JSON.map(json.dumps),
    st.text(max_size=60),
    st.binary(max_size=60),
    st.sampled_from(["x" * (WS_MAX_BYTES + 1), json.dumps({"type": "text", "text": "y" * WS_MAX_BYTES})]),
    st.just("__flood__"),  # more messages at once than the burst allows
)
_STARTS = st.fixed_dictionaries(
    {"type": st.just("start"), "voice": st.just(VOICE)},
    optional={"text": st.text(max_size=40), "mode": st.sampled_from(["zero_shot", "cross_lingual"]),
              "response_format": st.sampled_from(["pcm", "wav", "mp3", "opus", "flac"]),
              "seed": st.integers(0, 2**31 - 1), "top_k": st.integers(1, 50), "top_p": st.floats(0.05, 1.0),
              "first_hop": st.integers(1, 100), "greedy": st.booleans()}).map(json.dumps)
_PIECES = st.text(max_size=30).map(lambda text: json.dumps({"type": "text", "text": text}))
_END = json.dumps({"type": "end"})
# a third of the sessions are random frames throughout, a third open validly and go on at random, and a
# third are valid with random text and settings, so the engine's text streaming gets fuzzed too
SESSIONS = st.one_of(st.lists(FRAMES, min_size=1, max_size=6),
                     st.builds(lambda start, rest: [start, *rest], _STARTS, st.lists(_PIECES | FRAMES, max_size=5)),
                     st.builds(lambda start, pieces: [start, *pieces, _END], _STARTS, st.lists(_PIECES, max_size=4)))
EVENT_TYPES = {"started", "chunk", "done", "error"}
CLIENT_ERROR_CLOSES = {4400, 4408, 4413, 4429, 4503, 4504}
ERROR_STATUS = {"bad_input": 400, "unknown_voice": 400, "timeout": 408, "payload_too_large": 413,
                "rate_limited": 429, "too_many_streams": 429, "overloaded": 503, "deadline_exceeded": 504}


def run_ws_session(url: str, frames: list[str | bytes], quiet_s: float = WS_QUIET_S) -> tuple[list[dict], int | None]:
    """Send the frames, then read until the server closes (its close code) or goes quiet (then hang up: None)."""
    events: list[dict] = []
    with connect(url, max_size=None, open_timeout=30) as ws:
        try:
            for frame in frames:
                for piece in ([json.dumps({"type": "text", "text": "a"})] * (WS_BURST + 1)
                              if frame == "__flood__" else [frame]):
                    ws.send(piece)
        except ConnectionClosed:
            pass  # the server refused an earlier frame; what it sent is still to be read
        try:
            while True:
                message = ws.recv(timeout=quiet_s)
                if isinstance(message, str):
                    events.append(json.loads(message))
        except ConnectionClosed:
            return events, ws.close_code
        except TimeoutError:
            return events, None


def check_ws_session(events: list[dict], close_code: int | None) -> None:
    assert {e.get("type") for e in events} <= EVENT_TYPES, events
    if close_code == 1000:  # the server finished the request
        assert events[-1]["type"] == "done", events
    elif close_code is not None:  # the server refused: an error event, then 4000 + its HTTP status
        assert close_code in CLIENT_ERROR_CLOSES and events[-1]["type"] == "error", (close_code, events)
        assert close_code == 4000 + ERROR_STATUS[events[-1]["error"]["code"]], (close_code, events)
    else:  # the session still waits for text, and the client hangs up
        assert all(e["type"] != "error" for e in events), events


@pytest.mark.slow  # a fuzzer: ~10-15 s
def test_websocket_random_frames(fuzz_app, live):
    app, base_url = fuzz_app
    url = "ws" + base_url[len("http"):] + "/v1/tts/stream"

    @given(frames=SESSIONS)
    @settings(max_examples=WS_SESSIONS, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)
    def session(frames: list[str | bytes]) -> None:
        check_ws_session(*run_ws_session(url, frames))

    session()
    ws_outcomes = outcomes(app, "ws")
    assert "internal" not in ws_outcomes and "engine_error" not in ws_outcomes, ws_outcomes
    events, close_code = run_ws_session(url, [json.dumps(_VALID[0]), json.dumps({"type": "end"})], quiet_s=60)
    assert close_code == 1000 and events[-1]["type"] == "done"  # still serving normally
    assert live.engine_idle() and app.state.server.admission.num_in_flight == 0  # nothing leaked
