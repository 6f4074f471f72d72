"""Live-server fixtures: the real engine on the tiny fixture model behind uvicorn on 127.0.0.1.

One server per session (the engine loads once); tests talk to it over real HTTP and WebSocket.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from server_live import START_TIMEOUT_S, UPLOAD_LIMIT_BYTES, VOICE, VOICE_TEXT, Live, make_wav, run_server

from cosystream.server.app import build_app
from cosystream.server.state import ServerSettings


@pytest.fixture(scope="session")
def live(model_dir, tmp_path_factory) -> Iterator[Live]:
    from cosystream.engine.async_engine import AsyncEngine

    voices_db = tmp_path_factory.mktemp("server_voices") / "voices.db"
    engine = AsyncEngine.from_pretrained(model_dir, voices_db=str(voices_db), max_streams=8)
    app = build_app(engine, ServerSettings(max_upload_bytes=UPLOAD_LIMIT_BYTES))
    with run_server(app) as base_url:
        live = Live(base_url, app, engine)
        assert live.state.ready_event.wait(START_TIMEOUT_S) and live.state.is_ready
        with live.client() as client:
            response = client.post("/v1/voices", data={"name": VOICE, "prompt_text": VOICE_TEXT},
                                   files={"prompt_wav": ("alice.wav", make_wav(), "audio/wav")})
            assert response.status_code == 201, response.text
        yield live


@pytest.fixture
def client(live: Live) -> Iterator[httpx.Client]:
    with live.client() as c:
        yield c
