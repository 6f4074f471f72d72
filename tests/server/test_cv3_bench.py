"""The benchmarks on a random tiny CosyVoice3 model (`cosystream make-random-model --family cosyvoice3`):
`cosystream bench` against a server running it, and benchmarks/bench_engine.py in-process, with forced
lengths (N speech tokens → 960·N samples; the reports count a request of another length as wrong)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_live import START_TIMEOUT_S, Live, make_wav, run_server

from cosystream.server.app import build_app
from cosystream.server.state import ServerSettings

REPO = Path(__file__).resolve().parents[2]
FORCED = 20

# writing the random model and loading an engine on it take ~25 s on a 2-core CPU (CI runs slow tests)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def random_cv3(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("random_cv3") / "model"
    subprocess.run([sys.executable, "-m", "cosystream.cli", "make-random-model", str(out), "--family", "cosyvoice3",
                    "--seed", "5"], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def live_random_cv3(random_cv3, tmp_path_factory) -> Iterator[Live]:
    from cosystream.engine.async_engine import AsyncEngine

    voices_db = tmp_path_factory.mktemp("bench_voices") / "voices.db"
    engine = AsyncEngine.from_pretrained(random_cv3, device="cpu", voices_db=str(voices_db), max_streams=4)
    try:
        app = build_app(engine, ServerSettings())
        with run_server(app) as base_url:
            live = Live(base_url, app, engine)
            assert live.state.ready_event.wait(START_TIMEOUT_S) and live.state.is_ready
            yield live
    finally:
        engine.close()


def test_cosystream_bench_against_a_cosyvoice3_server(live_random_cv3, tmp_path):
    with live_random_cv3.client() as client:
        assert client.get("/v1/models").json()["data"][0]["family"] == "cosyvoice3"
        response = client.post("/v1/voices", data={"name": "bench", "prompt_text": "The sun rose slowly."},
                               files={"prompt_wav": ("b.wav", make_wav(seed=7), "audio/wav")})
        assert response.status_code == 201, response.text
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "cosystream.cli", "bench", "--url", live_random_cv3.base_url,
                          "--target", "tts", "--voice", "bench", "--text", "A quiet river flows past the mill.",
                          "--force-tokens", str(FORCED), "--concurrency", "1,2", "--requests-per-level", "2",
                          "--warmup-requests", "0", "--model", "cosyvoice3", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    levels = json.loads(out.read_text())["levels"]
    assert [level["level"] for level in levels] == ["c=1", "c=2"]
    for level in levels:
        assert (level["num_ok"], level["num_errors"], level["num_wrong_length"]) == (2, 0, 0), level


async def test_bench_engine_on_a_cosyvoice3_engine(live_random_cv3, tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        bench_engine = importlib.import_module("bench_engine")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    args = bench_engine.build_parser().parse_args(
        ["--model-dir", "unused", "--concurrency", "1,2", "--requests-per-level", "2", "--warmup-requests", "0",
         "--force-tokens", str(FORCED)])
    wav = tmp_path / "voice.wav"
    wav.write_bytes(make_wav(seed=9))
    records, summaries = await bench_engine.run(live_random_cv3.engine, args, wav)
    assert [s.level for s in summaries] == ["c=1", "c=2"]
    for s in summaries:
        assert (s.num_requests, s.num_ok, s.num_errors, s.num_wrong_length) == (2, 2, 0, 0)
    assert all(r.audio_s == FORCED / 25 for r in records if r.ok)
