"""Hostile input: every malformed, oversized or path-like input is a 4xx naming its field; the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fake_engine import TTS, FakeServer, fake_server
from server_live import VOICE, make_wav, read_ws_events
from test_errors import assert_error
from websockets.exceptions import ConnectionClosed
from websockets.frames import Frame, Opcode
from websockets.sync.client import connect

from cosystream.server.inputs import voice_name_problem
from cosystream.server.state import ServerSettings

JSON = {"content-type": "application/json"}
MAX_AUDIO_S = 2.0
WS_MAX_BYTES, WS_RATE, WS_BURST = 1024, 5.0, 10
SETTINGS = ServerSettings(max_audio_s=MAX_AUDIO_S, ws_max_message_bytes=WS_MAX_BYTES, ws_max_messages_per_s=WS_RATE,
                          ws_message_burst=WS_BURST)
SPEECH = {"input": "Hi.", "voice": "alice"}
NESTED = b'{"text": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    with fake_server(SETTINGS) as s:
        yield s


@pytest.fixture
def client(server: FakeServer):
    with server.client() as c:
        yield c


def raw(body: bytes) -> dict:
    return {"content": body, "headers": JSON}


@pytest.mark.parametrize(("path", "request_kwargs", "status", "code", "field"), [
    ("/v1/audio/speech", {"content": b"Hi.", "headers": {"content-type": "text/plain"}}, 415,
     "unsupported_media_type", None),
    ("/v1/tts", {"content": b"text=Hi.", "headers": {"content-type": "text/csv"}}, 415, "unsupported_media_type", None),
    ("/v1/voices", {"json": {"name": "bob"}}, 415, "unsupported_media_type", None),
    ("/v1/audio/speech", raw(b'{"input": "H\xff\xfei", "voice": "alice"}'), 400, "bad_input", "body"),
    ("/v1/tts", raw(b'{"text": "H\xc3", "voice": "alice"}'), 400, "bad_input", "body"),
    ("/v1/audio/speech", raw(NESTED), 400, "bad_input", "body"),
    ("/v1/tts", raw(NESTED), 400, "bad_input", "body"),
    ("/v1/tts", raw(b'{"text": "Hi.", "voice": "alice", "seed": ' + b"9" * 5000 + b"}"), 400, "bad_input", "body"),
    ("/v1/tts", {"content": b"text=Hi.", "headers": {"content-type": "multipart/form-data"}}, 400, "bad_input",
     "body"),
    ("/v1/tts", {"content": b"--x\r\nContent-Disposition: form-data; name=text\r\n\r\nHi\r\n--x--\r\n",
                 "headers": {"content-type": "multipart/form-data; boundary=y"}}, 400, "bad_input", "body"),
    ("/v1/audio/speech", raw(b'{"input": "Hi.", "voice": "alice", "speed": NaN}'), 400, "bad_input", "speed"),
    ("/v1/tts", raw(b'{"text": "Hi.", "voice": "alice", "tau_r": Infinity}'), 400, "bad_input", "tau_r"),
    ("/v1/tts", raw(b'{"text": "Hi.", "voice": "alice", "top_p": -Infinity}'), 400, "bad_input", "top_p"),
    ("/v1/tts", {"json": {**TTS, "top_k": 10**30}}, 400, "bad_input", "top_k"),
    ("/v1/tts", {"json": {**TTS, "win_size": 2**63}}, 400, "bad_input", "win_size"),
    ("/v1/tts", {"json": {**TTS, "seed": -1}}, 400, "bad_input", "seed"),
    ("/v1/tts", {"json": {**TTS, "first_hop": 1e300}}, 400, "bad_input", "first_hop"),
    ("/v1/audio/speech", {"json": {**SPEECH, "speed": -1}}, 400, "bad_input", "speed"),
    ("/v1/audio/speech", {"json": {**SPEECH, "speed": 0}}, 400, "bad_input", "speed"),
    ("/v1/tts", {"json": {**TTS, "speed": 0, "stream": False}}, 400, "bad_input", "speed"),
    ("/v1/audio/speech", {"json": {**SPEECH, "voice": "../../etc/passwd"}}, 400, "bad_input", "voice"),
    ("/v1/tts", {"json": {**TTS, "voice": "alice\x00"}}, 400, "bad_input", "voice"),
    ("/v1/tts", {"json": {**TTS, "mode": "sft", "sft_speaker": "..\\x"}}, 400, "bad_input", "sft_speaker"),
    ("/v1/tts", {"json": {**TTS, "prompt_text": "x" * 5001}}, 400, "bad_input", "prompt_text"),
    ("/v1/tts", {"json": {**TTS, "mode": "instruct2", "instruct_text": "x" * 5001}}, 400, "bad_input",
     "instruct_text"),
    ("/v1/audio/speech", {"json": {**SPEECH, "instructions": "x" * 5001}}, 400, "bad_input", "instructions"),
])
def test_bad_requests_are_4xx_naming_the_field(client, path, request_kwargs, status, code, field):
    assert_error(client.post(path, **request_kwargs), status, code, field)


@pytest.mark.parametrize("name", ["..", ".", "a\x00b", "a\tb", "x" * 65, "\u202eevil"])
def test_path_like_or_control_voice_names_are_400_at_register_and_lookup(client, name):
    wav = {"prompt_wav": ("p.wav", make_wav(seconds=1.0), "audio/wav")}
    assert_error(client.post("/v1/voices", data={"name": name, "prompt_text": "x"}, files=wav), 400, "bad_input",
                 "name")
    quoted = "".join(f"%{byte:02X}" for byte in name.encode())  # so the client sends the name as it is
    assert_error(client.get(f"/v1/voices/{quoted}"), 400, "bad_input", "name")
    assert_error(client.delete(f"/v1/voices/{quoted}"), 400, "bad_input", "name")


def test_a_slash_in_a_voice_name_never_reaches_the_voice_routes(client):
    assert_error(client.get("/v1/voices/a%2Fb"), 404, "not_found")  # the path has one segment too many
    assert voice_name_problem("a/b") is not None and voice_name_problem("中文女") is None  # sft speakers stay usable


def test_uploads_longer_than_the_audio_limit_are_400_before_decoding(server, client):
    long_wav = make_wav(seconds=MAX_AUDIO_S + 1, sample_rate=8000)
    error = assert_error(client.post("/v1/tts", data={"text": "Hi.", "prompt_text": "x"},
                                     files={"prompt_wav": ("p.wav", long_wav, "audio/wav")}), 400, "bad_input",
                         "prompt_wav")
    assert "3.0 s" in error["message"]
    assert_error(client.post("/v1/tts", data={"mode": "vc", "voice": "alice"},
                             files={"source_wav": ("s.wav", long_wav, "audio/wav")}), 400, "bad_input", "source_wav")
    assert_error(client.post("/v1/voices", data={"name": "long", "prompt_text": "x"},
                             files={"prompt_wav": ("p.wav", long_wav, "audio/wav")}), 400, "bad_input", "prompt_wav")
    assert "long" not in server.engine.voices
    ok = client.post("/v1/voices", data={"name": "short", "prompt_text": "x"},
                     files={"prompt_wav": ("p.wav", make_wav(seconds=MAX_AUDIO_S - 1), "audio/wav")})
    assert ok.status_code == 201, ok.text


def ws_exchange(server: FakeServer, frames: list[str | bytes | Frame]) -> tuple[list[dict], int | None]:
    """Send the frames (a Frame goes out as it is, even if invalid), then read events until the server closes.
    The server may close while frames are still going out (a rate limit trips mid-burst): the events it
    sent before closing are read all the same."""
    events = []
    with connect(server.ws_url + "/v1/tts/stream", max_size=None) as ws:
        try:
            for frame in frames:
                if isinstance(frame, Frame):
                    with ws.send_context():
                        ws.protocol.send_frame(frame)
                else:
                    ws.send(frame)
        except ConnectionClosed:
            pass
        events += read_ws_events(ws)
    return events, ws.close_code


START = json.dumps({"type": "start", "voice": "alice"})


@pytest.mark.parametrize(("frames", "close_code", "code", "field"), [
    ([json.dumps({"type": "start", "voice": "alice", "text": "x" * WS_MAX_BYTES})], 4413, "payload_too_large",
     "message"),
    ([START, b"\x00" * (WS_MAX_BYTES + 1)], 4413, "payload_too_large", "message"),
    ([START] + [json.dumps({"type": "text", "text": ""})] * (2 * WS_BURST), 4429, "rate_limited", "message"),
    ([json.dumps({"type": "start", "voice": "../x"})], 4400, "bad_input", "voice"),
    ([json.dumps({"type": "start", "voice": "alice", "speed": -1})], 4400, "bad_input", "speed"),
    (['{"type": "start", "voice": "alice", "tau_r": NaN}'], 4400, "bad_input", "tau_r"),
    (["[" * 1000], 4400, "bad_input", "message"),
    (['{"type": {"start": 1}}'], 4400, "bad_input", "type"),
])
def test_websocket_limits_are_an_error_event_then_4xxx(server, frames, close_code, code, field):
    events, got_close_code = ws_exchange(server, frames)
    assert events[-1]["type"] == "error", events
    assert (events[-1]["error"]["code"], events[-1]["error"]["field"], got_close_code) == (code, field, close_code)


def test_invalid_utf8_in_a_websocket_text_frame_closes_only_that_connection(server):
    events, close_code = ws_exchange(server, [Frame(Opcode.TEXT, b'{"type": "start", "voice": "\xff"}')])
    assert close_code == 1007 and events == []  # the protocol layer refuses it: "invalid frame payload data"
    assert ws_exchange(server, [json.dumps({"type": "start", "voice": "alice", "text": "Hi."}),
                                json.dumps({"type": "end"})])[1] == 1000


def test_the_server_still_serves_after_all_of_it(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.post("/v1/tts", json=TTS).status_code == 200


def test_a_sentence_too_long_for_the_model_context_is_400_on_the_real_engine(client_live):
    # within the text limit, but one sentence without punctuation: more positions than the LM holds
    response = client_live.post("/v1/tts", json={"text": "a" * 4999, "voice": VOICE, "response_format": "pcm"})
    assert_error(response, 400, "bad_input", "text")


@pytest.fixture
def client_live(live):
    with live.client() as c:
        yield c
