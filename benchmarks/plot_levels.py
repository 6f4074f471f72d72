"""One plot of the levels of several result files (`cosystream bench` / `bench_engine.py` JSON, or gzipped):
first-audio percentiles and aggregate real-time factor against the load level, in the order given.

    python benchmarks/plot_levels.py docs/img/levels.png docs/results/engine_low_*.json.gz \
        docs/results/engine_high_*.json.gz --title "H100, 028fdc4"
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from cosystream.bench.report import write_plot


def load_results(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def level_summaries(paths: list[Path]) -> list[SimpleNamespace]:
    """Every level of every file, as the fields `write_plot` reads."""
    return [SimpleNamespace(level=lv["level"], first_audio_s=lv["first_audio_s"], aggregate_rtf=lv["aggregate_rtf"])
            for path in paths for lv in load_results(path)["levels"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("png", type=Path)
    ap.add_argument("results", type=Path, nargs="+")
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    summaries = level_summaries(args.results)
    if not summaries:
        raise SystemExit("plot_levels.py: no levels in the given files")
    print(write_plot(args.png, summaries, title=args.title))


if __name__ == "__main__":
    main()
