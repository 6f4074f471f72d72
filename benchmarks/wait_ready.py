"""Wait until the local `cosystream serve` answers GET /ready with 200 (up to 300 s), for the HTTP benchmark
scripts: `python3 benchmarks/wait_ready.py [URL] [--pid PID] [--log FILE]`; exits 1 if it never does, at once
when the server process PID has exited (printing the end of its log FILE): a server that failed to start
(e.g. a missing package on the device) costs seconds of device time, not the whole wait."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import httpx


def exited(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    """A child that exited but was not reaped yet (the shell that started it is waiting on us)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False


def log_tail(path: str | None, lines: int = 20) -> str:
    if path is None:
        return ""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"({path}: {e.strerror})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", default="http://127.0.0.1:8000")
    parser.add_argument("--pid", type=int, default=None, help="the server's process id: stop waiting if it exits")
    parser.add_argument("--log", default=None, help="the server's log, shown if it exits or never gets ready")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    url = args.url.rstrip("/") + "/ready"
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return 0
        except httpx.HTTPError:
            pass
        if exited(args.pid):
            print(f"{url}: the server (pid {args.pid}) exited before it was ready\n{log_tail(args.log)}",
                  file=sys.stderr)
            return 1
        time.sleep(0.5)
    print(f"{url}: not ready after {args.timeout:.0f} s\n{log_tail(args.log)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
