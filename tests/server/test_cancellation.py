"""Every way a client can leave (HTTP disconnect, WebSocket close, WebSocket idle timeout) frees everything
the request held in the engine: its accounts return to what they were before the request.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import httpx
import pytest
from server_live import VOICE, Live
from websockets.sync.client import connect

from cosystream.engine.accounting import take_accounts

RECV_TIMEOUT_S = 60
LONG = 2000  # forced speech tokens: far more than is ever read before hanging up
TEXT = "Hello there, this is a test."


def _held(live: Live, baseline) -> dict:
    """What the engine holds beyond the baseline once the abort had time to arrive (threads vary with
    uvicorn's worker pool, so they are left to the soak, which bounds them over minutes)."""
    deadline = time.monotonic() + 30
    while True:
        growth = take_accounts(live.engine).growth(baseline)
        growth.pop("num_threads", None)
        if not growth or time.monotonic() > deadline:
            return growth
        time.sleep(0.05)


@pytest.fixture
def baseline(live: Live):
    """Accounts after one finished request in the voice: its prompt caches are kept on purpose."""
    with live.client() as client:
        client.post("/v1/audio/speech", json={"model": "cosyvoice2", "input": TEXT, "voice": VOICE,
                                              "response_format": "pcm", "force_tokens": 3}).raise_for_status()
    assert live.engine_idle()
    return take_accounts(live.engine)


def _hang_up_on_http(live: Live, path: str, body: dict) -> None:
    with live.client() as client, client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert next(response.iter_raw())  # the first audio arrived; now the client goes away


def _hang_up_on_ws(live: Live, start: dict) -> None:
    with connect(live.ws_url + "/v1/tts/stream", open_timeout=RECV_TIMEOUT_S) as ws:
        ws.send(json.dumps(start))  # no "end": the request cannot finish before the socket closes
        assert json.loads(ws.recv(timeout=RECV_TIMEOUT_S))["type"] == "started"
        assert isinstance(ws.recv(timeout=RECV_TIMEOUT_S), bytes)


SCENARIOS: dict[str, Callable[[Live], None]] = {
    "tts": lambda live: _hang_up_on_http(live, "/v1/tts", {"text": TEXT, "voice": VOICE, "force_tokens": LONG,
                                                            "response_format": "pcm"}),
    "tts_events": lambda live: _hang_up_on_http(live, "/v1/tts?events=sse", {"text": TEXT, "voice": VOICE,
                                                                               "force_tokens": LONG}),
    "speech": lambda live: _hang_up_on_http(live, "/v1/audio/speech", {
        "model": "cosyvoice2", "input": TEXT, "voice": VOICE, "response_format": "pcm", "force_tokens": LONG}),
    "ws": lambda live: _hang_up_on_ws(live, {"type": "start", "voice": VOICE, "response_format": "pcm",
                                             "seed": 0, "text": TEXT * 4}),
}


@pytest.mark.parametrize("leave", list(SCENARIOS))
def test_a_client_that_leaves_frees_everything(live, baseline, leave):
    SCENARIOS[leave](live)
    assert _held(live, baseline) == {}


@pytest.fixture
def short_ws_timeout(live: Live) -> Iterator[None]:
    settings = live.state.settings
    live.state.settings = replace(settings, ws_idle_timeout_s=1.0)
    yield
    live.state.settings = settings


def test_a_silent_websocket_times_out_and_its_parked_lm_row_is_freed(live, baseline, short_ws_timeout):
    with connect(live.ws_url + "/v1/tts/stream", open_timeout=RECV_TIMEOUT_S) as ws:
        ws.send(json.dumps({"type": "start", "voice": VOICE, "response_format": "pcm", "seed": 0}))
        ws.send(json.dumps({"type": "text", "text": "the text stops here, "}))
        events = []
        while not events or events[-1].get("type") != "error":
            message = ws.recv(timeout=RECV_TIMEOUT_S)
            if isinstance(message, str):
                events.append(json.loads(message))
    assert events[-1]["error"]["code"] == "timeout"
    assert _held(live, baseline) == {}
    with live.client() as client:  # the freed slot serves the next request
        ok = client.post("/v1/audio/speech", json={"model": "cosyvoice2", "input": TEXT, "voice": VOICE,
                                                   "response_format": "pcm", "force_tokens": 3})
    assert ok.status_code == 200 and len(ok.content) == 2 * 3 * 960


def test_abort_through_the_engine_ends_the_http_stream(live, baseline):
    """A request aborted in the engine by someone other than its client (e.g. a timeout) ends the client's
    stream instead of leaving it waiting; the client sees a cut-short transfer."""
    with live.client() as client, client.stream("POST", "/v1/tts", json={
            "text": TEXT, "voice": VOICE, "force_tokens": LONG, "response_format": "pcm"}) as response:
        request_id = response.headers["x-request-id"]
        chunks = response.iter_raw()
        assert next(chunks)
        live.engine.core.abort(request_id)
        with pytest.raises(httpx.RemoteProtocolError):
            for _ in chunks:
                pass
    assert _held(live, baseline) == {}
