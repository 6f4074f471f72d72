"""`cosystream bench` reads each request's stage times back from our server after the level (GET
/v1/requests/{id}) and prints where first audio goes: against the real app around the server tests' fake
engine, whose stage times are set here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from fake_engine import FakeEngine, fake_server  # noqa: E402
from test_loadgen import run_cli  # noqa: E402

from cosystream.outputs import StageTimes  # noqa: E402
from cosystream.server.state import ServerSettings  # noqa: E402

TIMES = StageTimes(queue_s=0.001, frontend_s=0.002, llm_prefill_s=0.003, first_token_s=0.004,
                   first_chunk_ready_s=0.02, first_chunk_start_s=0.021, first_chunk_flow_s=0.015,
                   first_chunk_vocoder_s=0.003, first_audio_s=0.04, total_s=0.5, num_tokens=2, audio_s=0.08)


def _bench(url: str, tmp_path: Path, target: str, capsys) -> tuple[list[dict], str]:
    out = tmp_path / "run.json"
    code = run_cli("--url", url, "--target", target, "--voice", "alice", "--text", "Hello there.",
                   "--concurrency", "2", "--requests-per-level", "4", "--warmup-requests", "1",
                   "--out", str(out))
    assert code == 0
    records = [r for r in json.loads(out.read_text())["requests"] if r["level"] == "c=2"]
    assert len(records) == 4 and all(r["error"] is None for r in records)
    return records, capsys.readouterr().out


@pytest.mark.parametrize("target", ["tts", "openai"])
def test_every_request_gets_the_server_s_stage_times(tmp_path: Path, capsys, target: str) -> None:
    with fake_server(ServerSettings(), FakeEngine(times=TIMES)) as server:
        records, printed = _bench(server.base_url, tmp_path, target, capsys)
    for record in records:
        got = record["server"]
        assert got["request_id"].startswith("req_") and got["outcome"] == "ok"
        assert got["first_chunk_flow_s"] == TIMES.first_chunk_flow_s and got["first_audio_s"] == TIMES.first_audio_s
        assert got["server_first_audio_s"] > 0 and got["to_engine_s"] >= 0
    assert len({r["server"]["request_id"] for r in records}) == 4
    assert "where first audio goes" in printed and "| sent, from arrival |" in printed  # the server's own share
    row = next(line for line in printed.splitlines() if line.startswith("| c=2, all |"))
    assert row.split("|")[7].strip() == "15"  # the flow column: the engine's 15 ms, as the server reported it


def test_requests_the_server_no_longer_keeps_stay_without_times(tmp_path: Path, capsys) -> None:
    with fake_server(ServerSettings(requests_kept=1), FakeEngine(times=TIMES)) as server:
        records, _ = _bench(server.base_url, tmp_path, "tts", capsys)
    kept = [r for r in records if "first_audio_s" in r["server"]]
    assert len(kept) == 1 and kept[0]["server"]["first_audio_s"] == TIMES.first_audio_s  # the one it still holds
    dropped = [r for r in records if r not in kept]
    assert all(set(r["server"]) == {"request_id"} for r in dropped)  # a 404 for each: asked, nothing to fill


def test_the_websocket_done_event_s_stage_times_make_the_breakdown(tmp_path: Path, capsys) -> None:
    with fake_server(ServerSettings(), FakeEngine(times=TIMES)) as server:
        records, printed = _bench(server.base_url, tmp_path, "ws", capsys)
    assert all(r["server"]["first_chunk_flow_s"] == TIMES.first_chunk_flow_s for r in records)
    row = next(line for line in printed.splitlines() if line.startswith("| c=2, all |"))
    assert row.split("|")[7].strip() == "15"
