"""WS /v1/tts/stream on the live server: text pieces in, binary audio + JSON events out, cancel on close."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from server_live import SAMPLES_PER_TOKEN, VOICE, decode, make_wav
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

RECV_TIMEOUT_S = 60
PIECES = [{"type": "text", "text": piece} for piece in ("Hello ", "there, how ", "are you today?")]


def run_session(url: str, messages: list[dict | bytes]) -> tuple[list[dict], list[bytes], int | None]:
    """Send every message (bytes as a binary frame), then collect events and binary frames until the server
    closes."""
    events: list[dict] = []
    frames: list[bytes] = []
    with connect(url, open_timeout=RECV_TIMEOUT_S) as ws:
        try:
            for message in messages:
                ws.send(message if isinstance(message, bytes) else json.dumps(message))
        except ConnectionClosed:
            pass  # the server ended the session before the client said everything: what it sent is read below
        try:
            while True:
                data = ws.recv(timeout=RECV_TIMEOUT_S)
                if isinstance(data, bytes):
                    frames.append(data)
                else:
                    events.append(json.loads(data))
        except ConnectionClosed:
            pass
        return events, frames, ws.close_code


def test_text_pieces_in_audio_out(live):
    start = {"type": "start", "voice": VOICE, "response_format": "pcm", "seed": 0, "force_tokens": 40}
    events, frames, close_code = run_session(live.ws_url + "/v1/tts/stream", [start, *PIECES, {"type": "end"}])
    assert close_code == 1000
    assert events[0]["type"] == "started" and events[0]["sample_rate"] == 24000
    chunks = [e for e in events if e["type"] == "chunk"]
    assert len(chunks) == len(frames) >= 2  # 40 tokens: more than one chunk, each sent when ready
    assert [c["num_bytes"] for c in chunks] == [len(f) for f in frames]
    assert [c["index"] for c in chunks] == list(range(len(chunks)))
    done = events[-1]
    assert done["type"] == "done" and done["request_id"] == events[0]["request_id"]
    num_samples = decode(b"".join(frames), "pcm").shape[0]
    assert num_samples == done["num_samples"] == SAMPLES_PER_TOKEN * done["times"]["num_tokens"] == 40 * 960
    assert done["times"]["total_s"] > 0


def test_whole_text_in_start_and_wav_frames(live):
    start = {"type": "start", "voice": VOICE, "force_tokens": 5, "response_format": "wav", "text": "Just this."}
    events, frames, close_code = run_session(live.ws_url + "/v1/tts/stream", [start, {"type": "end"}])
    assert close_code == 1000 and events[-1]["type"] == "done"
    assert decode(b"".join(frames), "wav").shape == (5 * SAMPLES_PER_TOKEN,)


@pytest.mark.parametrize(("messages", "code", "field"), [
    ([{"type": "text", "text": "hi"}], "bad_input", "type"),
    ([{"type": "start", "voice": VOICE, "top_k": 0}], "bad_input", "top_k"),
    ([{"type": "start", "voice": VOICE, "no_such_knob": 1}], "bad_input", "no_such_knob"),
    ([{"type": "start", "voice": VOICE}, {"type": "end"}], "bad_input", "text"),
    ([{"type": "start", "voice": "nobody", "text": "Hi."}, {"type": "end"}], "unknown_voice", "voice"),
    ([{"type": "start", "voice": VOICE, "mode": "vc"}], "bad_input", "mode"),
])
def test_errors_are_an_event_then_a_4xxx_close(live, messages, code, field):
    events, frames, close_code = run_session(live.ws_url + "/v1/tts/stream", messages)
    error = events[-1]
    assert error["type"] == "error" and error["error"]["code"] == code and error["error"]["field"] == field
    assert close_code == 4400 and frames == []


def test_invalid_json_is_rejected(live):
    with connect(live.ws_url + "/v1/tts/stream") as ws:
        ws.send("{not json")
        error = json.loads(ws.recv(timeout=RECV_TIMEOUT_S))
        assert error["error"]["code"] == "bad_input" and error["error"]["field"] == "message"


def test_closing_the_socket_cancels_the_request(live, monkeypatch):
    aborted: list[str] = []
    abort_seen = threading.Event()
    original_abort = live.engine.core.abort

    def abort(request_id: str) -> None:
        aborted.append(request_id)
        abort_seen.set()
        original_abort(request_id)

    monkeypatch.setattr(live.engine.core, "abort", abort)
    cancelled_before = live.count("ws", "cancelled")
    with connect(live.ws_url + "/v1/tts/stream") as ws:
        # the text never ends, so the request cannot finish before we hang up
        ws.send(json.dumps({"type": "start", "voice": VOICE, "response_format": "pcm", "seed": 0,
                            "text": "A long text that would take a while to say. " * 4}))
        started = json.loads(ws.recv(timeout=RECV_TIMEOUT_S))
        assert isinstance(ws.recv(timeout=RECV_TIMEOUT_S), bytes)  # the first chunk, then we hang up
    assert abort_seen.wait(RECV_TIMEOUT_S)
    assert aborted == [started["request_id"]]
    assert live.engine_idle()
    assert live.count("ws", "cancelled") == cancelled_before + 1


def test_zero_shot_with_the_prompt_recording_sent_after_start(live):
    """prompt_wav: true in start, the recording as the next (binary) message: the request speaks in the voice
    of that recording and transcript (the engine holds their analysis, keyed by content, equal to analysing
    them directly). Audio is not compared with a registered voice's: with text streamed in, when the pieces
    reach the LM moves its numbers, and the tiny random model's greedy tokens flip on such differences."""
    from cosystream.engine.async_engine import _upload_key

    recording, transcript = make_wav(seed=11), "Carol speaking."
    start = {"type": "start", "prompt_wav": True, "prompt_text": transcript, "response_format": "pcm", "seed": 0,
             "force_tokens": 30}
    events, frames, close_code = run_session(live.ws_url + "/v1/tts/stream",
                                             [start, recording, *PIECES, {"type": "end"}])
    assert close_code == 1000 and events[-1]["type"] == "done", events[-1]
    assert decode(b"".join(frames), "pcm").shape == (30 * SAMPLES_PER_TOKEN,)
    held = live.engine._uploads[_upload_key(recording, transcript)]
    want = live.engine.frontend.make_voice_prompt(recording, transcript)
    for name in ("prompt_speech_tokens", "prompt_text_ids", "prompt_mel", "xvector"):
        assert torch.equal(getattr(held, name), getattr(want, name)), name


@pytest.mark.parametrize(("after_start", "status", "code", "message"), [
    ({"type": "text", "text": "hi"}, 4400, "bad_input", "prompt_wav: expected a binary message"),
    (b"not audio at all", 4400, "bad_input", "prompt_wav"),
    (make_wav(seconds=31.0, seed=2), 4400, "bad_input", "more than the limit of 30 s"),
])
def test_a_bad_prompt_recording_is_an_error_event(live, after_start, status, code, message):
    start = {"type": "start", "prompt_wav": True, "prompt_text": "Hi.", "force_tokens": 5}
    events, frames, close_code = run_session(live.ws_url + "/v1/tts/stream", [start, after_start])
    error = events[-1]
    assert error["type"] == "error" and error["error"]["code"] == code and message in error["error"]["message"]
    assert close_code == status and frames == []


@pytest.mark.parametrize(("tokens", "first_hop"), [(1, None), (2, None), (6, 1)])
def test_a_stream_of_a_few_tokens_or_a_tiny_first_hop_is_whole(live, tokens, first_hop):
    start = {"type": "start", "voice": VOICE, "force_tokens": tokens, "response_format": "pcm", "text": "Hi."}
    if first_hop is not None:
        start["first_hop"] = first_hop
    events, frames, close_code = run_session(live.ws_url + "/v1/tts/stream", [start, {"type": "end"}])
    assert close_code == 1000 and events[-1]["type"] == "done", events[-1]
    assert decode(b"".join(frames), "pcm").shape == (tokens * SAMPLES_PER_TOKEN,)
