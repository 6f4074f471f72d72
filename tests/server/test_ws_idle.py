"""The WebSocket idle timeout: idle means no message from the client *and* nothing left to send.

A fake engine paces its chunks, so a synthesis outlives a short idle timeout after the client's `end`.
"""

from __future__ import annotations

import json

from fake_engine import FakeEngine, fake_server
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from cosystream.server.state import ServerSettings

IDLE_S = 0.3
RECV_TIMEOUT_S = 30


def _session(url: str, messages: list[dict]) -> tuple[list[dict], int, int | None]:
    """Send the messages, then read until the server closes: (events, binary frames, close code)."""
    events: list[dict] = []
    num_frames = 0
    with connect(url, open_timeout=RECV_TIMEOUT_S) as ws:
        for message in messages:
            ws.send(json.dumps(message))
        try:
            while True:
                data = ws.recv(timeout=RECV_TIMEOUT_S)
                if isinstance(data, bytes):
                    num_frames += 1
                else:
                    events.append(json.loads(data))
        except ConnectionClosed:
            pass
        return events, num_frames, ws.close_code


def test_audio_still_flowing_after_end_outlasts_the_idle_timeout():
    engine = FakeEngine(num_chunks=8, chunk_delay_s=IDLE_S / 2)  # 4 idle timeouts of audio after `end`
    with fake_server(ServerSettings(ws_idle_timeout_s=IDLE_S), engine) as server:
        start = {"type": "start", "voice": "alice", "text": "Hello there.", "response_format": "pcm"}
        events, num_frames, close_code = _session(server.ws_url + "/v1/tts/stream", [start, {"type": "end"}])
    assert [e["type"] for e in events] == ["started"] + ["chunk"] * 8 + ["done"]
    assert num_frames == 8 and close_code == 1000


def test_a_client_silent_before_end_still_times_out():
    with fake_server(ServerSettings(ws_idle_timeout_s=IDLE_S)) as server:
        start = {"type": "start", "voice": "alice", "text": "Hello, ", "response_format": "pcm"}
        events, num_frames, close_code = _session(server.ws_url + "/v1/tts/stream", [start])
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "timeout"
    assert num_frames == 0 and close_code == 4408
