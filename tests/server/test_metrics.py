"""GET /metrics and /health on the live server: counters, stage histograms and engine gauges move as documented."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_live import VOICE

STAGES = ("queue", "frontend", "llm_prefill", "first_token", "first_chunk_ready", "first_chunk_start",
          "first_chunk_flow", "first_chunk_vocoder", "first_audio", "total")


def scrape(client) -> dict[tuple[str, tuple], float]:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_finished_request_moves_every_series(client):
    before = scrape(client)
    response = client.post("/v1/tts", json={"text": "Hi there.", "voice": VOICE, "force_tokens": 5,
                                            "response_format": "pcm"})
    assert response.status_code == 200
    after = scrape(client)
    assert value(after, "cosystream_requests_total", endpoint="tts", outcome="ok") == \
        value(before, "cosystream_requests_total", endpoint="tts", outcome="ok") + 1
    for stage in STAGES:
        assert value(after, "cosystream_stage_seconds_count", stage=stage) == \
            value(before, "cosystream_stage_seconds_count", stage=stage) + 1
    assert value(after, "cosystream_first_audio_seconds_count", endpoint="tts") == \
        value(before, "cosystream_first_audio_seconds_count", endpoint="tts") + 1
    assert value(after, "cosystream_rtf_count") == value(before, "cosystream_rtf_count") + 1
    assert value(after, "cosystream_audio_seconds_total") - value(before, "cosystream_audio_seconds_total") == \
        pytest.approx(5 / 25)
    assert value(after, "cosystream_active_streams", endpoint="tts") == 0
    assert ("cosystream_engine_num_active", ()) in after and ("cosystream_engine_queue_depth", ()) in after
    # the scheduler's counters are there from the start (admission is off in this server: nothing refused)
    assert ("cosystream_admission_total", (("decision", "refused"),)) in after
    assert value(after, "cosystream_admission_total", decision="refused") == 0


def test_rejected_requests_are_counted_by_code(client):
    before = scrape(client)
    assert client.post("/v1/audio/speech", json={"model": "x", "input": "", "voice": VOICE}).status_code == 400
    assert client.post("/v1/tts", json={"text": "Hi.", "voice": "nobody"}).status_code == 400
    after = scrape(client)
    for endpoint, code in (("speech", "bad_input"), ("tts", "unknown_voice")):
        assert value(after, "cosystream_requests_total", endpoint=endpoint, outcome=code) == \
            value(before, "cosystream_requests_total", endpoint=endpoint, outcome=code) + 1


def test_health_and_ready(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"status": "ok"}


def test_openapi_documents_every_endpoint_and_message(client):
    schema = client.get("/openapi.json").json()
    assert {"/v1/audio/speech", "/v1/tts", "/v1/tts/stream", "/v1/voices", "/v1/voices/{name}", "/health", "/ready",
            "/metrics"} <= set(schema["paths"])
    models = {"SpeechRequest", "TTSRequest", "TTSUpload", "ErrorResponse", "DoneEvent", "AudioEvent", "WsStart",
              "WsText", "WsEnd", "ChunkEvent", "StartedEvent", "Voice", "VoiceList"}
    assert models <= set(schema["components"]["schemas"])
    tts_body = schema["paths"]["/v1/tts"]["post"]["requestBody"]["content"]
    assert {"application/json", "multipart/form-data"} <= set(tts_body)
    assert "422" not in schema["paths"]["/v1/audio/speech"]["post"]["responses"]



def test_engine_stat_keys_become_metric_name_safe_and_only_numbers_count():
    """Gauge names are built from the keys: prometheus_client versions differ in what they do with other
    characters, so the keys are made safe first; flags and text are not gauges."""
    from cosystream.server.metrics import engine_stats

    class Engine:
        def stats(self) -> dict:
            return {"decode_slow_step_seconds_in_message add": 0.5, "a-b.c": 2, "ok_key": 1.0, "flag": True,
                    "name": "x"}

    assert engine_stats(Engine()) == {"decode_slow_step_seconds_in_message_add": 0.5, "a_b_c": 2.0, "ok_key": 1.0}


def test_scheduler_counters_carry_kind_and_stage_labels():
    from cosystream.server.metrics import ServerMetrics

    class Engine:
        def stats(self) -> dict:
            return {"deadline_misses_first_lm": 2.0, "deadline_miss_seconds_first_lm": 0.3,
                    "deadline_misses_later_token2wav": 1.0, "deadline_miss_seconds_later_token2wav": 0.05,
                    "admission_admitted": 7.0, "admission_refused": 3.0, "admission_refused_debt": 1.0,
                    "admission_refused_budget": 2.0, "admission_refused_deadlines": 0.0,
                    "first_audio_predicted_seconds": 1.5,
                    "first_audio_measured_seconds": 1.8, "first_audio_predictions": 7.0}

    text = ServerMetrics(Engine()).render().decode()
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(text) for sample in family.samples}
    assert value(samples, "cosystream_deadline_misses_total", kind="first", stage="lm") == 2
    assert value(samples, "cosystream_deadline_miss_seconds_total", kind="later", stage="token2wav") == 0.05
    assert value(samples, "cosystream_admission_total", decision="refused") == 3
    assert value(samples, "cosystream_admission_refusals_total", rule="debt") == 1
    assert value(samples, "cosystream_admission_refusals_total", rule="budget") == 2
    assert value(samples, "cosystream_admission_refusals_total", rule="deadlines") == 0
    assert value(samples, "cosystream_first_audio_measured_seconds_total") == 1.8
    assert value(samples, "cosystream_first_audio_predictions_total") == 7


def test_each_admitted_request_s_prediction_error_is_observed():
    from cosystream.outputs import StageTimes
    from cosystream.server.metrics import ServerMetrics

    class Engine:
        def stats(self) -> dict:
            return {}

    metrics = ServerMetrics(Engine())
    metrics.observe_done("tts", StageTimes(first_audio_s=0.30, total_s=1.0, audio_s=2.0,
                                           predicted_first_audio_s=0.22), 0.31)
    metrics.observe_done("tts", StageTimes(first_audio_s=0.10, total_s=1.0, audio_s=2.0,
                                           predicted_first_audio_s=0.17), 0.11)
    metrics.observe_done("tts", StageTimes(first_audio_s=0.10, total_s=1.0, audio_s=2.0), 0.11)  # no prediction
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(metrics.render().decode())
               for sample in family.samples}
    assert value(samples, "cosystream_first_audio_prediction_error_seconds_count") == 2
    # one optimistic by 0.08 s, one pessimistic by 0.07 s
    assert value(samples, "cosystream_first_audio_prediction_error_seconds_bucket", le="-0.1") == 0
    assert value(samples, "cosystream_first_audio_prediction_error_seconds_bucket", le="-0.05") == 1
    assert value(samples, "cosystream_first_audio_prediction_error_seconds_bucket", le="0.05") == 1
    assert value(samples, "cosystream_first_audio_prediction_error_seconds_bucket", le="0.1") == 2
