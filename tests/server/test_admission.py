"""Admission control and request timeouts: the engine's 503 over the budget, 429 per client, 504 on time-outs."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from fake_engine import TTS, FakeEngine, Held, fake_server
from test_errors import assert_error
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from cosystream.errors import Overloaded
from cosystream.server.admission import Admission
from cosystream.server.errors import ApiError
from cosystream.server.state import ServerSettings


def test_per_client_limit_counts_each_client_separately():
    admission = Admission(max_per_client=2)
    admission.admit("ip:1")
    admission.admit("ip:1")
    admission.admit("ip:2")
    with pytest.raises(ApiError) as refused:
        admission.admit("ip:1")
    assert (refused.value.status, refused.value.code) == (429, "too_many_streams")
    assert "Retry-After" in refused.value.headers()
    for _ in range(2):
        admission.release("ip:1")
    admission.release("ip:2")
    assert admission.num_in_flight == 0 and not admission.per_client


def test_the_engine_s_admission_refusal_is_503_with_retry_after_on_http_and_websocket():
    """The first-audio budget is the engine's (EngineConfig.first_audio_budget_s): its Overloaded reaches the
    client as 503 overloaded with Retry-After, and the WebSocket obeys the same rule (4503)."""
    engine = FakeEngine()
    with fake_server(ServerSettings(), engine) as server, server.client() as client:
        engine.refuse = Overloaded("overloaded: predicted first audio in 2.40 s, over the budget of 1 s",
                                   retry_after_s=1.4)
        response = client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "alice"})
        assert_error(response, 503, "overloaded")
        assert response.headers["retry-after"] == "2" and "predicted first audio" in response.json()["error"]["message"]
        with connect(server.ws_url + "/v1/tts/stream") as ws:
            ws.send(json.dumps({"type": "start", "voice": "alice", "text": "Hi."}))
            events = [json.loads(ws.recv(timeout=10)) for _ in range(2)]
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=10)
        assert [e["type"] for e in events] == ["started", "error"]
        assert events[1]["error"]["code"] == "overloaded" and ws.close_code == 4503
        assert server.count("speech", "overloaded") == 1 and server.count("ws", "overloaded") == 1
        assert server.state.admission.num_in_flight == 0  # a refused stream holds nothing
        engine.refuse = None
        assert client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "alice"}).status_code == 200


def test_per_client_limit_is_429_on_http_and_websocket():
    engine = FakeEngine()
    with fake_server(ServerSettings(max_streams_per_client=1), engine) as server, server.client() as client:
        engine.gate.clear()
        held = Held(server)
        server.wait_until(lambda: engine.num_waiting == 1)
        response = client.post("/v1/tts", json=TTS)
        assert_error(response, 429, "too_many_streams")
        assert int(response.headers["retry-after"]) >= 1
        with connect(server.ws_url + "/v1/tts/stream") as ws:
            ws.send(json.dumps({"type": "start", "voice": "alice", "text": "Hi."}))
            events = [json.loads(ws.recv(timeout=10)) for _ in range(2)]
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=10)
        assert [e["type"] for e in events] == ["started", "error"]
        assert events[1]["error"]["code"] == "too_many_streams" and ws.close_code == 4429
        engine.gate.set()
        assert held.join().status_code == 200
        assert client.post("/v1/tts", json=TTS).status_code == 200  # the stream ended, so the client may again
        assert server.state.admission.num_in_flight == 0
        assert server.count("tts", "too_many_streams") == 1 and server.count("ws", "too_many_streams") == 1


def test_timeout_before_the_first_audio_is_504_and_aborts_the_engine_request():
    engine = FakeEngine()
    engine.gate.clear()
    with fake_server(ServerSettings(request_timeout_s=0.3), engine) as server, server.client() as client:
        response = client.post("/v1/tts", json=TTS)
        assert_error(response, 504, "deadline_exceeded")
        assert len(engine.aborted) == 1  # the engine iterator was closed, which aborts in a real engine
        assert server.count("tts", "deadline_exceeded") == 1
        assert server.state.admission.num_in_flight == 0


def test_timeout_mid_stream_cuts_raw_audio_and_ends_events_with_an_error():
    engine = FakeEngine(num_chunks=100, chunk_delay_s=0.02)
    with fake_server(ServerSettings(request_timeout_s=0.5), engine) as server, server.client() as client:
        with pytest.raises(httpx.RemoteProtocolError):  # no chunked terminator: the client knows it is cut short
            client.post("/v1/tts", json=TTS)
        lines = client.post("/v1/tts?events=ndjson", json=TTS).text.splitlines()
        assert json.loads(lines[0])["type"] == "audio"
        assert json.loads(lines[-1])["error"]["code"] == "deadline_exceeded"
        assert len(engine.aborted) == 2 and server.count("tts", "deadline_exceeded") == 2


def test_timeout_of_a_websocket_session_is_an_error_event_and_4504():
    engine = FakeEngine()
    engine.gate.clear()
    with fake_server(ServerSettings(request_timeout_s=0.3), engine) as server, \
            connect(server.ws_url + "/v1/tts/stream") as ws:
        ws.send(json.dumps({"type": "start", "voice": "alice", "text": "Text that never ends"}))
        events = [json.loads(ws.recv(timeout=10)) for _ in range(2)]
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
        assert events[1]["error"]["code"] == "deadline_exceeded" and ws.close_code == 4504
        assert engine.aborted == [events[0]["request_id"]]


def test_a_client_that_stops_reading_is_cut_after_the_timeout():
    # one second of audio per chunk and no pauses: the send blocks as soon as the socket buffers are full
    engine = FakeEngine(num_chunks=100_000, samples_per_chunk=24_000)
    with fake_server(ServerSettings(request_timeout_s=0.5), engine) as server:
        body = json.dumps(TTS).encode()
        host, port = server.base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/tts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            t0 = time.monotonic()
            server.wait_until(lambda: server.count("tts", "deadline_exceeded") == 1, timeout_s=10)
        assert time.monotonic() - t0 < 5
        assert len(engine.aborted) == 1 and server.state.admission.num_in_flight == 0
