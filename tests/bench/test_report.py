"""bench/report.py: percentile and summary math against hand-computed values, the playback clock, outputs."""

from __future__ import annotations

import json

import pytest

from cosystream.bench.report import (
    RequestRecord,
    Timeline,
    build_results,
    distribution,
    first_audio_breakdown,
    format_first_audio_breakdown,
    format_table,
    percentile,
    playback_underruns,
    summarize,
    write_json,
    write_plot,
)

# ---- percentiles ----------------------------------------------------------------------------------------


def test_percentile_interpolates_between_order_statistics() -> None:
    values = [7, 3, 1, 9, 5, 2, 10, 4, 8, 6]  # 1..10, unsorted
    # rank = (n - 1) * q / 100 = 9q/100: p50 -> 4.5 -> 5.5; p90 -> 8.1 -> 9.1; p95 -> 8.55; p99 -> 8.91
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 95) == pytest.approx(9.55)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 0) == 1
    assert percentile(values, 100) == 10


def test_percentile_small_inputs() -> None:
    assert percentile([4.0], 99) == 4.0
    assert percentile([10.0, 0.0, 20.0], 25) == pytest.approx(5.0)  # rank 0.5 between 0 and 10
    with pytest.raises(ValueError):
        percentile([], 50)


def test_distribution() -> None:
    stats = distribution([0.1, 0.3])
    assert stats == pytest.approx({"avg": 0.2, "p50": 0.2, "p90": 0.28, "p95": 0.29, "p99": 0.298, "max": 0.3})
    assert distribution([]) is None


# ---- playback clock -------------------------------------------------------------------------------------


def test_on_time_stream_has_no_underrun() -> None:
    # 1 s of audio at 0, plays until 1.0; the next second arrives at 0.5; plays until 2.0; the last at 1.9
    assert playback_underruns([(0.0, 24000), (0.5, 24000), (1.9, 24000)]) == (0, 0.0)


def test_late_pieces_are_underruns_and_playback_resumes_at_arrival() -> None:
    # 0.5 s plays until 0.5; arrives 0.8 (stall 0.3), plays until 1.3; arrives 1.5 (stall 0.2)
    count, stalled_s = playback_underruns([(0.0, 12000), (0.8, 12000), (1.5, 2400)])
    assert count == 2
    assert stalled_s == pytest.approx(0.5)


def test_arrival_exactly_at_the_end_of_buffered_audio_is_on_time() -> None:
    assert playback_underruns([(0.0, 12000), (0.5, 12000), (1.0, 12000)]) == (0, 0.0)
    count, stalled_s = playback_underruns([(0.0, 12000), (0.5 + 1e-6, 12000)])
    assert count == 1
    assert stalled_s == pytest.approx(1e-6)


def test_first_audio_delay_and_empty_pieces_are_not_underruns() -> None:
    assert playback_underruns([(5.0, 2400), (5.05, 0), (5.1, 2400)]) == (0, 0.0)
    assert playback_underruns([]) == (0, 0.0)
    assert playback_underruns([(0.0, 2400), (0.2, 2400)], sample_rate=16000) == (1, pytest.approx(0.05))


class FakeClock:
    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_timeline_builds_a_record() -> None:
    # clock reads: send 10.0, pieces at 10.2 and 11.0, end 11.1 (origin 9.0)
    timeline = Timeline("c=1", 3, origin_s=9.0, expected_audio_s=1.0, clock=FakeClock(10.0, 10.2, 11.0, 11.1))
    timeline.audio(12000)
    timeline.audio(0)  # ignored: no clock read
    timeline.audio(12000)
    rec = timeline.finish()
    assert (rec.start_s, rec.end_s) == (pytest.approx(1.0), pytest.approx(2.1))
    assert rec.first_audio_s == pytest.approx(0.2)
    assert rec.total_s == pytest.approx(1.1)
    assert rec.audio_s == 1.0
    assert (rec.underruns, rec.underrun_s) == (1, pytest.approx(0.3))  # 0.5 s buffered until 0.7, next at 1.0
    assert rec.ok and rec.rtf == pytest.approx(1.1)


def test_timeline_refusal_and_failure() -> None:
    refused = Timeline("c=1", 0, 0.0, clock=FakeClock(1.0, 1.5)).refuse(503, 2.0)
    assert refused.refused and not refused.ok and refused.retry_after_s == 2.0 and refused.rtf is None
    failed = Timeline("c=1", 0, 0.0, clock=FakeClock(1.0, 2.0)).fail("HTTP 500: x", 500)
    assert failed.error == "HTTP 500: x" and failed.status == 500 and failed.total_s is None
    silent = Timeline("c=1", 0, 0.0, clock=FakeClock(1.0, 2.0)).finish()
    assert silent.error == "no audio"


# ---- level summary --------------------------------------------------------------------------------------


def _records() -> list[RequestRecord]:
    return [
        RequestRecord("c=2", 0, start_s=0.0, end_s=2.0, first_audio_s=0.1, total_s=2.0, audio_s=4.0),
        RequestRecord("c=2", 1, start_s=0.0, end_s=3.0, first_audio_s=0.3, total_s=3.0, audio_s=2.0,
                      expected_audio_s=4.0, underruns=2, underrun_s=0.5),
        RequestRecord("c=2", 2, start_s=1.0, end_s=1.01, refused=True, status=503),
        RequestRecord("c=2", 3, start_s=2.0, end_s=4.0, first_audio_s=0.2, audio_s=1.0, error="boom"),
    ]


def test_summary_against_hand_computed_values() -> None:
    s = summarize(_records(), "c=2", "concurrency", 2)
    assert (s.num_requests, s.num_ok, s.num_errors, s.num_refused) == (4, 2, 1, 1)
    assert s.wall_s == pytest.approx(4.0)  # first send 0.0 -> last end 4.0
    assert s.aggregate_rtf == pytest.approx((4.0 + 2.0 + 0.0 + 1.0) / 4.0)  # every audio second produced
    assert s.achieved_rate == pytest.approx(2 / 4.0)
    assert s.first_audio_s["avg"] == pytest.approx(0.2)  # successful requests only: 0.1, 0.3
    assert s.first_audio_s["p90"] == pytest.approx(0.28)
    assert s.total_s["p50"] == pytest.approx(2.5)
    assert s.rtf["avg"] == pytest.approx((0.5 + 1.5) / 2)  # 2.0/4.0 and 3.0/2.0
    assert (s.underrun_requests, s.underruns, s.underrun_s) == (1, 2, pytest.approx(0.5))
    assert s.num_wrong_length == 1
    assert s.errors == {"boom": 1}
    assert s.goodput == pytest.approx((4.0 + 2.0) / 4.0)  # accepted streams' audio only
    assert s.first_audio_misses == 0 and s.deadline_misses == 2  # no deadline given: underruns only
    strict = summarize(_records(), "c=2", "concurrency", 2, first_audio_deadline_s=0.2)
    assert strict.first_audio_misses == 1 and strict.deadline_misses == 3  # 0.3 s > 0.2 s, plus two underruns


def test_wrong_length_counts_both_directions() -> None:
    def rec(audio_s: float) -> RequestRecord:
        return RequestRecord("c=1", 0, 0.0, 1.0, 0.1, 1.0, audio_s=audio_s, expected_audio_s=2.0)

    assert summarize([rec(2.0), rec(1.96), rec(73.44)], "c=1", "concurrency", 1).num_wrong_length == 2


def test_summary_of_nothing() -> None:
    s = summarize([], "c=1", "concurrency", 1, interrupted=True)
    assert s.num_requests == 0 and s.first_audio_s is None and s.aggregate_rtf == 0.0 and s.interrupted


def test_table_json_and_plot(tmp_path) -> None:
    records = _records()
    summaries = [summarize(records, "c=2", "concurrency", 2), summarize([], "c=4", "concurrency", 4)]
    table = format_table(summaries).splitlines()
    assert len(table) == 4 and table[0].count("|") == table[1].count("|") == table[2].count("|")
    assert "| c=2 | 4 | 2 | 1 | 1 | 200 / 200 / 280 / 298 |" in table[2]
    assert table[2].endswith("| 1.50 | 2 (0 first) |")  # goodput, deadline misses
    results = build_results({"target": "tts"}, summaries, records)
    loaded = json.loads(write_json(tmp_path / "r.json", results).read_text())
    assert loaded["schema"] == "cosystream-bench/1"
    assert [level["level"] for level in loaded["levels"]] == ["c=2", "c=4"]
    assert loaded["requests"][1]["underruns"] == 2 and loaded["requests"][2]["refused"] is True
    png = write_plot(tmp_path / "r.png", summaries, title="test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _timed(level: str, index: int, first_audio_s: float, ready_s: float, **extra: object) -> RequestRecord:
    server = {"queue_s": 0.001, "first_token_s": 0.01, "first_chunk_ready_s": ready_s,
              "first_chunk_start_s": ready_s + 0.01, "first_chunk_flow_s": 0.02, "first_chunk_vocoder_s": 0.003,
              "first_audio_s": first_audio_s - 0.002}
    return RequestRecord(level=level, index=index, start_s=0.0, first_audio_s=first_audio_s, server=server, **extra)


def test_first_audio_breakdown_means_all_and_the_slowest_tenth_per_level() -> None:
    records = [_timed("rate=15", i, first_audio_s=0.1 * (i + 1), ready_s=0.01 * (i + 1)) for i in range(20)]
    records += [RequestRecord(level="rate=15", index=20, start_s=0.0, first_audio_s=5.0),  # no stage times
                _timed("rate=15", 21, first_audio_s=9.0, ready_s=1.0, error="boom"),  # failed: not counted
                _timed("c=1", 0, first_audio_s=0.05, ready_s=0.02)]
    rows = first_audio_breakdown(records)
    assert [(level, group, n) for level, group, n, _ in rows] == \
        [("rate=15", "all", 20), ("rate=15", "slowest 10%", 2), ("c=1", "all", 1), ("c=1", "slowest 10%", 1)]
    every, tail = rows[0][3], rows[1][3]
    assert every["first_chunk_ready_s"] == pytest.approx(sum(0.01 * (i + 1) for i in range(20)) / 20)
    assert every["client first audio"] == pytest.approx(1.05)
    assert tail["first_chunk_ready_s"] == pytest.approx((0.19 + 0.20) / 2)  # the two slowest of twenty
    assert tail["first_chunk_start_s"] == pytest.approx((0.20 + 0.21) / 2)
    assert tail["client first audio"] == pytest.approx(1.95)
    table = format_first_audio_breakdown(records).splitlines()
    assert table[0].startswith("| level | requests | queue | first token | tokens ready | to the worker |")
    assert table[3] == "| rate=15, slowest 10% | 2 | 1 | 10 | 195 | 205 | 20 | 3 | 1948 | 1950 |"
    assert format_first_audio_breakdown([RequestRecord(level="c=1", index=0, start_s=0.0, first_audio_s=0.1)]) == ""
    assert [row[:2] for row in first_audio_breakdown(records, ["c=1"])] == [("c=1", "all"), ("c=1", "slowest 10%")]


def test_the_breakdown_shows_the_http_server_s_own_stages_when_every_request_has_them() -> None:
    served = [_timed("c=2", i, first_audio_s=0.06, ready_s=0.02) for i in range(2)]
    for record, to_engine in zip(served, (0.002, 0.004), strict=True):
        record.server.update(to_engine_s=to_engine, server_first_audio_s=0.055)
    table = format_first_audio_breakdown(served).splitlines()
    assert table[0].endswith("| engine first audio | arrival to engine | sent, from arrival | client first audio |")
    assert table[2] == "| c=2, all | 2 | 1 | 10 | 20 | 30 | 20 | 3 | 58 | 3 | 55 | 60 |"
    partly = served + [_timed("c=2", 2, first_audio_s=0.06, ready_s=0.02)]  # one without the server's stages
    assert "arrival to engine" not in format_first_audio_breakdown(partly)
    assert "proxy to replica" not in table[0]  # a single-process server has no proxy
    for record in served:  # behind Ray Serve's proxy: its share of the arrival-to-engine time
        record.server["proxy_s"] = 0.002
    table = format_first_audio_breakdown(served).splitlines()
    assert table[0].endswith("| arrival to engine | sent, from arrival | proxy to replica | client first audio |")
    assert table[2].endswith("| 3 | 55 | 2 | 60 |")


def test_the_table_never_calls_times_real_time_an_rtf() -> None:
    """RTF (a request's compute time per audio second, < 1 is fast) and the level's audio seconds per wall second
    (> 1 is fast) are opposite quantities: the header names the second `x realtime`, never an RTF."""
    head = [cell.strip() for cell in format_table([summarize(_records(), "c=2", "concurrency", 2)]).splitlines()[0]
            .strip("|").split("|")]
    assert "RTF p50" in head and "x realtime" in head
    assert [cell for cell in head if "RTF" in cell] == ["RTF p50"]
