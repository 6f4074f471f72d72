"""OpenAI clients: voice names mapped by `serve --default-voice / --voice-alias`, and GET /v1/models."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from fake_engine import FakeEngine, FakeVoice, fake_server

from cosystream.cli import build_parser
from cosystream.errors import UnknownVoice
from cosystream.outputs import AudioChunk
from cosystream.params import SynthesisParams
from cosystream.server.cli import settings_from_args
from cosystream.server.errors import to_api_error
from cosystream.server.state import ServerSettings


@dataclass
class VoiceRecordingEngine(FakeEngine):
    """The fake engine, noting which voice every request reached it with."""

    voices_used: list[str | None] = field(default_factory=list)

    async def synthesize(self, params: SynthesisParams) -> AsyncIterator[AudioChunk]:
        self.voices_used.append(params.voice)
        async for chunk in super().synthesize(params):
            yield chunk


def _speech(voice: str) -> dict:
    return {"model": "cosyvoice2", "input": "Hello.", "voice": voice, "response_format": "pcm"}


def test_aliases_and_the_default_voice_map_openai_names_to_registered_voices():
    engine = VoiceRecordingEngine()
    engine.voices["bob"] = FakeVoice("bob", "hi")
    engine.voices["nova"] = FakeVoice("nova", "hi")  # a registered voice wins over the default
    settings = ServerSettings(default_voice="alice", voice_aliases=(("echo", "bob"), ("narrator", "bob")))
    with fake_server(settings, engine) as server, server.client() as client:
        for voice in ("alloy", "shimmer", "echo", "narrator", "nova", "bob"):
            response = client.post("/v1/audio/speech", json=_speech(voice))
            assert response.status_code == 200, (voice, response.text)
        typo = client.post("/v1/audio/speech", json=_speech("alise"))
    assert engine.voices_used == ["alice", "alice", "bob", "bob", "nova", "bob", "alise"]
    assert typo.status_code == 400 and typo.json()["error"]["code"] == "unknown_voice"  # never the default
    assert "GET /v1/voices" in typo.json()["error"]["message"]


def test_the_unknown_voice_hint_names_the_http_route_not_the_cli(tmp_path):
    from cosystream.engine.voices import VoiceStore

    with pytest.raises(UnknownVoice) as info:  # the voice store's own message, which points CLI users
        VoiceStore(str(tmp_path / "voices.db")).get("x")
    error = to_api_error(info.value)
    assert error.message == "voice: no voice named 'x' (GET /v1/voices lists the registered voices)"
    assert error.code == "unknown_voice" and error.field == "voice"


def test_an_openai_name_without_a_mapping_says_how_to_map_it():
    engine = VoiceRecordingEngine()
    with fake_server(ServerSettings(), engine) as server, server.client() as client:
        response = client.post("/v1/audio/speech", json=_speech("alloy"))
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "unknown_voice" and error["field"] == "voice"
    assert "--default-voice" in error["message"] and "GET /v1/voices" in error["message"]
    assert engine.voices_used == []  # refused before the engine


def test_an_alias_to_a_voice_that_is_gone_is_an_unknown_voice():
    with fake_server(ServerSettings(voice_aliases=(("alloy", "deleted"),))) as server, server.client() as client:
        response = client.post("/v1/audio/speech", json=_speech("alloy"))
    assert response.status_code == 400 and response.json()["error"]["code"] == "unknown_voice"
    assert "'deleted'" in response.json()["error"]["message"]


def test_serve_flags_set_the_voice_mapping():
    args = build_parser().parse_args(["serve", "--model-dir", "m", "--default-voice", "alice",
                                      "--voice-alias", "alloy=bob", "--voice-alias", " echo = carol "])
    settings = settings_from_args(args, environ={})
    assert settings.default_voice == "alice"
    assert settings.voice_aliases == (("alloy", "bob"), ("echo", "carol"))
    for bad in ("alloy", "=bob", "alloy="):
        with pytest.raises(ValueError, match="--voice-alias"):
            settings_from_args(build_parser().parse_args(["serve", "--model-dir", "m", "--voice-alias", bad]),
                               environ={})


def test_models_list_and_retrieve_in_openai_shape():
    with fake_server(ServerSettings(model_id="FunAudioLLM/CosyVoice2-0.5B")) as server, server.client() as client:
        listed = client.get("/v1/models")
        one = client.get("/v1/models/FunAudioLLM/CosyVoice2-0.5B")
        by_family = client.get("/v1/models/cosyvoice2")
        missing = client.get("/v1/models/gpt-4o-mini-tts")
    assert listed.status_code == 200
    body = listed.json()
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    assert card["id"] == "FunAudioLLM/CosyVoice2-0.5B" and card["object"] == "model"
    assert card["family"] == "cosyvoice2" and isinstance(card["created"], int) and card["owned_by"]
    assert one.status_code == 200 and one.json() == card
    assert by_family.status_code == 200 and by_family.json() == card
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_the_openai_sdk_lists_the_model():
    openai = pytest.importorskip("openai")
    with fake_server(ServerSettings(model_id="my-model")) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        assert [m.id for m in client.models.list()] == ["my-model"]
        assert client.models.retrieve("my-model").id == "my-model"
