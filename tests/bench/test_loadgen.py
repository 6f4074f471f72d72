"""The load generator against the fake server of conftest.py, and the arrival schedules with fake senders."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from cosystream.bench.cli import add_bench_parser
from cosystream.bench.clients import (
    HttpClient,
    PcmCounter,
    RequestSpec,
    build_body,
    endpoint_url,
    form_fields,
    ws_messages,
)
from cosystream.bench.loadgen import (
    DEFAULT_RETRY_AFTER_S,
    LevelPlan,
    build_plans,
    run_closed,
    run_level,
    run_open,
)
from cosystream.bench.report import RequestRecord, Timeline

FakeServer = Any  # conftest.FakeServer; conftest modules are not imported by name


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", *argv])
    return args.handler(args)


def write_workload(tmp_path: Path, texts: list[str]) -> Path:
    (tmp_path / "voice.wav").write_bytes(b"RIFF-not-really-a-wav")
    path = tmp_path / "workload.json"
    path.write_text(json.dumps({"texts": texts, "voice": "bench_voice", "prompt_text": "hello there.",
                                "prompt_wav": "voice.wav", "force_tokens": 25}))
    return path


# ---- end to end through the CLI -------------------------------------------------------------------------


def test_tts_target_counts_underruns_and_refusals(fake_server: FakeServer, tmp_path: Path) -> None:
    workload = write_workload(tmp_path, ["fast one.", "slow one.", "busy one."])
    out, plot = tmp_path / "results.json", tmp_path / "results.png"
    status = run_cli("--url", fake_server.url, "--workload", str(workload), "--concurrency", "1,3",
                     "--requests-per-level", "6", "--warmup-requests", "1", "--out", str(out), "--plot", str(plot))
    assert status == 0
    results = json.loads(out.read_text())
    assert results["schema"] == "cosystream-bench/1" and results["meta"]["target"] == "tts"
    for level in results["levels"]:  # requests 0..5 cycle fast, slow, busy
        assert (level["num_requests"], level["num_ok"], level["num_refused"], level["num_errors"]) == (6, 4, 2, 0)
        assert level["underrun_requests"] == 2  # the two slow ones
        assert level["num_wrong_length"] == 2  # slow ones bring 0.2 s; fast ones the forced 25 tokens, 1.0 s
        assert level["first_audio_s"]["p50"] < 1.0 and level["aggregate_rtf"] > 0
    by_text: dict[str, list[dict]] = {}
    for rec in results["requests"]:
        kind = "warmup" if rec["level"] == "warmup" else ["fast", "slow", "busy"][rec["index"] % 3]
        by_text.setdefault(kind, []).append(rec)
    assert all(r["underruns"] == 0 and r["audio_s"] == fake_server.FAST_NUM_SAMPLES / 24000 for r in by_text["fast"])
    assert all(1 <= r["underruns"] <= fake_server.SLOW_PIECES - 1 and r["underrun_s"] > 0 for r in by_text["slow"])
    assert all(r["refused"] and r["status"] == 503 and r["retry_after_s"] == 2.0 for r in by_text["busy"])
    assert len(by_text["warmup"]) == 1
    assert plot.read_bytes()[:4] == b"\x89PNG"

    voices = [r for r in fake_server.requests if r["path"] == "/v1/voices"]
    assert voices and b'name="name"' in voices[-1]["body"] and b"bench_voice" in voices[-1]["body"]
    body = next(r["json"] for r in reversed(fake_server.requests) if r["path"] == "/v1/tts")
    assert body["voice"] == "bench_voice" and body["response_format"] == "pcm" and body["stream"] is True
    assert body["force_tokens"] == 25 and "seed" not in body  # no --seed: the server's own


def test_openai_target_errors_and_wav_header(fake_server: FakeServer, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    status = run_cli("--url", fake_server.url, "--target", "openai", "--voice", "alloy", "--text", "fast.",
                     "--text", "broken.", "--text", "wav fast.", "--requests-per-level", "3",
                     "--warmup-requests", "0", "--out", str(out), "--tag", "commit=abc1234", "--tag", "gpu = H100")
    assert status == 0
    results = json.loads(out.read_text())
    assert results["meta"]["tags"] == {"commit": "abc1234", "gpu": "H100"}
    level = results["levels"][0]
    assert (level["num_ok"], level["num_errors"], level["num_refused"]) == (2, 1, 0)
    fast, broken, wav = sorted(results["requests"], key=lambda r: r["index"])
    assert broken["status"] == 500 and broken["error"].startswith("HTTP 500: internal error")
    assert fast["audio_s"] == wav["audio_s"] == fake_server.FAST_NUM_SAMPLES / 24000  # header bytes are not audio
    body = next(r["json"] for r in reversed(fake_server.requests) if r["path"] == "/v1/audio/speech")
    assert body == {"model": "cosyvoice2", "input": "wav fast.", "response_format": "pcm", "stream": True,
                    "voice": "alloy"}


def test_ws_target(fake_server: FakeServer, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    status = run_cli("--url", fake_server.ws_url, "--target", "ws", "--voice", "v", "--text", "slow.",
                     "--text", "busy.", "--concurrency", "2", "--requests-per-level", "2", "--warmup-requests", "0",
                     "--force-tokens", "5", "--out", str(out))
    assert status == 0
    slow, busy = sorted(json.loads(out.read_text())["requests"], key=lambda r: r["index"])
    assert slow["audio_s"] == fake_server.SLOW_PIECES * 1200 / 24000 and slow["underruns"] >= 1
    assert slow["server"] == {"timings": {"first_audio_s": 0.01}}
    assert busy["refused"] and busy["status"] == 503
    session = next(r for r in reversed(fake_server.requests) if r["path"] == "ws")
    assert [m["type"] for m in session["messages"]] == ["start", "text", "end"]
    assert session["messages"][0]["force_tokens"] == 5 and "text" not in session["messages"][0]


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli("--concurrency", "1") == 2  # no text
    assert "--text" in capsys.readouterr().err
    assert run_cli("--text", "x.", "--concurrency", "0") == 2
    assert run_cli("--text", "x.", "--tag", "no-equals-sign") == 2
    assert "--tag: expected KEY=VALUE, got 'no-equals-sign'" in capsys.readouterr().err


async def test_request_timeout_keeps_partial_audio(fake_server: FakeServer) -> None:
    client = HttpClient(fake_server.url, "tts", RequestSpec(texts=("hang.",)), timeout_s=0.3,
                        origin_s=time.perf_counter())
    try:
        t0 = time.perf_counter()
        rec = await client.send("c=1", 0)
    finally:
        await client.aclose()
    assert time.perf_counter() - t0 < 2.0
    assert rec.error == "timeout after 0.3 s" and rec.first_audio_s is not None and rec.audio_s == 0.1


async def test_each_request_in_flight_has_its_own_kept_alive_connection(fake_server: FakeServer) -> None:
    client = HttpClient(fake_server.url, "tts", RequestSpec(texts=("fast connections.",)), timeout_s=10.0,
                        origin_s=time.perf_counter())

    seen_before = len(fake_server.requests)  # the fake server is shared by the session's tests

    def peers() -> list[tuple]:
        return [r["peer"] for r in fake_server.requests[seen_before:]
                if r.get("json", {}).get("text") == "fast connections."]

    try:
        together = await asyncio.gather(*(client.send("c=4", i) for i in range(4)))
        first = peers()
        for i in range(4):  # one after another: the connections of the first four are reused
            await client.send("c=1", 4 + i)
    finally:
        await client.aclose()
    assert all(r.ok for r in together)
    assert len(first) == 4 and len(set(first)) == 4  # concurrent requests never share a connection
    assert set(peers()[4:]) <= set(first)
    assert not client._idle and not getattr(client, "_all", [])  # aclose closed every connection


async def _closing_keep_alive_server(heads: list[bytes]) -> asyncio.Server:
    """Answers each connection's first request (kept alive) and drops the connection when a second one comes,
    without a byte of response: a server whose idle timeout closed the connection just as the client reused it."""
    pcm = b"\x00\x00" * 2400

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                heads.append(head)
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                if answered:
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: audio/pcm\r\nTransfer-Encoding: chunked\r\n\r\n"
                             + f"{len(pcm):x}\r\n".encode() + pcm + b"\r\n0\r\n\r\n")
                await writer.drain()
                answered = True
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_a_kept_alive_connection_the_server_dropped_is_replaced_once() -> None:
    heads: list[bytes] = []
    server = await _closing_keep_alive_server(heads)
    port = server.sockets[0].getsockname()[1]
    client = HttpClient(f"http://127.0.0.1:{port}", "tts", RequestSpec(texts=("again.",)), timeout_s=5.0,
                        origin_s=time.perf_counter())
    try:
        records = [await client.send("c=1", i) for i in range(3)]
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()
    assert [(r.ok, r.error, r.audio_s) for r in records] == [(True, None, 0.1)] * 3
    assert len(heads) == 5  # the second and third requests went out twice: on the dropped connection, then anew


# ---- request building -----------------------------------------------------------------------------------


def test_endpoint_urls_and_bodies() -> None:
    assert endpoint_url("http://127.0.0.1:8000", "tts") == "http://127.0.0.1:8000/v1/tts"
    assert endpoint_url("127.0.0.1:8000/", "ws") == "ws://127.0.0.1:8000/v1/tts/stream"
    assert endpoint_url("https://api.example.com/v1/audio/speech", "openai") == "https://api.example.com/v1/audio/speech"
    spec = RequestSpec(texts=("a.", "b."), voice="v", force_tokens=10, first_hop=15, seed=3)
    assert build_body("tts", spec, 1) == {"text": "b.", "voice": "v", "mode": "zero_shot", "stream": True,
                                          "response_format": "pcm", "force_tokens": 10, "first_hop": 15, "seed": 3}
    start, text, end = ws_messages(spec, 0)
    assert start["type"] == "start" and "text" not in start and text == {"type": "text", "text": "a."}
    assert end == {"type": "end"}
    assert "force_tokens" not in build_body("tts", RequestSpec(texts=("a.",)), 0)
    assert spec.expected_audio_s == pytest.approx(0.4)


def test_bodies_validate_against_the_server_protocol() -> None:
    protocol = pytest.importorskip("cosystream.server.protocol")
    spec = RequestSpec(texts=("hello.",), voice="v", force_tokens=10, first_hop=15, seed=3, greedy=True)
    assert protocol.TTSRequest.model_validate(build_body("tts", spec, 0)).force_tokens == 10
    start, text, end = ws_messages(spec, 0)
    assert protocol.WsStart.model_validate(start).first_hop == 15
    protocol.WsText.model_validate(text)
    protocol.WsEnd.model_validate(end)
    speech = protocol.SpeechRequest.model_validate(build_body("openai", spec, 0))
    assert (speech.input, speech.response_format.value, speech.seed, speech.force_tokens) == ("hello.", "pcm", 3, 10)


def test_pcm_counter_splits_samples_and_wav_headers() -> None:
    raw = PcmCounter()
    assert [raw.add(b) for b in (b"\x01", b"\x02\x03", b"\x04\x05\x06")] == [0, 1, 2]
    # RIFF header with a LIST chunk before "data" (as ffmpeg writes), fed 7 bytes at a time
    fmt = b"fmt " + (16).to_bytes(4, "little") + b"\x01\x00\x01\x00" + (24000).to_bytes(4, "little") + bytes(8)
    listing = b"LIST" + (3).to_bytes(4, "little") + b"abc\x00"  # odd size: one pad byte
    wav = PcmCounter()
    data = b"RIFF" + bytes(4) + b"WAVE" + fmt + listing + b"data" + bytes(4) + b"\x00" * 10
    assert sum(wav.add(data[i:i + 7]) for i in range(0, len(data), 7)) == 5
    short = PcmCounter()
    assert short.add(b"RI") == 0 and short.add(b"FX") == 2  # not RIFF after all: all four bytes are audio


# ---- arrival schedules ----------------------------------------------------------------------------------


def fake_sender(delay_s: float, in_flight: list[int]):
    origin = time.perf_counter()

    async def send(level: str, index: int) -> RequestRecord:
        timeline = Timeline(level, index, origin)
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        try:
            await asyncio.sleep(delay_s)
            timeline.audio(2400)
        finally:
            in_flight[0] -= 1
        return timeline.finish()

    return send


async def test_closed_loop_keeps_concurrency_and_count() -> None:
    in_flight = [0, 0]
    records, interrupted = await run_closed(fake_sender(0.01, in_flight), LevelPlan("concurrency", 3, 10),
                                            asyncio.Event())
    assert not interrupted and [r.index for r in records] == list(range(10)) and in_flight[1] == 3


async def test_closed_loop_duration_bound() -> None:
    t0 = time.perf_counter()
    records, _ = await run_closed(fake_sender(0.02, [0, 0]), LevelPlan("concurrency", 2, None, 0.1), asyncio.Event())
    assert time.perf_counter() - t0 < 0.5 and 4 <= len(records) <= 14


async def test_a_refused_stream_waits_the_retry_after_before_its_next_request() -> None:
    origin = time.perf_counter()
    sent: list[float] = []

    async def refuse_first_two(level: str, index: int) -> RequestRecord:
        sent.append(time.perf_counter())
        timeline = Timeline(level, index, origin)
        if len(sent) <= 2:
            return timeline.refuse(503, 0.15 if len(sent) == 1 else None)
        await asyncio.sleep(0)
        timeline.audio(2400)
        return timeline.finish()

    records, _ = await run_closed(refuse_first_two, LevelPlan("concurrency", 1, 3), asyncio.Event())
    assert [r.refused for r in records] == [True, True, False]
    assert sent[1] - sent[0] >= 0.15  # the server's Retry-After
    assert sent[2] - sent[1] >= DEFAULT_RETRY_AFTER_S  # none given: the default
    # a level's end cuts the wait short: 1 stream refused every time, 0.3 s of level
    t0 = time.perf_counter()
    records, _ = await run_closed(refuse_all, LevelPlan("concurrency", 1, None, 0.3), asyncio.Event())
    assert time.perf_counter() - t0 < 0.3 + DEFAULT_RETRY_AFTER_S / 2 and len(records) == 1


async def refuse_all(level: str, index: int) -> RequestRecord:
    return Timeline(level, index, time.perf_counter()).refuse(503, 5.0)


async def test_open_loop_poisson_arrivals() -> None:
    records, interrupted = await run_open(fake_sender(0.05, [0, 0]), LevelPlan("rate", 200, 20), asyncio.Event(),
                                          seed=1)
    assert not interrupted and len(records) == 20
    starts = sorted(r.start_s for r in records)
    assert starts[-1] - starts[0] < 1.0  # 20 arrivals at 200/s: ~0.1 s, not a sequential 1 s
    records, _ = await run_open(fake_sender(0.0, [0, 0]), LevelPlan("rate", 50, None, 0.2), asyncio.Event())
    assert 1 <= len(records) <= 40


async def test_stop_event_ends_a_level_at_once() -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.1, stop.set)
    t0 = time.perf_counter()
    records, interrupted = await run_level(fake_sender(10.0, [0, 0]), LevelPlan("concurrency", 4, 8), stop)
    assert interrupted and records == [] and time.perf_counter() - t0 < 1.0
    records, interrupted = await run_level(fake_sender(10.0, [0, 0]), LevelPlan("rate", 1, 5), stop)
    assert interrupted and records == []


def test_default_plans_are_bounded() -> None:
    plans = build_plans([1, 16], [0.5])
    assert [(p.label, p.max_requests) for p in plans] == [("c=1", 8), ("c=16", 64), ("rate=0.5", 15)]
    with pytest.raises(ValueError):
        LevelPlan("concurrency", 2)
    with pytest.raises(ValueError):
        LevelPlan("concurrency", 1.5, 4)


def test_a_prompt_recording_goes_with_every_tts_request(fake_server: FakeServer, tmp_path: Path) -> None:
    """--prompt-wav: zero-shot without a registered voice. Every /v1/tts request is multipart with the
    recording and its transcript; no voice is named or registered."""
    wav = tmp_path / "prompt.wav"
    wav.write_bytes(b"RIFF\x00\x00\x00\x00WAVE-any-bytes")
    workload = write_workload(tmp_path, ["fast one."])
    out = tmp_path / "results.json"
    seen_before = len(fake_server.requests)
    status = run_cli("--url", fake_server.url, "--workload", str(workload), "--prompt-wav", str(wav),
                     "--prompt-text", "hello there.", "--requests-per-level", "2", "--warmup-requests", "0",
                     "--out", str(out))
    assert status == 0
    assert json.loads(out.read_text())["levels"][0]["num_ok"] == 2
    seen = fake_server.requests[seen_before:]
    sent = [r for r in seen if r["path"] == "/v1/tts"]
    assert len(sent) == 2
    assert all(r["form"]["prompt_text"] == "hello there." and "voice" not in r["form"] for r in sent)
    assert all(r["form"]["text"] == "fast one." and r["form"]["stream"] == "true" for r in sent)
    assert all(b'name="prompt_wav"' in r["body"] and wav.read_bytes() in r["body"] for r in sent)
    assert not [r for r in seen if r["path"] == "/v1/voices"]


def test_distinct_prompts_upload_another_recording_of_the_same_length_each_time(
        fake_server: FakeServer, tmp_path: Path) -> None:
    """--distinct-prompts: a content-keyed cache on the server never hits (a caller's voice cloned per call);
    only the recording's last 4 bytes differ, so its length and voice stay the workload's."""
    wav = tmp_path / "prompt.wav"
    wav.write_bytes(b"RIFF\x00\x00\x00\x00WAVE-some-samples-here")
    workload = write_workload(tmp_path, ["fast one."])
    seen_before = len(fake_server.requests)
    status = run_cli("--url", fake_server.url, "--workload", str(workload), "--prompt-wav", str(wav),
                     "--distinct-prompts", "--requests-per-level", "3", "--warmup-requests", "1",
                     "--out", str(tmp_path / "results.json"))
    assert status == 0
    sent = [r for r in fake_server.requests[seen_before:] if r["path"] == "/v1/tts"]
    head = wav.read_bytes()[:-4]
    uploads = [r["body"][r["body"].index(head):r["body"].index(head) + len(head) + 4] for r in sent]
    assert len(uploads) == 4 and len(set(uploads)) == 4


def test_a_prompt_recording_goes_with_every_ws_session(fake_server: FakeServer, tmp_path: Path) -> None:
    """--target ws --prompt-wav: start says prompt_wav: true and the recording follows as a binary frame."""
    wav = tmp_path / "prompt.wav"
    wav.write_bytes(b"RIFF\x00\x00\x00\x00WAVE-other-bytes")
    workload = write_workload(tmp_path, ["fast one."])
    out = tmp_path / "results.json"
    seen_before = len(fake_server.requests)
    status = run_cli("--url", fake_server.ws_url, "--target", "ws", "--workload",
                     str(workload), "--prompt-wav", str(wav), "--prompt-text", "hello there.",
                     "--requests-per-level", "2", "--warmup-requests", "0", "--out", str(out))
    assert status == 0
    assert json.loads(out.read_text())["levels"][0]["num_ok"] == 2
    sent = [r for r in fake_server.requests[seen_before:] if r["path"] == "ws"]
    assert len(sent) == 2 and all(r["prompt"] == wav.read_bytes() for r in sent)
    assert all(r["messages"][0]["prompt_wav"] is True and r["messages"][0]["prompt_text"] == "hello there."
               and "voice" not in r["messages"][0] for r in sent)


@pytest.mark.parametrize(("extra", "message"), [
    (["--target", "openai"], "--target openai names a registered voice"),
    (["--voice", "v"], "give one"),
    (["--prompt-wav", "/nonexistent.wav"], "no such file"),
])
def test_bad_prompt_upload_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str],
                                            message: str) -> None:
    wav = tmp_path / "prompt.wav"
    wav.write_bytes(b"RIFF")
    args = ["--text", "hi.", "--prompt-wav", str(wav), *extra]
    assert run_cli(*args) == 2
    assert message in capsys.readouterr().err
    assert run_cli("--text", "hi.", "--prompt-text", "hello.") == 2
    assert "--prompt-text: goes with --prompt-wav" in capsys.readouterr().err
    assert run_cli("--text", "hi.", "--distinct-prompts") == 2
    assert "--distinct-prompts: goes with --prompt-wav" in capsys.readouterr().err


def test_a_prompt_upload_validates_against_the_server_protocol() -> None:
    protocol = pytest.importorskip("cosystream.server.protocol")
    spec = RequestSpec(texts=("hello.",), force_tokens=10, seed=3, greedy=True, prompt_wav="p.wav",
                       prompt_text="hello there.")
    got = protocol.TTSRequest.model_validate(form_fields(build_body("tts", spec, 0)))
    assert (got.voice, got.prompt_text, got.force_tokens, got.greedy, got.stream) == (None, "hello there.", 10, True,
                                                                                      True)
    start = protocol.WsStart.model_validate(build_body("ws", spec, 0))
    assert (start.voice, start.prompt_wav, start.prompt_text) == (None, True, "hello there.")


def test_the_http_client_refuses_a_url_it_cannot_speak_to() -> None:
    spec = RequestSpec(texts=("x.",))
    with pytest.raises(ValueError, match="--url: expected http"):
        HttpClient("ftp://127.0.0.1:21", "tts", spec, 1.0, 0.0)


async def test_the_http_client_records_a_dead_server_as_an_error(unused_tcp_port: int) -> None:
    client = HttpClient(f"http://127.0.0.1:{unused_tcp_port}", "tts", RequestSpec(texts=("x.",)), 2.0,
                           time.perf_counter())
    rec = await client.send("c=1", 0)
    assert not rec.ok and (rec.error or "").startswith("ConnectionRefusedError")
