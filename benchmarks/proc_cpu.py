"""Where a server's CPU goes while a benchmark runs: the CPU time of its processes, sampled from /proc.

`watch FILE` appends one JSON line a sample ({"t": wall seconds, "cpu": {pid: [role, cpu seconds]}}) every
`--interval` seconds until it is killed; `summary FILE` prints each role's CPU use in cores (CPU seconds per
wall second) over windows of `--window` seconds, and the busiest window. Roles are found by command line:
Ray's HTTP proxy (`ray::ProxyActor`), the replicas (`ray::ServeReplica...`), each one's engine process
(`cosystream.scale.engine_process`), Ray's controller, raylet
and GCS, and the single-process server (`cosystream.cli serve`, which under `--replicas` is the driver). One
role near 1.0 core in the busiest window is a Python process saturated on its one thread that counts (the GIL).

  python3 benchmarks/proc_cpu.py watch /tmp/cpu.jsonl &   # while the benchmark runs, then kill it
  python3 benchmarks/proc_cpu.py summary /tmp/cpu.jsonl --window 2
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from pathlib import Path

ROLES = (("ProxyActor", "proxy"), ("ServeReplica", "replica"), ("cosystream.scale.engine_process", "engine"),
         ("ServeController", "controller"),
         ("raylet", "raylet"), ("gcs_server", "gcs"), ("cosystream.cli serve", "server"),
         ("cosystream serve", "server"))
TICKS = os.sysconf("SC_CLK_TCK")


def role_of(cmdline: str) -> str | None:
    for pattern, role in ROLES:
        if pattern in cmdline:
            return role
    return None


def cpu_seconds(pid: str) -> float:
    """User + system CPU seconds of a process (its threads included), from /proc/PID/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14 and 15 of stat)


def sample() -> dict[str, list]:
    found: dict[str, list] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            role = role_of(cmdline)
            if role is not None:
                found[pid] = [role, cpu_seconds(pid)]
        except OSError:  # the process ended between listing and reading
            continue
    return found


def watch(path: Path, interval: float) -> None:
    with path.open("a", buffering=1) as out:
        while True:
            out.write(json.dumps({"t": time.time(), "cpu": sample()}) + "\n")
            time.sleep(interval)


def summary(path: Path, window: float) -> str:
    samples = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if len(samples) < 2:
        return f"{path}: fewer than two samples"
    rows: list[tuple[float, dict[str, float], dict[str, float]]] = []  # (start, cores per role, busiest process)
    start = samples[0]
    for later in samples[1:]:
        span = later["t"] - start["t"]
        if span < window and later is not samples[-1]:
            continue
        per_role: dict[str, float] = defaultdict(float)
        busiest: dict[str, float] = defaultdict(float)
        for pid, (role, cpu) in later["cpu"].items():
            before = start["cpu"].get(pid)
            cores = (cpu - (before[1] if before else 0.0)) / span if before else 0.0
            per_role[role] += cores
            busiest[role] = max(busiest[role], cores)
        rows.append((start["t"] - samples[0]["t"], dict(per_role), dict(busiest)))
        start = later
    roles = sorted({r for _, per_role, _ in rows for r in per_role})
    lines = [f"| from s | {' | '.join(f'{r} cores (busiest process)' for r in roles)} |",
             f"|---|{'---|' * len(roles)}"]
    for t0, per_role, busiest in rows:
        cells = [f"{per_role.get(r, 0.0):.2f} ({busiest.get(r, 0.0):.2f})" for r in roles]
        lines.append(f"| {t0:.0f} | {' | '.join(cells)} |")
    for r in roles:
        top = max(rows, key=lambda row: row[2].get(r, 0.0))
        lines.append(f"{r}: busiest process at most {top[2].get(r, 0.0):.2f} cores (window from {top[0]:.0f} s)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch")
    w.add_argument("file", type=Path)
    w.add_argument("--interval", type=float, default=1.0)
    s = sub.add_parser("summary")
    s.add_argument("file", type=Path)
    s.add_argument("--window", type=float, default=2.0)
    args = parser.parse_args()
    if args.cmd == "watch":
        watch(args.file, args.interval)
    else:
        print(summary(args.file, args.window))


if __name__ == "__main__":
    main()
