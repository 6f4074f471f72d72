"""docs/server.md runs as written: its Python blocks are examples/*.py (run here against the live server)
and its ```bash blocks run in a shell with the live server's address ("```shell" blocks are not run)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from server_live import VOICE, decode, make_wav

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "server.md"
EXAMPLES = sorted((REPO / "examples").glob("*_client.py"))
DOC_URL = "http://localhost:8000"
RUN_TIMEOUT_S = 120


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_is_in_the_doc_verbatim(example):
    assert example.read_text() in blocks("python")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_against_the_live_server(live, example, tmp_path):
    base_url = live.ws_url if example.name.startswith("ws_") else live.base_url
    out = tmp_path / ("reply.wav" if example.name.startswith("ws_") else "hello.wav")
    result = subprocess.run([sys.executable, str(example), "--base-url", base_url, "--voice", VOICE, "--out", str(out)],
                            capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert decode(out.read_bytes(), "wav").shape[0] > 0


def test_the_ws_example_speaks_in_an_uploaded_recording(live, tmp_path):
    (tmp_path / "anna.wav").write_bytes(make_wav(seed=11))
    out = tmp_path / "reply.wav"
    result = subprocess.run([sys.executable, str(REPO / "examples" / "ws_client.py"), "--base-url", live.ws_url,
                             "--prompt-wav", str(tmp_path / "anna.wav"), "--prompt-text", "Anna speaking.",
                             "--out", str(out)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert decode(out.read_bytes(), "wav").shape[0] > 0


def test_curl_examples_run_against_the_live_server(live, tmp_path):
    (tmp_path / "anna.wav").write_bytes(make_wav(seed=11))
    script = "set -euo pipefail\n" + "\n".join(blocks("bash")).replace(DOC_URL, live.base_url)
    script += f"\ncurl -sS --fail-with-body -X DELETE {live.base_url}/v1/voices/anna\n"  # leave the store as found
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr
    assert decode((tmp_path / "hello.wav").read_bytes(), "wav").shape[0] > 0
    assert decode((tmp_path / "again.mp3").read_bytes(), "mp3").shape[0] > 0
    assert decode((tmp_path / "slow.wav").read_bytes(), "wav").shape[0] > 0
    assert '"type":"done"' in result.stdout
