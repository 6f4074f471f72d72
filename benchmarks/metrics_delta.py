"""Where one open-loop level's GPU time went: the difference of two `/metrics` snapshots of one server, taken
before and after the level (`levels_all.sh overload` writes them as metrics_<level>_{before,after}.txt, and
the closed loop's as metrics_closed_*).

    python3 benchmarks/metrics_delta.py out/metrics_x4_s0_before.txt out/metrics_x4_s0_after.txt [--wall-s 11.4]
    python3 benchmarks/metrics_delta.py --dir out     # every before/after pair in a folder, one row each

Per level: admitted and refused (and refusals by rule), the worker's and the LM thread's busy seconds and, with
the level's wall time (read from the bench JSON beside the snapshots when not given), their busy fractions;
the worker's GPU seconds per admitted request split into the official final passes, the chunks' ODE, the
encoder and the vocoder. A worker busy near 100 % with refusals means its cost per request bounds the goodput;
a worker with idle time and refusals means the admission refuses work the GPU had room for.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

_WORKER_PARTS = ("final_pass", "final_setup", "ode", "ode_setup", "encoder", "flow_setup", "vocoder", "to_host",
                 "open", "prompts")


def samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text page, keyed by name and labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if not k.endswith("_created")}


def level_row(d: dict[str, float], wall_s: float | None) -> dict[str, float | None]:
    """The level's account from the counters' differences."""
    admitted = d.get("cosystream_engine_admission_admitted", 0.0)
    row: dict[str, float | None] = {
        "admitted": admitted,
        "refused": d.get("cosystream_engine_admission_refused", 0.0),
        "worker_busy_s": d.get("cosystream_engine_token2wav_busy_seconds", 0.0),
        "lm_busy_s": d.get("cosystream_engine_lm_busy_seconds", 0.0),
        "wall_s": wall_s,
    }
    for key, value in d.items():
        m = re.fullmatch(r"cosystream_admission_refusals_total\{rule=(\w+)\}", key)
        if m:
            row[f"refused_{m.group(1)}"] = value
    for part in _WORKER_PARTS:
        gpu = d.get(f"cosystream_engine_token2wav_{part}_gpu_seconds", 0.0)
        row[f"{part}_gpu_ms_per_request"] = 1000 * gpu / admitted if admitted else None
    if wall_s:
        row["worker_busy_frac"] = row["worker_busy_s"] / wall_s
        row["lm_busy_frac"] = row["lm_busy_s"] / wall_s
    return row


def _wall_of(folder: Path, name: str) -> float | None:
    """The level's wall seconds from its bench JSON (overload_<name>.json, or <name>.json: all its levels)."""
    for path in (folder / f"overload_{name}.json", folder / f"{name}.json"):
        if path.exists():
            levels = json.loads(path.read_text()).get("levels") or []
            return sum(level.get("wall_s") or 0.0 for level in levels) or None
    return None


def _pairs(folder: Path) -> list[tuple[str, Path, Path]]:
    out = []
    for before in sorted(folder.glob("metrics_*_before.txt")):
        name = before.name[len("metrics_"):-len("_before.txt")]
        after = before.with_name(f"metrics_{name}_after.txt")
        if after.exists():
            out.append((name, before, after))
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(rows: list[tuple[str, dict[str, float | None]]]) -> None:
    rules = sorted({k for _, r in rows for k in r if k.startswith("refused_")})
    head = ["level", "admitted", "refused", *[r.removeprefix("refused_") for r in rules], "worker busy", "LM busy",
            "final ms/req", "ODE ms/req", "encoder ms/req", "vocoder ms/req"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, r in rows:
        busy = (f"{r['worker_busy_s']:.1f} s ({100 * r['worker_busy_frac']:.0f} %)" if r.get("worker_busy_frac")
                is not None else f"{r['worker_busy_s']:.1f} s")
        lm = (f"{r['lm_busy_s']:.1f} s ({100 * r['lm_busy_frac']:.0f} %)" if r.get("lm_busy_frac") is not None
              else f"{r['lm_busy_s']:.1f} s")
        cells = [name, f"{r['admitted']:.0f}", f"{r['refused']:.0f}", *[f"{r.get(k, 0.0):.0f}" for k in rules],
                 busy, lm, _fmt(r["final_pass_gpu_ms_per_request"]), _fmt(r["ode_gpu_ms_per_request"]),
                 _fmt(r["encoder_gpu_ms_per_request"]), _fmt(r["vocoder_gpu_ms_per_request"])]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", nargs="?", type=Path)
    ap.add_argument("after", nargs="?", type=Path)
    ap.add_argument("--dir", type=Path, help="every metrics_<level>_{before,after}.txt pair in this folder")
    ap.add_argument("--wall-s", type=float, help="the level's wall time (default: its bench JSON's)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    if args.dir is not None:
        pairs = _pairs(args.dir)
        if not pairs:
            ap.error(f"--dir {args.dir}: no metrics_<level>_before.txt / _after.txt pairs")
        walls = {name: _wall_of(args.dir, name) for name, _, _ in pairs}
    elif args.before is not None and args.after is not None:
        for path in (args.before, args.after):
            if not path.is_file():
                ap.error(f"{path}: no such snapshot file")
        pairs = [(args.after.stem, args.before, args.after)]
        walls = {args.after.stem: args.wall_s}
    else:
        ap.error("give BEFORE and AFTER snapshots, or --dir")
    rows = [(name, level_row(delta(samples(b.read_text()), samples(a.read_text())), walls[name]))
            for name, b, a in pairs]
    print_table(rows)
    if args.json is not None:
        args.json.write_text(json.dumps(dict(rows), indent=1))


if __name__ == "__main__":
    main()
