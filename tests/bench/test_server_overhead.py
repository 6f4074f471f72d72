"""benchmarks/server_overhead.py runs end to end (a real server around the fake engine, in a child process) and
reports a per-request CPU time and admission delay that are positive numbers."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "server_overhead.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_overhead_reports_cpu_and_admission() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--streams", "3", "--waves", "4", "--http", "h11",
                          "--loop", "asyncio", "--port", str(_free_port())],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    m = re.search(r"streams=3 waves=4: last request at the engine p50 ([\d.]+) / p90 ([\d.]+) ms .*"
                  r"server CPU ([\d.]+) ms per request", out)
    assert m, out
    p50, p90, cpu = map(float, m.groups())
    assert 0 < p50 <= p90 and cpu > 0
