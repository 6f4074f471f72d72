"""The scale-out table of benchmarks/scale_ray.sh, from `cosystream bench` JSON files.

    python3 benchmarks/scale_table.py rate SWEEP.json        # twice the request rate at capacity (0: none clean)
    python3 benchmarks/scale_table.py pack OUT.json.gz REPLICAS C1.json SWEEP.json [OPEN.json]
    python3 benchmarks/scale_table.py table --budget-s 0.5 single.json.gz ray2.json.gz ...

A closed-loop level is clean when its requests were all accepted, all ok, of the right length and played without
an underrun. Its throughput is its steady aggregate: the audio seconds that reached the clients per wall second
while every one of its streams had a request open (from the moment the last stream started to the moment the first
one went idle for good, so neither the ramp-up nor the drain at the level's end, whose length depends on how the
last requests happen to line up, is in it; the audio counted is the samples that arrived inside that window).
Capacity is the clean level with the highest steady aggregate, so a level past the knee that stays clean but
delivers less never hides a better one below it; when that level is the sweep's highest, the capacity is at least
that ("≥"). The table compares every server with the first file (the single-process server) against the issue's
targets: capacity >= 1.9x with 2 replicas (3.7x with 4), c=1 first audio p50 within 5 ms, open-loop accepted p99
within the budget.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Any

TARGET_RATIO = {2: 1.9, 4: 3.7}
C1_MARGIN_MS = 5.0


def load(path: str | Path) -> Any:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def is_clean(level: dict) -> bool:
    return (level["num_requests"] > 0 and level["num_ok"] == level["num_requests"] and not level["num_errors"]
            and not level.get("num_refused") and not level["underrun_requests"] and not level.get("num_wrong_length"))


def full_window(requests: list[dict], streams: int) -> tuple[float, float] | None:
    """(start, end) of the longest stretch during which `streams` requests were open at once (a closed-loop level's
    steady state; a stream's own turnaround between two requests is bridged), or None when it never was."""
    events = sorted([(r["start_s"], 1) for r in requests] + [(r["end_s"], -1) for r in requests],
                    key=lambda e: (e[0], -e[1]))
    open_now, start, best = 0, None, None
    for t, delta in events:
        open_now += delta
        if open_now >= streams and start is None:
            start = t
        elif open_now < streams - 1 and start is not None:  # more than one stream between requests: idle for good
            if best is None or t - start > best[1] - best[0]:
                best = (start, t)
            start = None
    if start is not None and (best is None or events[-1][0] - start > best[1] - best[0]):
        best = (start, events[-1][0])
    return best


def steady_aggregate(requests: list[dict], streams: int) -> float | None:
    """Audio seconds that arrived per wall second inside the level's full_window (None without one)."""
    window = full_window(requests, streams)
    if window is None or window[1] <= window[0]:
        return None
    t0, t1 = window
    audio_s = 0.0
    for r in requests:
        arrived = sum(n for _, n in r.get("arrivals") or ())
        if not arrived:
            continue
        inside = sum(n for t, n in r["arrivals"] if t0 <= r["start_s"] + t <= t1)
        audio_s += r["audio_s"] * inside / arrived  # arrivals count in the client's units, audio_s in seconds
    return audio_s / (t1 - t0)


def level_throughput(sweep: dict, level: dict) -> tuple[float, float]:
    """(steady aggregate, request rate at it) of a closed-loop level; the whole level's when it has no window."""
    requests = [r for r in sweep.get("requests", []) if r.get("level") == level["level"]]
    steady = steady_aggregate(requests, int(level["value"]))
    if steady is None:
        return level["aggregate_rtf"], level["achieved_rate"]
    per_request_s = sum(r["audio_s"] for r in requests) / max(len(requests), 1)
    return steady, steady / per_request_s if per_request_s else 0.0


def capacity(sweep: dict) -> tuple[dict | None, bool, float, float]:
    """(the clean level of the highest steady aggregate or None, whether it is the sweep's highest level: capacity
    at least that, its steady aggregate, its request rate)."""
    levels = sorted(sweep["levels"], key=lambda lv: lv["value"])
    scored = [(level_throughput(sweep, lv), lv) for lv in levels if is_clean(lv)]
    if not scored:
        return None, False, 0.0, 0.0
    (aggregate, rate), best = max(scored, key=lambda item: item[0][0])
    return best, best is levels[-1], aggregate, rate


def replica_split(requests: list[dict]) -> dict[str, tuple[int, float]]:
    """Per replica that served a request of a level: (requests it served, the mean of its requests open at once
    over the level, from its first request's start to its last one's end), from the server's records (`replica`,
    which the Ray app adds to GET /v1/requests/{id}); empty when none names one. (A mean, not a peak: the client
    sees a stream end a little after the proxy does, which may already have routed the stream's next request, so
    client times overlap on a replica where the streams did not.)"""
    ended = [r for r in requests if r.get("end_s") is not None]
    if not ended:
        return {}
    span_s = max(r["end_s"] for r in ended) - min(r["start_s"] for r in ended)
    split: dict[str, tuple[int, float]] = {}
    for r in ended:
        replica = (r.get("server") or {}).get("replica")
        if replica:
            served, busy_s = split.get(replica, (0, 0.0))
            split[replica] = (served + 1, busy_s + r["end_s"] - r["start_s"])
    return {replica: (n, busy_s / span_s if span_s > 0 else 0.0) for replica, (n, busy_s) in sorted(split.items())}


def busiest_share(requests: list[dict], step_s: float = 0.005) -> float | None:
    """The busiest replica's share of the streams open at once, averaged over the middle 80 % of a level (ramp-up
    and drain left out), sampled every `step_s`: 1 / replicas when the router kept them even at every moment (a
    mean over the level can look even while the waves of a closed loop take turns on one replica). None without
    records that name their replica."""
    served = [r for r in requests if r.get("end_s") is not None and (r.get("server") or {}).get("replica")]
    if not served:
        return None
    t0, t1 = min(r["start_s"] for r in served), max(r["end_s"] for r in served)
    t, end, shares = t0 + 0.1 * (t1 - t0), t1 - 0.1 * (t1 - t0), []
    while t < end:
        open_now: dict[str, int] = {}
        for r in served:
            if r["start_s"] <= t < r["end_s"]:
                open_now[r["server"]["replica"]] = open_now.get(r["server"]["replica"], 0) + 1
        if open_now:
            shares.append(max(open_now.values()) / sum(open_now.values()))
        t += step_s
    return sum(shares) / len(shares) if shares else None


def balance(name: str, run: dict) -> list[str]:
    """One line per closed-loop level of a run over replicas: how its requests split between them."""
    lines = []
    for level in sorted(run.get("sweep", {}).get("levels", []), key=lambda lv: lv["value"]):
        requests = [r for r in run["sweep"].get("requests", []) if r.get("level") == level["level"]]
        split = replica_split(requests)
        if split:
            parts = ", ".join(f"{replica} {n} served ({mean:.1f} open on average)"
                              for replica, (n, mean) in split.items())
            share = busiest_share(requests)
            busiest = f"; the busiest replica held {share:.0%} of the open streams at a time" if share else ""
            lines.append(f"{name} {level['level']}: {parts}{busiest}")
    return lines


def _ms(stats: dict | None, key: str) -> str:
    return f"{stats[key] * 1000:.0f}" if stats and stats.get(key) is not None else "-"


def _ok(passed: bool) -> str:
    return "met" if passed else "NOT met"


def table(paths: list[str], budget_s: float) -> str:
    runs = [(Path(p).name.split(".")[0], load(p)) for p in paths]
    base_name, base = runs[0]
    base_c1 = base["c1"]["levels"][0]["first_audio_s"]["p50"] if base.get("c1") else None
    base_cap, _, base_agg, _ = capacity(base["sweep"]) if base.get("sweep") else (None, False, 0.0, 0.0)
    lines = ["| server | c=1 first audio p50 / p90 / p99 ms | capacity: streams, req/s, steady aggregate (whole "
             f"level) | vs {base_name} | open loop: offered req/s, requests, refused "
             "| accepted first audio p50 / p90 / p99 ms | underrun streams |", "|---|---|---|---|---|---|---|"]
    verdicts = []
    for name, run in runs:
        c1 = run["c1"]["levels"][0] if run.get("c1") else None
        c1_text = " / ".join(_ms(c1["first_audio_s"], k) for k in ("p50", "p90", "p99")) if c1 else "-"
        cap, at_top, agg, rate = capacity(run["sweep"]) if run.get("sweep") else (None, False, 0.0, 0.0)
        cap_text = (f"{'≥' if at_top else ''}{cap['value']:g}, {rate:.1f}, {agg:.1f}x ({cap['aggregate_rtf']:.1f}x)"
                    if cap else "none clean")
        ratio = agg / base_agg if cap and base_cap and base_agg else None
        open_level = run["open"]["levels"][0] if run.get("open") else None
        if open_level:
            fa = open_level["first_audio_s"] or {}
            open_text = f"{open_level['value']:g}, {open_level['num_requests']}, {open_level.get('num_refused', 0)}"
            open_fa = " / ".join(_ms(fa, k) for k in ("p50", "p90", "p99"))
            underruns = str(open_level["underrun_requests"])
        else:
            open_text, open_fa, underruns = "not run", "-", "-"
        lines.append(f"| {name} | {c1_text} | {cap_text} | {f'{ratio:.2f}x' if ratio else '-'} | {open_text} "
                     f"| {open_fa} | {underruns} |")
        replicas = run.get("replicas", 1)
        if name != base_name:
            target = TARGET_RATIO.get(replicas)
            if ratio is not None:
                verdict = f", target >= {target:g}x: {_ok(ratio >= target)}" if target else " (no target)"
                verdicts.append(f"{name}: capacity {ratio:.2f}x {base_name}'s{verdict}")
            if c1 and base_c1 is not None:
                delta_ms = (c1["first_audio_s"]["p50"] - base_c1) * 1000
                verdicts.append(f"{name}: c=1 first audio p50 {delta_ms:+.1f} ms against {base_name}, target within "
                                f"{C1_MARGIN_MS:g} ms: {_ok(delta_ms <= C1_MARGIN_MS)}")
        if open_level and open_level["first_audio_s"]:
            p99_s = open_level["first_audio_s"]["p99"]
            verdicts.append(f"{name}: open loop at 2x capacity, accepted p99 {p99_s * 1000:.0f} ms, budget "
                            f"{budget_s * 1000:.0f} ms: {_ok(p99_s <= budget_s)}")
    split = [line for name, run in runs if run.get("replicas", 1) > 1 for line in balance(name, run)]
    return "\n".join(lines + [""] + verdicts + ([""] + split if split else [])) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rate = sub.add_parser("rate", help="twice the request rate at capacity, or 0")
    rate.add_argument("sweep")
    pack = sub.add_parser("pack", help="one server's bench files as one gzipped JSON")
    pack.add_argument("out")
    pack.add_argument("replicas", type=int)
    pack.add_argument("files", nargs="+", help="c=1, sweep and (if run) open-loop JSON")
    tab = sub.add_parser("table", help="the markdown table and the targets")
    tab.add_argument("--budget-s", type=float, required=True)
    tab.add_argument("files", nargs="+", help="packed files, the single-process server's first")
    args = parser.parse_args(argv)
    if args.command == "rate":
        cap, _, _, rate = capacity(load(args.sweep))
        print(f"{2 * rate:.2f}" if cap else "0")
    elif args.command == "pack":
        packed: dict[str, Any] = {"replicas": args.replicas}
        for key, path in zip(("c1", "sweep", "open"), args.files, strict=False):
            if Path(path).exists():
                packed[key] = load(path)
        with gzip.open(args.out, "wt") as f:
            json.dump(packed, f)
    else:
        sys.stdout.write(table(args.files, args.budget_s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
