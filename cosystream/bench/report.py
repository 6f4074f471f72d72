"""Benchmark records and what is computed from them: playback underruns, per-level summaries, tables, plots.

Transport-independent: the HTTP/WebSocket load generator (bench/loadgen.py) and the in-process engine
benchmark (benchmarks/bench_engine.py) both feed a `Timeline` per request and share everything below.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cosystream.outputs import SAMPLE_RATE

SCHEMA = "cosystream-bench/1"
PERCENTILES = (50, 90, 95, 99)
# Arrivals this close after the playback end still count as on time: float rounding, not a gap.
BOUNDARY_TOLERANCE_S = 1e-9


# ---- one request ----------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """One request as the client saw it. Times in seconds; `*_s` relative to the send unless noted."""

    level: str  # the load level's label, e.g. "c=16" or "rate=2.5"
    index: int  # request number within its level
    start_s: float  # send time, seconds since the run began
    end_s: float = 0.0  # end (last byte, error or refusal), seconds since the run began
    first_audio_s: float | None = None  # send -> first audio sample
    total_s: float | None = None  # send -> end of the stream (successful requests only)
    audio_s: float = 0.0  # audio received
    expected_audio_s: float | None = None  # forced length (960 samples per token), when known
    underruns: int = 0  # times playback ran dry before more audio came
    underrun_s: float = 0.0  # total time playback was stalled
    status: int | None = None  # HTTP status, when there was one
    refused: bool = False  # 503/429: the server's admission control said no
    retry_after_s: float | None = None
    error: str | None = None
    arrivals: list[list[float]] = field(default_factory=list)  # [[seconds since send, num_samples], ...]
    server: dict[str, Any] = field(default_factory=dict)  # timings the server reported, if any

    @property
    def ok(self) -> bool:
        return self.error is None and not self.refused

    @property
    def rtf(self) -> float | None:
        """Real-time factor of this request: wall time / audio seconds (< 1 is faster than real time)."""
        if not self.ok or self.total_s is None or self.audio_s <= 0:
            return None
        return self.total_s / self.audio_s


class Timeline:
    """Collects one request's audio arrivals against a clock and turns them into a `RequestRecord`.

    `origin_s` is the run's start on the same clock (default `time.perf_counter`), so records of all
    levels share one time axis. Call `audio()` per received piece, then exactly one of `finish()`,
    `fail()` or `refuse()`.
    """

    def __init__(self, level: str, index: int, origin_s: float, sample_rate: int = SAMPLE_RATE,
                 expected_audio_s: float | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock, self.sample_rate, self.origin_s = clock, sample_rate, origin_s
        self.t_send = clock()
        self.record = RequestRecord(level=level, index=index, start_s=self.t_send - origin_s,
                                    expected_audio_s=expected_audio_s)
        self.num_samples = 0
        self.closed = False

    def audio(self, num_samples: int) -> None:
        if num_samples <= 0:
            return
        self.record.arrivals.append([round(self.clock() - self.t_send, 6), num_samples])
        self.num_samples += num_samples

    def finish(self) -> RequestRecord:
        rec = self._close()
        rec.total_s = rec.end_s - rec.start_s
        if self.num_samples == 0:
            rec.error = "no audio"
        return rec

    def fail(self, error: str, status: int | None = None) -> RequestRecord:
        rec = self._close()
        rec.error, rec.status = error, status if status is not None else rec.status
        return rec

    def refuse(self, status: int, retry_after_s: float | None = None) -> RequestRecord:
        rec = self._close()
        rec.refused, rec.status, rec.retry_after_s = True, status, retry_after_s
        return rec

    def _close(self) -> RequestRecord:
        assert not self.closed, "a timeline is closed once"
        self.closed = True
        rec = self.record
        rec.end_s = self.clock() - self.origin_s
        rec.audio_s = self.num_samples / self.sample_rate
        if rec.arrivals:
            rec.first_audio_s = rec.arrivals[0][0]
        rec.underruns, rec.underrun_s = playback_underruns(rec.arrivals, self.sample_rate)
        return rec


def playback_underruns(arrivals: Iterable[Sequence[float]], sample_rate: int = SAMPLE_RATE) -> tuple[int, float]:
    """Play arrivals [(t_s, num_samples), ...] on a client clock; return (underruns, stalled seconds).

    Playback starts when the first audio arrives. A piece arriving after everything before it has
    finished playing is an underrun: playback stalls from that moment until the arrival, then resumes
    from the arrival. A piece arriving exactly at the end of the buffered audio is on time.
    """
    count, stalled_s = 0, 0.0
    play_end_s: float | None = None  # when the audio received so far finishes playing
    for t_s, num_samples in arrivals:
        if num_samples <= 0:
            continue
        if play_end_s is None:
            play_end_s = t_s
        elif t_s > play_end_s + BOUNDARY_TOLERANCE_S:
            count += 1
            stalled_s += t_s - play_end_s
            play_end_s = t_s
        play_end_s = max(play_end_s, t_s) + num_samples / sample_rate
    return count, stalled_s


# ---- one level ------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def distribution(values: Sequence[float]) -> dict[str, float] | None:
    """avg, p50, p90, p95, p99 and max of `values`; None when there are none."""
    if not values:
        return None
    stats = {"avg": sum(values) / len(values)}
    stats.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    stats["max"] = max(values)
    return stats


@dataclass
class LevelSummary:
    """What one load level achieved. Latencies in seconds."""

    level: str
    kind: str  # "concurrency" (closed loop) or "rate" (open loop, Poisson arrivals)
    value: float  # streams in flight, or offered requests per second
    num_requests: int
    num_ok: int
    num_errors: int
    num_refused: int
    wall_s: float  # first send -> last end
    first_audio_s: dict[str, float] | None
    total_s: dict[str, float] | None
    rtf: dict[str, float] | None  # per request: wall time / audio seconds
    aggregate_rtf: float  # audio seconds produced / wall seconds of the level (> 1: faster than real time)
    achieved_rate: float  # successful requests per wall second
    underrun_requests: int  # successful requests with at least one underrun
    underruns: int
    underrun_s: float
    num_wrong_length: int = 0  # successful requests whose audio length is not the forced length
    interrupted: bool = False  # stopped early (Ctrl-C); the level is incomplete
    goodput: float = 0.0  # audio seconds of the accepted (successful) streams per wall second
    first_audio_deadline_s: float | None = None  # the first-audio deadline the misses are counted against
    first_audio_misses: int = 0  # successful requests whose first audio came after that deadline
    deadline_misses: int = 0  # first-audio misses + playback underruns (a later chunk after its deadline)
    errors: dict[str, int] = field(default_factory=dict)  # error message -> count (first 80 chars)


def summarize(records: Sequence[RequestRecord], level: str, kind: str, value: float,
              interrupted: bool = False, first_audio_deadline_s: float | None = None) -> LevelSummary:
    """Summarise one level's records (warm-up requests excluded by the caller). A chunk misses its deadline
    when it is a first chunk later than `first_audio_deadline_s` after the send, or a later chunk that comes
    after the client's audio ran out (an underrun)."""
    ok = [r for r in records if r.ok]
    wall_s = max((r.end_s for r in records), default=0.0) - min((r.start_s for r in records), default=0.0)
    first_misses = 0 if first_audio_deadline_s is None else sum(
        r.first_audio_s is not None and r.first_audio_s > first_audio_deadline_s for r in ok)
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error[:80]] = errors.get(r.error[:80], 0) + 1
    return LevelSummary(
        level=level, kind=kind, value=value, num_requests=len(records), num_ok=len(ok),
        num_errors=sum(r.error is not None for r in records), num_refused=sum(r.refused for r in records),
        wall_s=wall_s,
        first_audio_s=distribution([r.first_audio_s for r in ok if r.first_audio_s is not None]),
        total_s=distribution([r.total_s for r in ok if r.total_s is not None]),
        rtf=distribution([r.rtf for r in ok if r.rtf is not None]),
        aggregate_rtf=sum(r.audio_s for r in records) / wall_s if wall_s > 0 else 0.0,
        achieved_rate=len(ok) / wall_s if wall_s > 0 else 0.0,
        underrun_requests=sum(r.underruns > 0 for r in ok),
        underruns=sum(r.underruns for r in ok), underrun_s=sum(r.underrun_s for r in ok),
        num_wrong_length=sum(_is_wrong_length(r) for r in ok), interrupted=interrupted, errors=errors,
        goodput=sum(r.audio_s for r in ok) / wall_s if wall_s > 0 else 0.0,
        first_audio_deadline_s=first_audio_deadline_s, first_audio_misses=first_misses,
        deadline_misses=first_misses + sum(r.underruns for r in ok))


def _is_wrong_length(r: RequestRecord) -> bool:
    # half a sample of slack for the float conversion of integer sample counts
    return r.expected_audio_s is not None and abs(r.audio_s - r.expected_audio_s) > 0.5 / SAMPLE_RATE


# ---- output ---------------------------------------------------------------------------------------------


def build_results(meta: dict[str, Any], summaries: Sequence[LevelSummary],
                  records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The JSON document: {schema, meta, levels: [LevelSummary], requests: [RequestRecord]}."""
    return {"schema": SCHEMA, "meta": meta, "levels": [_rounded(asdict(s)) for s in summaries],
            "requests": [_rounded(asdict(r)) for r in records]}


def _rounded(value: Any) -> Any:
    # microseconds are below what a client clock can resolve; the JSON stays readable
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def write_json(path: str | Path, results: dict[str, Any]) -> Path:
    path = Path(path)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return path


def _ms(stats: dict[str, float] | None, key: str) -> str:
    return "-" if stats is None else f"{stats[key] * 1000:.0f}"


def _num(stats: dict[str, float] | None, key: str, fmt: str = ".3f") -> str:
    return "-" if stats is None else format(stats[key], fmt)


def format_table(summaries: Sequence[LevelSummary]) -> str:
    """A markdown table, one row per level (first-audio in ms, total in s). `RTF p50` is a request's synthesis
    time / its audio time (< 1: faster than real time); `x realtime` is the level's audio seconds per wall second
    across all its requests (> 1: faster than real time), so the two never read as the same quantity."""
    head = ("| level | reqs | ok | err | refused | first audio avg / p50 / p90 / p99 ms | total p50 / p99 s "
            "| RTF p50 | x realtime | req/s | underrun reqs | underrun s | goodput s/s | deadline misses |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summaries:
        fa = s.first_audio_s
        rows.append(
            f"| {s.level}{' (interrupted)' if s.interrupted else ''} | {s.num_requests} | {s.num_ok} "
            f"| {s.num_errors} | {s.num_refused} "
            f"| {_ms(fa, 'avg')} / {_ms(fa, 'p50')} / {_ms(fa, 'p90')} / {_ms(fa, 'p99')} "
            f"| {_num(s.total_s, 'p50', '.2f')} / {_num(s.total_s, 'p99', '.2f')} | {_num(s.rtf, 'p50')} "
            f"| {s.aggregate_rtf:.2f} | {s.achieved_rate:.2f} | {s.underrun_requests} | {s.underrun_s:.2f} "
            f"| {s.goodput:.2f} | {s.deadline_misses} ({s.first_audio_misses} first) |")
    return "\n".join(rows)


# the server's stage times of a request's first audio (StageTimes), in the order they happen: the first five
# count from the request's submission, flow and vocoder are the first chunk's own durations
FIRST_AUDIO_STAGES = (("queue_s", "queue"), ("first_token_s", "first token"),
                      ("first_chunk_ready_s", "tokens ready"), ("first_chunk_start_s", "to the worker"),
                      ("first_chunk_flow_s", "flow"), ("first_chunk_vocoder_s", "vocoder"),
                      ("first_audio_s", "engine first audio"))
# what an HTTP server adds (GET /v1/requests/{id}), counted from the request's arrival at the server: its own
# work before the engine has the request, and when the first audio bytes went out
SERVER_STAGES = (("to_engine_s", "arrival to engine"), ("server_first_audio_s", "sent, from arrival"))
# behind Ray Serve's proxy (`serve --replicas`): the proxy's share of "arrival to engine" (routing, transport)
PROXY_STAGE = ("proxy_s", "proxy to replica")


def first_audio_breakdown(records: Sequence[RequestRecord], levels: Sequence[str] | None = None,
                          slowest: float = 0.1) -> list[tuple[str, str, int, dict[str, float]]]:
    """Where first audio goes, per level (`levels`: these, in this order; None: every level of the records):
    (level, group, requests, mean seconds by stage) for all successful requests that carry the server's
    stage times and for the `slowest` share of them by the client's first audio (the tail a percentile
    target is about). The HTTP server's own stages (SERVER_STAGES) are in when every such request of the
    level has them."""
    out: list[tuple[str, str, int, dict[str, float]]] = []
    for level in levels if levels is not None else list(dict.fromkeys(r.level for r in records)):
        timed = sorted((r for r in records if r.level == level and r.ok and r.first_audio_s is not None
                        and all(isinstance(r.server.get(k), (int, float)) for k, _ in FIRST_AUDIO_STAGES)),
                       key=lambda r: r.first_audio_s)
        if not timed:
            continue
        tail = timed[min(int(len(timed) * (1 - slowest)), len(timed) - 1):]
        keys = [k for k, _ in FIRST_AUDIO_STAGES]
        if all(isinstance(r.server.get(k), (int, float)) for r in timed for k, _ in SERVER_STAGES):
            keys += [k for k, _ in SERVER_STAGES]
            if all(isinstance(r.server.get(PROXY_STAGE[0]), (int, float)) for r in timed):
                keys.append(PROXY_STAGE[0])
        for group, rs in (("all", timed), (f"slowest {slowest:.0%}", tail)):
            means = {k: sum(r.server[k] for r in rs) / len(rs) for k in keys}
            means["client first audio"] = sum(r.first_audio_s for r in rs) / len(rs)
            out.append((level, group, len(rs), means))
    return out


def format_first_audio_breakdown(records: Sequence[RequestRecord], levels: Sequence[str] | None = None) -> str:
    """`first_audio_breakdown` as a markdown table in ms ("" when no request carries stage times)."""
    rows = first_audio_breakdown(records, levels)
    if not rows:
        return ""
    server_stages = (*SERVER_STAGES, PROXY_STAGE)
    stages = [*FIRST_AUDIO_STAGES, *(st for st in server_stages if all(st[0] in row[3] for row in rows))]
    names = [name for _, name in stages] + ["client first audio"]  # ms
    head = "| level | requests | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for level, group, n, means in rows:
        keys = [k for k, _ in stages] + ["client first audio"]
        cells = [f"{1000 * means[k]:.0f}" for k in keys]
        lines.append(f"| {level}, {group} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_plot(path: str | Path, summaries: Sequence[LevelSummary], title: str = "") -> Path:
    """PNG: first-audio percentiles (ms) and aggregate real-time factor against the load level."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    # levels as evenly spaced categories: concurrency 1..128 on a linear axis would crowd the low end
    xs = list(range(len(summaries)))
    labels = [s.level for s in summaries]
    fig, (ax_lat, ax_rtf) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key in ("p50", "p90", "p95", "p99"):
        ys = [s.first_audio_s[key] * 1000 if s.first_audio_s else math.nan for s in summaries]
        ax_lat.plot(xs, ys, marker="o", label=key)
    ax_lat.set(title="first-audio latency", ylabel="ms", xlabel="load level")
    ax_lat.legend()
    ax_rtf.plot(xs, [s.aggregate_rtf for s in summaries], marker="o", color="tab:green")
    ax_rtf.axhline(1.0, color="grey", linestyle="--", linewidth=1)  # real time
    ax_rtf.set(title="aggregate real-time factor", ylabel="audio s / wall s", xlabel="load level")
    for ax in (ax_lat, ax_rtf):
        ax.set_xticks(xs, labels, rotation=30 if len(xs) > 6 else 0)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
