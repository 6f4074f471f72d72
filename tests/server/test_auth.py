"""API keys (bearer tokens, WebSocket query key), exempt probes, CORS, and the `serve` flags that set them."""

from __future__ import annotations

import json

import pytest
from fake_engine import TTS, FakeEngine, Held, fake_server
from server_live import read_ws_events
from test_errors import assert_error
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from cosystream.cli import build_parser
from cosystream.server.cli import DEFAULT_FIRST_AUDIO_BUDGET_S, engine_kwargs_from_args, settings_from_args
from cosystream.server.state import ServerSettings

KEY, OTHER_KEY = "sk-test-1", "sk-test-2"
ORIGIN = "https://app.example.com"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def ws_events(url: str, headers: dict | None = None) -> tuple[list[dict], int | None]:
    """Run one short WebSocket request; the JSON events and the close code."""
    events = []
    with connect(url, additional_headers=headers) as ws:
        try:
            ws.send(json.dumps({"type": "start", "voice": "alice", "text": "Hi."}))
            ws.send(json.dumps({"type": "end"}))
        except ConnectionClosed:
            pass  # refused already: the error event is still to be read
        events += read_ws_events(ws)
    return events, ws.close_code


def test_http_needs_a_configured_bearer_token_except_on_the_probes():
    settings = ServerSettings(api_keys=frozenset({KEY, OTHER_KEY}))
    with fake_server(settings) as server, server.client() as client:
        response = client.post("/v1/tts", json=TTS)
        assert_error(response, 401, "unauthorized", "Authorization")
        assert response.headers["www-authenticate"] == "Bearer"
        assert "unknown" in assert_error(client.post("/v1/tts", json=TTS, headers=bearer("sk-wrong")), 401,
                                         "unauthorized", "Authorization")["message"]
        assert_error(client.get("/v1/voices", headers={"Authorization": f"Basic {KEY}"}), 401, "unauthorized",
                     "Authorization")
        assert client.post("/v1/tts", json=TTS, headers=bearer(KEY)).status_code == 200
        assert client.get("/v1/voices", headers=bearer(OTHER_KEY)).status_code == 200
        assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200
        assert_error(client.get("/metrics"), 401, "unauthorized", "Authorization")
        metrics = client.get("/metrics", headers=bearer(KEY)).text
        assert "cosystream_unauthorized_total 4.0" in metrics
        assert 'cosystream_requests_total{endpoint="tts",outcome="unauthorized"} 2.0' in metrics
        schema = client.get("/openapi.json", headers=bearer(KEY)).json()
        assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        assert schema["paths"]["/v1/tts"]["post"]["security"] == [{"bearer": []}]
        assert "security" not in schema["paths"]["/health"]["get"]


def test_exempt_paths_are_configurable():
    settings = ServerSettings(api_keys=frozenset({KEY}), auth_exempt_paths=("/metrics",))
    with fake_server(settings) as server, server.client() as client:
        assert client.get("/metrics").status_code == 200
        assert_error(client.get("/health"), 401, "unauthorized", "Authorization")


def test_websocket_takes_the_key_as_header_or_query_and_refuses_with_4401():
    with fake_server(ServerSettings(api_keys=frozenset({KEY}))) as server:
        url = server.ws_url + "/v1/tts/stream"
        events, close_code = ws_events(url)
        assert close_code == 4401 and events == [{"type": "error", "error": {
            "code": "unauthorized", "message": "Authorization: missing bearer token", "field": "Authorization"}}]
        assert ws_events(url + "?api_key=sk-wrong")[1] == 4401
        for events, close_code in (ws_events(url + f"?api_key={KEY}"), ws_events(url, headers=bearer(KEY))):
            assert close_code == 1000 and [e["type"] for e in events] == ["started", "chunk", "chunk", "done"]


def test_per_client_limit_counts_per_api_key_not_per_address():
    engine = FakeEngine()
    settings = ServerSettings(api_keys=frozenset({KEY, OTHER_KEY}), max_streams_per_client=1)
    with fake_server(settings, engine) as server, server.client() as client:
        engine.gate.clear()
        held = Held(server, headers=bearer(KEY))
        server.wait_until(lambda: engine.num_waiting == 1)
        assert_error(client.post("/v1/tts", json=TTS, headers=bearer(KEY)), 429, "too_many_streams")
        other = Held(server, headers=bearer(OTHER_KEY))  # the same address with another key is admitted
        server.wait_until(lambda: engine.num_waiting == 2)
        engine.gate.set()
        assert held.join().status_code == 200 and other.join().status_code == 200


def test_cors_is_off_by_default_and_answers_configured_origins_only():
    with fake_server(ServerSettings()) as server, server.client() as client:
        assert "access-control-allow-origin" not in client.get("/health", headers={"Origin": ORIGIN}).headers
    settings = ServerSettings(cors_origins=(ORIGIN,), api_keys=frozenset({KEY}))
    with fake_server(settings) as server, server.client() as client:
        preflight = client.options("/v1/tts", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                                      "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.status_code == 200  # answered without a key: browsers never send one on a preflight
        assert preflight.headers["access-control-allow-origin"] == ORIGIN
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        response = client.post("/v1/tts", json=TTS, headers={"Origin": ORIGIN, **bearer(KEY)})
        assert response.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in response.headers["access-control-expose-headers"].lower()
        refused = client.post("/v1/tts", json=TTS, headers={"Origin": ORIGIN})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
        other = client.get("/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_serve_flags_and_environment_build_the_settings(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("sk-file\n\n")
    args = build_parser().parse_args([
        "serve", "--model-dir", "m", "--api-key", "sk-flag", "--api-keys-file", str(keys_file),
        "--first-audio-budget-s", "1.5", "--max-streams-per-client", "3", "--request-timeout-s", "0",
        "--cors-origin", ORIGIN, "--auth-exempt", "/health", "--auth-exempt", "/metrics", "--max-audio-s", "12",
        "--ws-max-message-kb", "8", "--ws-max-messages-per-s", "20"])
    settings = settings_from_args(args, environ={"COSYSTREAM_API_KEYS": "sk-env1, sk-env2"})
    assert settings.api_keys == {"sk-flag", "sk-file", "sk-env1", "sk-env2"}
    assert engine_kwargs_from_args(args)["first_audio_budget_s"] == 1.5 and settings.max_streams_per_client == 3
    assert settings.request_timeout_s is None  # 0 turns the timeout off
    assert settings.cors_origins == (ORIGIN,) and settings.auth_exempt_paths == ("/health", "/metrics")
    assert (settings.max_audio_s, settings.ws_max_message_bytes, settings.ws_max_messages_per_s) == (12, 8192, 20)
    default_args = build_parser().parse_args(["serve", "--model-dir", "m"])
    assert settings_from_args(default_args, environ={}) == ServerSettings()  # the flags' defaults: auth, CORS off
    assert engine_kwargs_from_args(default_args) == {"first_audio_budget_s": DEFAULT_FIRST_AUDIO_BUDGET_S}
    for off in ("0", "off"):
        args = build_parser().parse_args(["serve", "--model-dir", "m", "--first-audio-budget-s", off])
        assert engine_kwargs_from_args(args)["first_audio_budget_s"] is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model-dir", "m", "--first-audio-budget-s", "-1"])
