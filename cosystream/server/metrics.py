"""Prometheus metrics of the server: request outcomes, latencies per stage, RTF, load and engine stats.

Each app has its own registry (tests start several apps in one process). Engine gauges are read
at scrape time from `engine.stats()` when the engine has it, else from `engine.core` attributes;
admission gauges likewise from the server's Admission (server/admission.py); the engine scheduler's
deadline misses, admission decisions and first-audio predictions as labelled counters.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cosystream.outputs import StageTimes

log = logging.getLogger("cosystream.server")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# StageTimes field → `stage` label of cosystream_stage_seconds
STAGES = {"queue_s": "queue", "frontend_s": "frontend", "llm_prefill_s": "llm_prefill",
          "first_token_s": "first_token", "first_chunk_ready_s": "first_chunk_ready",
          "first_chunk_start_s": "first_chunk_start", "first_chunk_flow_s": "first_chunk_flow",
          "first_chunk_vocoder_s": "first_chunk_vocoder", "first_audio_s": "first_audio", "total_s": "total"}
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0,
                     30.0, 60.0)
REFUSAL_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
ERROR_BUCKETS_S = (-1.0, -0.5, -0.25, -0.1, -0.05, -0.025, 0.0, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)


class ServerMetrics:
    def __init__(self, engine: Any, admission: Any = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("cosystream_requests", "finished synthesis requests by endpoint and outcome "
                                "(ok, cancelled, or the error code)", ["endpoint", "outcome"], registry=r)
        self.first_audio = Histogram("cosystream_first_audio_seconds", "request arrival to first audio bytes "
                                     "handed to the connection", ["endpoint"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.stages = Histogram("cosystream_stage_seconds", "engine time per stage of each finished request",
                                ["stage"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.rtf = Histogram("cosystream_rtf", "real-time factor (engine total time / audio seconds)",
                             buckets=RTF_BUCKETS, registry=r)
        self.audio_seconds = Counter("cosystream_audio_seconds", "seconds of audio produced", registry=r)
        self.active_streams = Gauge("cosystream_active_streams", "synthesis responses being streamed now",
                                    ["endpoint"], registry=r)
        self.refusal = Histogram("cosystream_refusal_seconds", "request arrival to the start of a 503/429 "
                                 "refusal being written (admission's answer time at the server)", ["status"],
                                 buckets=REFUSAL_BUCKETS_S, registry=r)
        self.first_audio_error = Histogram(
            "cosystream_first_audio_prediction_error_seconds", "measured minus predicted first audio of each "
            "admitted request (positive: admission was optimistic)", buckets=ERROR_BUCKETS_S, registry=r)
        self.unauthorized = Counter("cosystream_unauthorized", "requests refused for a missing or wrong API key",
                                    registry=r)
        r.register(_EngineCollector(engine))
        r.register(_SchedulerCollector(engine))
        if admission is not None:
            r.register(_AdmissionCollector(admission))

    def observe_done(self, endpoint: str, times: StageTimes | None, server_first_audio_s: float | None) -> None:
        if server_first_audio_s is not None:
            self.first_audio.labels(endpoint).observe(server_first_audio_s)
        if times is None:
            return
        for field, stage in STAGES.items():
            value = getattr(times, field, None)
            if isinstance(value, (int, float)):
                self.stages.labels(stage).observe(value)
        predicted = getattr(times, "predicted_first_audio_s", None)
        if isinstance(predicted, (int, float)) and times.first_audio_s > 0:
            self.first_audio_error.observe(times.first_audio_s - predicted)
        audio_s = getattr(times, "audio_s", 0.0)
        if audio_s > 0:
            self.audio_seconds.inc(audio_s)
            self.rtf.observe(times.total_s / audio_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def engine_stats(engine: Any) -> dict[str, float]:
    """Numeric engine stats: `engine.stats()` if it exists, else what `engine.core` exposes."""
    stats_fn = getattr(engine, "stats", None)
    if callable(stats_fn):
        try:
            raw = stats_fn()
        except Exception as exc:  # a scrape must never fail because of the engine
            log.warning("event=engine_stats_failed error=%r", exc)
            raw = {}
    else:
        core = getattr(engine, "core", None)
        raw = {"num_active": getattr(core, "num_active", None), "queue_depth": getattr(core, "queue_depth", None)}
    # a key becomes part of a metric name: anything but letters, digits and underscores would make the
    # scrape fail, so it turns into an underscore
    return {_METRIC_UNSAFE.sub("_", k): float(v) for k, v in raw.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


_METRIC_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


class _EngineCollector(Collector):
    """Gauges `cosystream_engine_<key>` for every numeric entry of engine_stats (read at scrape time)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for key, value in sorted(engine_stats(self.engine).items()):
            yield GaugeMetricFamily(f"cosystream_engine_{key}", f"engine stat {key} (engine.stats())", value=value)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # values come from the engine at scrape time; nothing to pre-declare


class _AdmissionCollector(Collector):
    """Gauge of the server's admission: synthesis streams admitted and not finished."""

    def __init__(self, admission: Any) -> None:
        self.admission = admission

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("cosystream_admission_in_flight", "synthesis streams admitted and not finished",
                                value=self.admission.num_in_flight)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


_MISS = re.compile(r"deadline_miss(es|_seconds)_(first|later|final)_(lm|token2wav)")


class _SchedulerCollector(Collector):
    """The engine scheduler's counters (engine/scheduler.py), from engine_stats at scrape time:
    cosystream_deadline_misses_total / cosystream_deadline_miss_seconds_total {kind, stage} (chunks delivered
    after their playback deadline, and by how much), cosystream_admission_total {decision} (admitted,
    refused), cosystream_admission_refusals_total {rule} (debt, budget, deadlines: scheduler.Rule), and
    cosystream_first_audio_{predicted,measured}_seconds_total with
    cosystream_first_audio_predictions_total (their ratio shows when the cost model is off)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = engine_stats(self.engine)
        misses = CounterMetricFamily("cosystream_deadline_misses", "chunks delivered after their playback deadline",
                                     labels=["kind", "stage"])
        late = CounterMetricFamily("cosystream_deadline_miss_seconds", "seconds late of the chunks that missed",
                                   labels=["kind", "stage"])
        for key, value in stats.items():
            match = _MISS.fullmatch(key)
            if match:
                (misses if match.group(1) == "es" else late).add_metric([match.group(2), match.group(3)], value)
        yield misses
        yield late
        if "admission_admitted" in stats:
            decisions = CounterMetricFamily("cosystream_admission", "new streams by the engine's admission decision",
                                            labels=["decision"])
            decisions.add_metric(["admitted"], stats["admission_admitted"])
            decisions.add_metric(["refused"], stats.get("admission_refused", 0.0))
            yield decisions
            by_rule = CounterMetricFamily("cosystream_admission_refusals", "new streams the engine's admission "
                                          "refused, by the rule that refused them", labels=["rule"])
            for key, value in stats.items():
                if key.startswith("admission_refused_"):
                    by_rule.add_metric([key.removeprefix("admission_refused_")], value)
            yield by_rule
        for name, help_text in (("predicted", "admission's predicted first audio, summed over admitted requests"),
                                ("measured", "measured first audio of the requests with a prediction, summed")):
            key = f"first_audio_{name}_seconds"
            if key in stats:
                yield CounterMetricFamily(f"cosystream_first_audio_{name}_seconds", help_text, value=stats[key])
        if "first_audio_predictions" in stats:
            yield CounterMetricFamily("cosystream_first_audio_predictions", "admitted requests with a prediction",
                                      value=stats["first_audio_predictions"])

    def describe(self) -> Iterator[CounterMetricFamily]:
        return iter(())
