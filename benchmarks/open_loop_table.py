"""Goodput and deadline misses of `cosystream bench` result files, one row per file (and level), recomputed
from the per-request records, so files written by any version of the client compare on one rule.

    python3 benchmarks/open_loop_table.py --first-audio-deadline-s 0.5 out/overload_*.json

Columns: accepted first audio p50/p90/p99, refusals and their answer time p99 as the client saw it (send to
the 503) and as the server did (arrival to the start of the 503, from its Server-Timing header; "-" for files
from servers that did not send it), streams with underruns among the accepted, goodput (accepted audio
seconds per wall second) and deadline misses (first audio after the deadline, plus underruns). A client
loaded with hundreds of streams adds its own event loop's lag to its refusal times: the server's column is
the admission's answer time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cosystream.bench.report import RequestRecord, percentile, summarize


def _ms(stats: dict, key: str) -> str:
    return f"{stats[key] * 1000:.0f}" if key in stats else "-"


def rows(path: Path, deadline_s: float) -> list[str]:
    doc = json.loads(path.read_text())
    fields = set(RequestRecord.__dataclass_fields__)
    records = [RequestRecord(**{k: v for k, v in r.items() if k in fields}) for r in doc["requests"]]
    out = []
    for level in [lv["level"] for lv in doc["levels"]]:
        mine = [r for r in records if r.level == level]
        s = summarize(mine, level, "rate", 0.0, first_audio_deadline_s=deadline_s)
        refused = [r.end_s - r.start_s for r in mine if r.refused]
        at_server = [r.server["refusal_s"] for r in mine if r.refused and "refusal_s" in (r.server or {})]
        fa = s.first_audio_s or {}
        refuse_p99 = f"{percentile(refused, 99) * 1000:.1f}" if refused else "-"
        server_p99 = f"{percentile(at_server, 99) * 1000:.1f}" if at_server else "-"
        first_audio = " / ".join(_ms(fa, key) for key in ("p50", "p90", "p99"))
        out.append(f"| {path.name} | {level} | {s.num_requests} | {first_audio} "
                   f"| {s.num_refused} | {refuse_p99} | {server_p99} | {s.underrun_requests} | {s.goodput:.2f} "
                   f"| {s.deadline_misses} ({s.first_audio_misses} first) |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--first-audio-deadline-s", type=float, default=1.0)
    args = parser.parse_args()
    print("| file | level | reqs | accepted first audio p50 / p90 / p99 ms | refused | refusal p99 ms (client) "
          "| refusal p99 ms (server) | streams with underruns | goodput s/s | deadline misses |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in args.files:
        for row in rows(path, args.first_audio_deadline_s):
            print(row)


if __name__ == "__main__":
    main()
