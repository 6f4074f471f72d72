"""benchmarks/plot_levels.py: the levels of plain and gzipped result files, in the order given, into one plot."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from benchmark_scripts import import_benchmark

from cosystream.bench.report import RequestRecord, build_results, summarize


@pytest.fixture(scope="module")
def plot_levels():
    return import_benchmark("plot_levels")


def _results(level: str, first_audio: list[float]) -> dict:
    records = [RequestRecord(level, i, start_s=0.0, end_s=1.0, first_audio_s=fa, total_s=1.0, audio_s=10.0)
               for i, fa in enumerate(first_audio)]
    return build_results({}, [summarize(records, level, "concurrency", 1)], records)


def test_levels_come_from_plain_and_gzipped_files_in_the_order_given(plot_levels, tmp_path: Path) -> None:
    plain = tmp_path / "high.json"
    plain.write_text(json.dumps(_results("c=64", [0.9, 1.1])))
    zipped = tmp_path / "low.json.gz"
    with gzip.open(zipped, "wt") as f:
        json.dump(_results("c=1", [0.04, 0.06]), f)

    levels = plot_levels.level_summaries([zipped, plain])

    assert [lv.level for lv in levels] == ["c=1", "c=64"]
    assert levels[0].first_audio_s["p50"] == pytest.approx(0.05)
    assert levels[1].aggregate_rtf == pytest.approx(20.0)  # two requests of 10 s audio in 1 s of wall time


def test_the_plot_is_written(plot_levels, tmp_path: Path) -> None:
    path = tmp_path / "levels.json"
    path.write_text(json.dumps(_results("c=16", [0.11, 0.12])))
    png = tmp_path / "levels.png"
    plot_levels.write_plot(png, plot_levels.level_summaries([path]))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
