"""POST /v1/tts (JSON, multipart, event streams, every mode) and /v1/voices CRUD on the live server."""

from __future__ import annotations

import base64
import json
import struct

import pytest
from server_live import SAMPLES_PER_TOKEN, VOICE, decode, make_wav

TEXT = "Hello world."
STAGES = ("queue_s", "frontend_s", "llm_prefill_s", "first_token_s", "first_chunk_ready_s", "first_chunk_start_s",
          "first_chunk_flow_s", "first_chunk_vocoder_s", "first_audio_s", "total_s")


def ndjson(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line]


def sse(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


def joined_audio(events: list[dict]) -> bytes:
    return b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "audio")


def test_json_request_streams_exact_wav(client):
    response = client.post("/v1/tts", json={"text": TEXT, "voice": VOICE, "force_tokens": 7})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "audio/wav"
    assert response.headers["x-request-id"].startswith("req_")
    assert decode(response.content, "wav").shape == (7 * SAMPLES_PER_TOKEN,)


def test_multipart_prompt_upload_with_sampling_settings_and_ndjson_events(client):
    form = {"text": TEXT, "prompt_text": "A transcript of the prompt.", "response_format": "pcm", "force_tokens": "40",
            "first_hop": "25", "top_p": "0.7", "top_k": "20", "win_size": "8", "tau_r": "0.2", "seed": "7"}
    response = client.post("/v1/tts?events=ndjson", data=form,
                           files={"prompt_wav": ("p.wav", make_wav(seed=3), "audio/wav")})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    events = ndjson(response.text)
    audio_events, done = events[:-1], events[-1]
    assert len(audio_events) > 1  # 40 tokens: two chunks, each sent as it was ready
    assert [e["index"] for e in audio_events] == list(range(len(audio_events)))
    assert decode(joined_audio(events), "pcm").shape == (40 * SAMPLES_PER_TOKEN,)
    assert done["type"] == "done" and done["num_samples"] == 40 * SAMPLES_PER_TOKEN
    assert done["num_chunks"] == len(audio_events) and done["times"]["num_tokens"] == 40
    assert all(done["times"][stage] >= 0 for stage in STAGES) and done["server_first_audio_s"] > 0


def test_accept_event_stream_gives_sse_with_the_stage_breakdown(client):
    response = client.post("/v1/tts", json={"text": TEXT, "voice": VOICE, "force_tokens": 5, "response_format": "wav"},
                           headers={"Accept": "text/event-stream"})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse(response.text)
    assert events[-1]["type"] == "done" and set(STAGES) <= set(events[-1]["times"])
    assert decode(joined_audio(events), "wav").shape == (5 * SAMPLES_PER_TOKEN,)


@pytest.mark.parametrize("extra", [{"mode": "cross_lingual"}, {"mode": "instruct2", "instruct_text": "Speak slowly."},
                                   {"greedy": True}, {"stream": False}, {"stream": False, "speed": 1.5}])
def test_modes_and_settings(client, extra):
    response = client.post("/v1/tts", json={"text": TEXT, "voice": VOICE, "force_tokens": 6, "response_format": "pcm",
                                            **extra})
    assert response.status_code == 200, response.text
    num_samples = decode(response.content, "pcm").shape[0]
    expected = 6 * SAMPLES_PER_TOKEN / extra.get("speed", 1.0)
    assert abs(num_samples - expected) <= (SAMPLES_PER_TOKEN if "speed" in extra else 0)


def test_non_streaming_wav_has_exact_header_sizes(client):
    response = client.post("/v1/tts", json={"text": TEXT, "voice": VOICE, "force_tokens": 3, "stream": False})
    riff_size, = struct.unpack("<I", response.content[4:8])
    data_size, = struct.unpack("<I", response.content[40:44])
    assert data_size == 3 * SAMPLES_PER_TOKEN * 2 and riff_size == 36 + data_size == len(response.content) - 8


def test_voice_conversion_of_an_uploaded_source(client):
    response = client.post("/v1/tts", data={"mode": "vc", "voice": VOICE, "response_format": "wav"},
                           files={"source_wav": ("src.wav", make_wav(seconds=1.0, seed=5), "audio/wav")})
    assert response.status_code == 200, response.text
    assert decode(response.content, "wav").shape[0] > 0


def test_same_seed_same_audio(client):
    body = {"text": TEXT, "voice": VOICE, "force_tokens": 4, "response_format": "pcm", "seed": 1234}
    assert client.post("/v1/tts", json=body).content == client.post("/v1/tts", json=body).content


# ---------------------------------------------------------------- voices

def test_voice_lifecycle(client):
    created = client.post("/v1/voices", data={"name": "bob", "prompt_text": "Bob speaking."},
                          files={"prompt_wav": ("bob.wav", make_wav(seed=9), "audio/wav")})
    assert created.status_code == 201, created.text
    assert created.json()["name"] == "bob" and created.json()["num_prompt_tokens"] > 0
    assert client.get("/v1/voices/bob").json()["prompt_text"] == "Bob speaking."
    listed = {v["name"]: v for v in client.get("/v1/voices").json()["voices"]}
    assert {"alice", "bob"} <= set(listed)
    # each voice names the family whose frontend analysed it: this server's model's
    family = client.get("/v1/models").json()["data"][0]["family"]
    assert listed["bob"]["family"] == created.json()["family"] == family
    assert client.get("/v1/voices/bob").json()["family"] == family
    spoken = client.post("/v1/tts", json={"text": TEXT, "voice": "bob", "force_tokens": 2, "response_format": "pcm"})
    assert decode(spoken.content, "pcm").shape == (2 * SAMPLES_PER_TOKEN,)
    duplicate = client.post("/v1/voices", data={"name": "bob", "prompt_text": "again"},
                            files={"prompt_wav": ("bob.wav", make_wav(seed=9), "audio/wav")})
    assert duplicate.status_code == 409 and duplicate.json()["error"]["code"] == "voice_exists"
    assert client.delete("/v1/voices/bob").status_code == 204
    missing = client.get("/v1/voices/bob")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_voice"
    assert client.delete("/v1/voices/bob").status_code == 404


def test_failed_registration_leaves_existing_voices_intact(client):
    before = client.get(f"/v1/voices/{VOICE}").json()
    broken = client.post("/v1/voices", data={"name": VOICE, "prompt_text": "replaced?"},
                         files={"prompt_wav": ("x.wav", b"not audio at all", "audio/wav")})
    assert broken.status_code in (400, 409) and "error" in broken.json()
    assert client.get(f"/v1/voices/{VOICE}").json() == before
    spoken = client.post("/v1/tts", json={"text": TEXT, "voice": VOICE, "force_tokens": 2, "response_format": "pcm"})
    assert spoken.status_code == 200


def test_audio_arrives_while_the_engine_is_still_working(live, client):
    body = {"text": TEXT, "voice": VOICE, "force_tokens": 300, "response_format": "pcm"}
    with client.stream("POST", "/v1/tts", json=body) as response:
        pieces = response.iter_raw()
        first = next(pieces)
        assert live.engine.core.num_active == 1  # streamed: the request is still being synthesised
        rest = b"".join(pieces)
    assert decode(first + rest, "pcm").shape == (300 * SAMPLES_PER_TOKEN,)


def test_request_log_line_has_the_engine_stage_breakdown(client, caplog):
    with caplog.at_level("INFO", logger="cosystream.server"):
        response = client.post("/v1/tts", json={"text": TEXT, "voice": VOICE, "force_tokens": 5,
                                                "response_format": "pcm"})
    assert response.status_code == 200
    rid = response.headers["x-request-id"]
    lines = [r.getMessage() for r in caplog.records if "event=request_done" in r.getMessage() and rid in r.getMessage()]
    assert len(lines) == 1
    fields = dict(part.split("=", 1) for part in lines[0].split())
    assert fields["outcome"] == "ok"
    for stage in STAGES:
        assert float(fields[f"engine_{stage}"]) >= 0
    # the server counts first audio from the request's arrival, the engine from its submission
    assert float(fields["first_audio_s"]) >= float(fields["engine_first_audio_s"]) > 0
    assert 0 <= float(fields["to_engine_s"]) <= float(fields["first_audio_s"]) - float(fields["engine_first_audio_s"])


def test_a_finished_request_s_stage_times_are_read_back_by_its_id(client):
    response = client.post("/v1/tts", json={"text": TEXT, "voice": VOICE, "force_tokens": 6, "response_format": "pcm"})
    assert response.status_code == 200
    rid = response.headers["x-request-id"]
    record = client.get(f"/v1/requests/{rid}")
    assert record.status_code == 200, record.text
    got = record.json()
    assert got["request_id"] == rid and got["endpoint"] == "tts" and got["outcome"] == "ok"
    assert got["audio_s"] == pytest.approx(6 * SAMPLES_PER_TOKEN / 24000)
    assert got["num_chunks"] >= 1 and got["times"]["num_tokens"] == 6
    assert all(got["times"][stage] >= 0 for stage in STAGES)
    # the server's own share: arrival -> engine, then the engine's first audio, then sending it
    assert got["server_first_audio_s"] >= got["times"]["first_audio_s"] > 0
    assert 0 <= got["to_engine_s"] <= got["server_first_audio_s"] - got["times"]["first_audio_s"]
    assert got["server_total_s"] >= got["server_first_audio_s"]


def test_an_unknown_request_id_is_a_404_naming_it(client):
    response = client.get("/v1/requests/req_0000000000000000")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "request_not_found" and error["field"] == "request_id"
    assert "req_0000000000000000" in error["message"]
