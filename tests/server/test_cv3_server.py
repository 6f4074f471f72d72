"""The server on a CosyVoice3 model (the CV3 fixture model behind uvicorn): native and OpenAI speech, voice
registration, WebSocket text in, the model card, and a voice registered on a CosyVoice2 model refused by name.

Requests use `force_tokens`: N speech tokens → 960·N samples.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from server_live import START_TIMEOUT_S, VOICE_TEXT, Live, decode, make_wav, run_server
from websockets.sync.client import connect

from cosystream.server.app import build_app
from cosystream.server.state import ServerSettings

SAMPLES_PER_TOKEN = 960
VOICE = "carol"
TEXT = "Hello there, how are you today?"


@pytest.fixture(scope="module")
def live_cv3(cv3_model_dir, tmp_path_factory) -> Iterator[Live]:
    from cosystream.engine.async_engine import AsyncEngine

    voices_db = tmp_path_factory.mktemp("cv3_server_voices") / "voices.db"
    engine = AsyncEngine.from_pretrained(cv3_model_dir, device="cpu", voices_db=str(voices_db), max_streams=4)
    app = build_app(engine, ServerSettings())
    try:
        with run_server(app) as base_url:
            live = Live(base_url, app, engine)
            assert live.state.ready_event.wait(START_TIMEOUT_S) and live.state.is_ready
            with live.client() as client:
                response = client.post("/v1/voices", data={"name": VOICE, "prompt_text": VOICE_TEXT},
                                       files={"prompt_wav": ("carol.wav", make_wav(seed=3), "audio/wav")})
                assert response.status_code == 201, response.text
            yield live
    finally:
        engine.close()


def test_the_model_card_names_the_family(live_cv3):
    with live_cv3.client() as client:
        card = client.get("/v1/models").json()["data"][0]
        assert card["family"] == "cosyvoice3"
        assert client.get("/v1/models/cosyvoice3").json() == card


def test_voices_list_their_family(live_cv3):
    with live_cv3.client() as client:
        listed = {v["name"]: v for v in client.get("/v1/voices").json()["voices"]}
        assert listed[VOICE]["family"] == "cosyvoice3"
        assert client.get(f"/v1/voices/{VOICE}").json()["family"] == "cosyvoice3"


@pytest.mark.parametrize("body", [
    {"voice": VOICE},  # zero-shot
    {"voice": VOICE, "mode": "cross_lingual"},
    {"voice": VOICE, "mode": "instruct2", "instruct_text": "Speak slowly."},
])
def test_native_tts_in_each_mode(live_cv3, body):
    with live_cv3.client() as client:
        response = client.post("/v1/tts", json={"text": TEXT, "force_tokens": 30, "response_format": "pcm", **body})
    assert response.status_code == 200, response.text
    assert decode(response.content, "pcm").shape == (30 * SAMPLES_PER_TOKEN,)


def test_voice_conversion(live_cv3):
    with live_cv3.client() as client:
        response = client.post("/v1/tts", data={"mode": "vc", "voice": VOICE, "response_format": "wav"},
                               files={"source_wav": ("src.wav", make_wav(seconds=1.0, seed=5), "audio/wav")})
    assert response.status_code == 200, response.text
    assert decode(response.content, "wav").shape[0] > 0


def test_openai_speech(live_cv3):
    with live_cv3.client() as client:
        response = client.post("/v1/audio/speech", json={"model": "cosyvoice3", "input": TEXT, "voice": VOICE,
                                                         "response_format": "wav", "force_tokens": 12})
    assert response.status_code == 200, response.text
    assert decode(response.content, "wav").shape == (12 * SAMPLES_PER_TOKEN,)


def test_websocket_text_in_audio_out(live_cv3):
    start = {"type": "start", "voice": VOICE, "response_format": "pcm", "seed": 0, "force_tokens": 40}
    pieces = [{"type": "text", "text": piece} for piece in ("Hello ", "there, how ", "are you today?")]
    events, frames = [], []
    with connect(live_cv3.ws_url + "/v1/tts/stream", open_timeout=30) as ws:
        for message in [start, *pieces, {"type": "end"}]:
            ws.send(json.dumps(message))
        for data in ws:
            if isinstance(data, bytes):
                frames.append(data)
            else:
                events.append(json.loads(data))
        close_code = ws.close_code
    assert close_code == 1000 and events[-1]["type"] == "done", events[-1]
    assert len(frames) >= 2  # 40 tokens: more than one chunk
    assert decode(b"".join(frames), "pcm").shape == (40 * SAMPLES_PER_TOKEN,)


def test_a_voice_registered_on_cosyvoice2_is_refused_with_its_name(live_cv3):
    import dataclasses

    engine = live_cv3.engine
    cv2_prompt = dataclasses.replace(engine.voice_prompt(VOICE), family="cosyvoice2")
    engine.voices.add("dave", cv2_prompt, "registered with a CosyVoice2 model")
    with live_cv3.client() as client:
        response = client.post("/v1/tts", json={"text": TEXT, "voice": "dave", "force_tokens": 5})
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "'dave' was registered with a cosyvoice2 model" in message and "cosyvoice3" in message
        again = client.post("/v1/tts", json={"text": TEXT, "voice": VOICE, "force_tokens": 5,
                                             "response_format": "pcm"})
    assert again.status_code == 200 and decode(again.content, "pcm").shape == (5 * SAMPLES_PER_TOKEN,)
