"""Wait until the local `cosystream serve` answers GET /ready with 200 (up to 300 s), for the HTTP benchmark
scripts: `python3 benchmarks/wait_ready.py [URL]`; exits 1 if it never does."""

from __future__ import annotations

import sys
import time

import httpx


def main() -> int:
    url = (sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000").rstrip("/") + "/ready"
    for _ in range(300):
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return 0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    print(f"{url}: not ready after 300 s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
