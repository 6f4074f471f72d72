"""Every documented error: status, the one JSON shape, and that no error harms the server or other streams."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from server_live import (
    SAMPLES_PER_TOKEN,
    UPLOAD_LIMIT_BYTES,
    VOICE,
    decode,
    engine_swapped,
    make_wav,
    run_server,
)

from cosystream.errors import Overloaded
from cosystream.outputs import AudioChunk
from cosystream.server.app import build_app
from cosystream.server.state import ServerSettings

TEXT = "Hello world."


def assert_error(response: httpx.Response, status: int, code: str, field: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "field"}
    assert body["error"]["code"] == code and body["error"]["field"] == field
    assert body["error"]["message"]
    return body["error"]


def speech(**overrides) -> dict:
    return {"model": "x", "input": TEXT, "voice": VOICE, "response_format": "pcm", "force_tokens": 2, **overrides}


@pytest.mark.parametrize(("body", "field"), [
    (speech(input=""), "input"),
    (speech(input="   \n "), "input"),
    (speech(input="a" * 5001), "input"),
    (speech(response_format="aac"), "response_format"),
    (speech(speed=10), "speed"),
    (speech(speed="fast"), "speed"),
    (speech(force_tokens=0), "force_tokens"),
    ({"model": "x", "input": TEXT}, "voice"),
])
def test_speech_bad_input_is_400(client, body, field):
    assert_error(client.post("/v1/audio/speech", json=body), 400, "bad_input", field)


def test_unknown_voice_is_400_in_a_body_and_404_as_a_resource(client):
    assert_error(client.post("/v1/audio/speech", json=speech(voice="nobody")), 400, "unknown_voice", "voice")
    assert_error(client.post("/v1/tts", json={"text": TEXT, "voice": "nobody"}), 400, "unknown_voice", "voice")
    assert_error(client.get("/v1/voices/nobody"), 404, "unknown_voice", "voice")
    assert_error(client.delete("/v1/voices/nobody"), 404, "unknown_voice", "voice")


@pytest.mark.parametrize(("body", "field"), [
    ({"text": "", "voice": VOICE}, "text"),
    ({"text": "x" * 5001, "voice": VOICE}, "text"),
    ({"text": TEXT, "voice": VOICE, "no_such_knob": 1}, "no_such_knob"),
    ({"text": TEXT, "voice": VOICE, "mode": "karaoke"}, "mode"),
    ({"text": TEXT, "voice": VOICE, "top_p": 1.5}, "top_p"),
    ({"text": TEXT, "voice": VOICE, "speed": 2.0}, "speed"),  # speed needs stream=false (engine rule)
    ({"text": TEXT, "mode": "vc", "voice": VOICE}, "source_wav"),
    ({"text": TEXT}, "voice"),
])
def test_tts_bad_input_is_400(client, body, field):
    assert_error(client.post("/v1/tts", json=body), 400, "bad_input", field)


def test_unreadable_uploads_are_400(client):
    bad = {"prompt_wav": ("p.wav", b"RIFF....WAVEnot really", "audio/wav")}
    assert_error(client.post("/v1/tts", data={"text": TEXT, "prompt_text": "x"}, files=bad), 400, "bad_input",
                 "prompt_wav")
    assert_error(client.post("/v1/voices", data={"name": "carol", "prompt_text": "x"}, files=bad), 400,
                 "bad_input", "prompt_wav")
    assert_error(client.post("/v1/voices", data={"name": "carol", "prompt_text": "x"}), 400, "bad_input",
                 "prompt_wav")
    assert_error(client.post("/v1/voices", data={"name": "no spaces!", "prompt_text": "x"},
                             files={"prompt_wav": ("p.wav", make_wav(), "audio/wav")}), 400, "bad_input", "name")
    assert_error(client.post("/v1/tts", data={"text": TEXT, "voice": VOICE},
                             files={"other": ("o.wav", make_wav(), "audio/wav")}), 400, "bad_input", "other")


def test_request_format_errors(client):
    assert_error(client.post("/v1/tts", content=b"{not json", headers={"content-type": "application/json"}),
                 400, "bad_input", "body")
    assert_error(client.post("/v1/tts", content=b"[1, 2]", headers={"content-type": "application/json"}),
                 400, "bad_input", "body")
    assert_error(client.post("/v1/tts", content=b"text", headers={"content-type": "text/plain"}),
                 415, "unsupported_media_type")
    assert_error(client.post("/v1/tts?events=maybe", json={"text": TEXT, "voice": VOICE}), 400, "bad_input", "events")
    assert_error(client.get("/v1/nothing-here"), 404, "not_found")
    assert_error(client.get("/v1/tts"), 405, "method_not_allowed")


def test_oversized_upload_is_413_by_length_and_while_reading(client):
    big = make_wav(seconds=40.0)  # > UPLOAD_LIMIT_BYTES
    assert len(big) > UPLOAD_LIMIT_BYTES
    assert_error(client.post("/v1/voices", data={"name": "big", "prompt_text": "x"},
                             files={"prompt_wav": ("big.wav", big, "audio/wav")}), 413, "payload_too_large")

    def chunked():  # no Content-Length: the limit must hold while the body streams in
        for start in range(0, len(big), 64 * 1024):
            yield big[start:start + 64 * 1024]

    response = client.post("/v1/tts", content=chunked(), headers={"content-type": "application/json"})
    assert_error(response, 413, "payload_too_large")
    assert client.get("/v1/voices/big").status_code == 404


def test_overloaded_is_503_with_retry_after(live, client):
    async def refuse(params):
        raise Overloaded("queue full (256 waiting); retry later", retry_after_s=2.5)
        yield  # an async generator, like the engine's

    with engine_swapped(live, refuse):
        response = client.post("/v1/audio/speech", json=speech())
    assert_error(response, 503, "overloaded")
    assert response.headers["retry-after"] == "3"
    assert live.count("speech", "overloaded") >= 1


def test_failure_mid_stream_truncates_audio_or_ends_events_with_error(live, client):
    async def fail_after_one_chunk(params):
        yield AudioChunk(pcm=np.zeros(SAMPLES_PER_TOKEN, np.float32), index=0, request_id=params.request_id)
        raise RuntimeError("simulated device failure")

    with engine_swapped(live, fail_after_one_chunk):
        with pytest.raises(httpx.RemoteProtocolError):  # no chunked terminator: the client knows it is cut short
            client.post("/v1/tts", json={"text": TEXT, "voice": VOICE, "response_format": "pcm"})
        events = client.post("/v1/tts?events=ndjson", json={"text": TEXT, "voice": VOICE}).text.splitlines()
    assert '"type":"audio"' in events[0] and '"code":"internal"' in events[-1]
    ok = client.post("/v1/audio/speech", json=speech())  # the server is fine afterwards
    assert decode(ok.content, "pcm").shape == (2 * SAMPLES_PER_TOKEN,)


def test_errors_do_not_disturb_a_concurrent_stream(live):
    result: dict = {}

    def long_stream() -> None:
        with live.client() as c:
            result["response"] = c.post("/v1/tts", json={"text": TEXT, "voice": VOICE, "force_tokens": 60,
                                                         "response_format": "pcm"})

    thread = threading.Thread(target=long_stream)
    thread.start()
    with live.client() as c:
        for _ in range(5):
            assert c.post("/v1/tts", json={"text": "", "voice": VOICE}).status_code == 400
            assert c.post("/v1/audio/speech", json=speech(voice="nobody")).status_code == 400
            assert c.post("/v1/voices", data={"name": "x", "prompt_text": ""},
                          files={"prompt_wav": ("x.wav", b"junk", "audio/wav")}).status_code == 400
    thread.join(timeout=120)
    assert decode(result["response"].content, "pcm").shape == (60 * SAMPLES_PER_TOKEN,)


def test_client_disconnect_mid_stream_aborts_in_the_engine(live, client, monkeypatch):
    aborted: list[str] = []
    abort_seen = threading.Event()
    original_abort = live.engine.core.abort

    def abort(request_id: str) -> None:
        aborted.append(request_id)
        abort_seen.set()
        original_abort(request_id)

    monkeypatch.setattr(live.engine.core, "abort", abort)
    cancelled_before = live.count("tts", "cancelled")
    body = {"text": TEXT, "voice": VOICE, "force_tokens": 2000, "response_format": "pcm"}
    with client.stream("POST", "/v1/tts", json=body) as response:
        request_id = response.headers["x-request-id"]
        assert next(response.iter_raw())  # the first chunk arrived; now hang up
    assert abort_seen.wait(60)
    assert aborted == [request_id]
    assert live.engine_idle()
    assert live.count("tts", "cancelled") == cancelled_before + 1


class SlowWarmupEngine:
    """Just enough engine for the readiness gate: warmup blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.config = SimpleNamespace(max_text_chars=100)
        self.core = SimpleNamespace(num_active=0, queue_depth=0, error=None)

    def warmup(self) -> None:
        assert self.release.wait(60)


def test_ready_is_503_until_warmup_finished_and_health_fails_once_the_engine_stopped():
    engine = SlowWarmupEngine()
    app = build_app(engine, ServerSettings(close_engine=False))
    with run_server(app) as base_url, httpx.Client(base_url=base_url, timeout=30) as c:
        assert c.get("/health").json() == {"status": "starting"}
        response = c.get("/ready")
        assert_error(response, 503, "not_ready")
        assert int(response.headers["retry-after"]) > 0
        assert_error(c.post("/v1/audio/speech", json=speech()), 503, "not_ready")
        engine.release.set()
        assert app.state.server.ready_event.wait(30)
        assert c.get("/ready").json() == {"status": "ok"}
        assert "cosystream_engine_queue_depth 0.0" in c.get("/metrics").text
        engine.core.error = RuntimeError("device lost")  # what EngineCore records when its loop dies
        assert_error(c.get("/health"), 503, "engine_dead")
        assert_error(c.get("/ready"), 503, "engine_dead")


def test_engine_failure_codes_map_to_statuses():
    from cosystream.errors import SynthesisFailed
    from cosystream.server.errors import to_api_error

    oom = to_api_error(SynthesisFailed("out of memory on a flow batch", code="out_of_memory"))
    assert (oom.status, oom.code) == (503, "out_of_memory") and oom.headers() == {"Retry-After": "1"}
    nan = to_api_error(SynthesisFailed("the speech LM produced NaN", code="non_finite_output"))
    assert (nan.status, nan.code) == (500, "non_finite_output")
    other = to_api_error(SynthesisFailed("boom"))
    assert (other.status, other.code) == (500, "engine_error")
