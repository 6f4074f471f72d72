"""The scale-out table of benchmarks/scale_ray.sh, from `cosystream bench` JSON files.

    python3 benchmarks/scale_table.py rate SWEEP.json        # twice the request rate at capacity (0: none clean)
    python3 benchmarks/scale_table.py pack OUT.json.gz REPLICAS C1.json SWEEP.json [OPEN.json]
    python3 benchmarks/scale_table.py table --budget-s 0.5 single.json.gz ray2.json.gz ...

Capacity is the highest closed-loop level whose requests were all accepted, all ok, of the right length and
played without an underrun; a server's throughput there is its aggregate (audio seconds per wall second). When the
sweep's highest level is clean, the capacity is at least that level ("≥"). The table compares every server with
the first file (the single-process server) against the issue's targets: capacity >= 1.9x with 2 replicas (3.7x
with 4), c=1 first audio p50 within 5 ms, open-loop accepted p99 within the budget.
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


def capacity(sweep: dict) -> tuple[dict | None, bool]:
    """(the highest clean level or None, whether it is the sweep's highest level: capacity at least that)."""
    levels = sorted(sweep["levels"], key=lambda lv: lv["value"])
    clean = [lv for lv in levels if is_clean(lv)]
    if not clean:
        return None, False
    best = max(clean, key=lambda lv: lv["value"])
    return best, best is levels[-1]


def _ms(stats: dict | None, key: str) -> str:
    return f"{stats[key] * 1000:.0f}" if stats and stats.get(key) is not None else "-"


def _ok(passed: bool) -> str:
    return "met" if passed else "NOT met"


def table(paths: list[str], budget_s: float) -> str:
    runs = [(Path(p).name.split(".")[0], load(p)) for p in paths]
    base_name, base = runs[0]
    base_c1 = base["c1"]["levels"][0]["first_audio_s"]["p50"] if base.get("c1") else None
    base_cap, _ = capacity(base["sweep"]) if base.get("sweep") else (None, False)
    lines = ["| server | c=1 first audio p50 / p90 / p99 ms | capacity: streams, req/s, aggregate | vs "
             f"{base_name} | open loop: offered req/s, requests, refused | accepted first audio p50 / p90 / p99 ms "
             "| underrun streams |", "|---|---|---|---|---|---|---|"]
    verdicts = []
    for name, run in runs:
        c1 = run["c1"]["levels"][0] if run.get("c1") else None
        c1_text = " / ".join(_ms(c1["first_audio_s"], k) for k in ("p50", "p90", "p99")) if c1 else "-"
        cap, at_top = capacity(run["sweep"]) if run.get("sweep") else (None, False)
        cap_text = (f"{'≥' if at_top else ''}{cap['value']:g}, {cap['achieved_rate']:.1f}, {cap['aggregate_rtf']:.1f}x"
                    if cap else "none clean")
        ratio = cap["aggregate_rtf"] / base_cap["aggregate_rtf"] if cap and base_cap else None
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
    return "\n".join(lines + [""] + verdicts) + "\n"


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
        cap, _ = capacity(load(args.sweep))
        print(f"{2 * cap['achieved_rate']:.2f}" if cap else "0")
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
