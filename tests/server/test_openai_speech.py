"""POST /v1/audio/speech through the unmodified OpenAI SDK and plain httpx, on the live server."""

from __future__ import annotations

import base64
import json

import openai
import pytest
from server_live import SAMPLES_PER_TOKEN, VOICE, decode

TEXT = "Hello world."


@pytest.fixture
def sdk(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_sdk_create_returns_a_complete_wav(sdk):
    speech = sdk.audio.speech.create(model="cosyvoice2", voice=VOICE, input=TEXT, response_format="wav",
                                     extra_body={"force_tokens": 6})
    audio = decode(speech.content, "wav")
    assert audio.shape == (6 * SAMPLES_PER_TOKEN,)


def test_sdk_streaming_response_delivers_pcm_as_it_is_produced(sdk):
    pieces = []
    with sdk.audio.speech.with_streaming_response.create(
            model="tts-1", voice=VOICE, input=TEXT, response_format="pcm",
            extra_body={"force_tokens": 30}) as response:
        assert response.headers["content-type"] == "audio/pcm"
        assert response.headers["x-request-id"].startswith("req_")
        pieces = [piece for piece in response.iter_bytes() if piece]
    # force_tokens 30 streams in more than one engine chunk; the bytes add up to the exact length
    assert decode(b"".join(pieces), "pcm").shape == (30 * SAMPLES_PER_TOKEN,)


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "opus"])
def test_every_format_decodes_to_the_expected_length(client, fmt):
    num_tokens = 30  # more than one chunk, so the streaming encoders are exercised
    response = client.post("/v1/audio/speech", json={"model": "x", "input": TEXT, "voice": VOICE,
                                                     "response_format": fmt, "force_tokens": num_tokens})
    assert response.status_code == 200, response.text
    audio = decode(response.content, fmt)
    expected = num_tokens * SAMPLES_PER_TOKEN
    if fmt == "mp3":  # MPEG frames pad the ends (encoder delay + last frame)
        assert expected <= audio.shape[0] <= expected + 3 * 1152
    else:
        assert audio.shape == (expected,)


def test_speed_renders_offline_and_changes_the_length(client):
    response = client.post("/v1/audio/speech", json={"model": "x", "input": TEXT, "voice": VOICE,
                                                     "response_format": "wav", "speed": 2.0, "force_tokens": 10})
    assert response.status_code == 200, response.text
    num_samples = decode(response.content, "wav").shape[0]
    assert abs(num_samples - 10 * SAMPLES_PER_TOKEN / 2) <= SAMPLES_PER_TOKEN


def test_instructions_select_instruct2(client):
    response = client.post("/v1/audio/speech", json={"model": "x", "input": TEXT, "voice": VOICE,
                                                     "instructions": "Speak happily.", "response_format": "pcm",
                                                     "force_tokens": 4})
    assert response.status_code == 200, response.text
    assert decode(response.content, "pcm").shape == (4 * SAMPLES_PER_TOKEN,)


def test_sse_stream_format_gives_openai_events(client):
    response = client.post("/v1/audio/speech", json={"model": "x", "input": TEXT, "voice": VOICE,
                                                     "response_format": "pcm", "stream_format": "sse",
                                                     "force_tokens": 5})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] == 5
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert decode(pcm, "pcm").shape == (5 * SAMPLES_PER_TOKEN,)


def test_sdk_surfaces_our_error_shape(sdk):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.audio.speech.create(model="x", voice="nobody", input=TEXT)
    assert info.value.status_code == 400
    assert info.value.body == {"code": "unknown_voice", "message": info.value.body["message"], "field": "voice"}
