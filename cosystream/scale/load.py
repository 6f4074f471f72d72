"""What one engine replica reports for routing, how the router ranks replicas, and how /metrics is merged.

Plain Python (no Ray import), so the routing policy is tested without a cluster.

A replica reports a `LoadReport`: the engine scheduler's prediction of a new stream's first audio, its streams in
flight, whether it is ready, and the prompts whose features it holds in memory: registered voices (under every
name a client may send for them) and uploaded recordings (by `upload_key`, the digest of the recording and its
transcript, which the proxy computes from a request the same way: scale/proxy.py).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

REPLICA_LABEL = "replica"
MAX_REPORTED_VOICES = 256  # a report names at most this many held voices (it travels every reporting period)
MAX_REPORTED_UPLOADS = 64  # and this many uploaded prompts (the engine keeps 64 analysed)
UPLOAD_KEY_PREFIX = "upload:"  # the proxy hints voice names of A-Z a-z 0-9 _ . - only: no clash with these


def upload_key(digest: str) -> str:
    """The prompt key of an uploaded recording, from the hex digest the engine keys its analysis by."""
    return UPLOAD_KEY_PREFIX + digest


def held_voice_names(voices: Iterable[str], aliases: Iterable[tuple[str, str]] = (),
                     default_voice: str | None = None, default_names: Iterable[str] = ()) -> list[str]:
    """Every name a client may send for a voice held in memory: the voices themselves, the aliases
    (`serve --voice-alias NAME=VOICE`) of held voices and, when the default voice (`serve --default-voice`) is
    held, the names that speak in it (OpenAI's voice names)."""
    held = list(dict.fromkeys(voices))
    known = set(held)
    extra = [name for name, target in aliases if target in known]
    if default_voice is not None and default_voice in known:
        extra += list(default_names)
    return held + [name for name in dict.fromkeys(extra) if name not in known]


@dataclass(frozen=True)
class LoadReport:
    """One replica's view of its own load, as `record_routing_stats` publishes it (JSON-safe via as_dict)."""

    ready: bool = True
    in_flight: int = 0  # synthesis streams admitted and not finished
    capacity: int | None = None  # concurrent LM slots (EngineConfig.max_streams)
    service_first_audio_s: float | None = None  # recent first audio without queueing (None: no data yet)
    service_s: float | None = None  # recent whole-request time without queueing
    budget_s: float | None = None  # the replica's first-audio budget (--first-audio-budget-s)
    voices: tuple[str, ...] = field(default_factory=tuple)  # registered voices held in memory (and their aliases)
    uploads: tuple[str, ...] = field(default_factory=tuple)  # upload_key() of uploaded prompts held analysed
    admits: bool | None = None  # the engine's own verdict on a new stream when reported (None: unknown)
    open_access: bool = False  # no API key required: a proxy may answer a refusal without checking the caller
    reported_at: float | None = None  # time.time() of the report, on the replica's host

    def holds(self, prompt: str) -> bool:
        """Whether this replica holds the prompt features of `prompt` (a voice name or an upload_key)."""
        return prompt in (self.uploads if prompt.startswith(UPLOAD_KEY_PREFIX) else self.voices)

    def expected_first_audio_s(self, in_flight: int | None = None) -> float | None:
        """The first audio a new stream can expect with `in_flight` streams ahead (the admission formula of
        server/admission.py: a free slot costs the service first audio, a full engine adds the wait for
        `in_flight - capacity + 1` slots, each freeing after service_s / capacity on average)."""
        if self.service_first_audio_s is None:
            return None
        n = self.in_flight if in_flight is None else in_flight
        wait_s = 0.0
        if self.capacity and self.service_s is not None:
            wait_s = max(0, n - self.capacity + 1) * self.service_s / self.capacity
        return self.service_first_audio_s + wait_s

    def fits_budget(self, in_flight: int | None = None) -> bool:
        """Whether a new stream would be admitted here: no budget, no data yet, an idle replica, or an
        expected first audio within the budget (the same rule as Admission.admit)."""
        n = self.in_flight if in_flight is None else in_flight
        expected_s = self.expected_first_audio_s(n)
        return self.budget_s is None or expected_s is None or n == 0 or expected_s <= self.budget_s

    def as_dict(self) -> dict[str, Any]:
        return {"ready": self.ready, "in_flight": self.in_flight, "capacity": self.capacity,
                "service_first_audio_s": self.service_first_audio_s, "service_s": self.service_s,
                "budget_s": self.budget_s, "voices": list(self.voices), "uploads": list(self.uploads),
                "admits": self.admits, "open_access": self.open_access, "reported_at": self.reported_at}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> LoadReport | None:
        """The report a replica published, or None when it has published none yet (or an unreadable one)."""
        if not data:
            return None
        try:
            return cls(ready=bool(data.get("ready", True)), in_flight=int(data.get("in_flight", 0)),
                       capacity=_positive_int(data.get("capacity")),
                       service_first_audio_s=_finite(data.get("service_first_audio_s")),
                       service_s=_finite(data.get("service_s")), budget_s=_finite(data.get("budget_s")),
                       voices=tuple(str(v) for v in data.get("voices", ())),
                       uploads=tuple(str(u) for u in data.get("uploads", ())),
                       admits=data["admits"] if isinstance(data.get("admits"), bool) else None,
                       open_access=data.get("open_access") is True, reported_at=_finite(data.get("reported_at")))
        except (TypeError, ValueError):
            return None

    def known_full(self, net_since_report: int | None, now: float, fresh_s: float) -> bool:
        """Whether this report shows for sure that its replica would refuse a new stream at `now`: its engine
        refused one when it reported (busy, with a first-audio budget), less than `fresh_s` ago, and the streams
        the asking proxy sent there since then are at least as many as those that ended there
        (`net_since_report`; None: unknown): its load did not fall. Streams that other proxies sent there and
        that ended are not seen: with several proxies, a refusal can rest on a report up to `fresh_s` old.
        Never for a replica that requires API keys (the caller is checked first, as on one process)."""
        if self.admits is not False or not self.ready or not self.open_access or self.in_flight == 0:
            return False
        if self.budget_s is None or self.reported_at is None or not 0 <= now - self.reported_at <= fresh_s:
            return False
        return net_since_report is not None and net_since_report >= 0


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _positive_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and value > 0 else None


def report_from_server(state: Any, voices: Iterable[str] = (), uploads: Iterable[str] = ()) -> LoadReport:
    """A replica's report from its server state: the engine scheduler's prediction of a new stream's first
    audio (the same model its admission decides from) as the service first audio, with no queue term on top,
    and its verdict on such a stream; `voices` and `uploads` are the prompt keys it holds (most recently used
    last for uploads)."""
    engine = state.engine
    predicted_s, budget_s = None, getattr(getattr(engine, "config", None), "first_audio_budget_s", None)
    admits = None
    predict = getattr(engine, "predict_first_audio", None)
    if callable(predict):
        predicted, admitted = predict()
        predicted_s = predicted if math.isfinite(predicted) else None
        admits = bool(admitted) if budget_s is not None else None
    return LoadReport(ready=state.is_ready and state.engine_error() is None, in_flight=state.admission.num_in_flight,
                      capacity=None, service_first_audio_s=predicted_s, service_s=None, budget_s=budget_s,
                      voices=tuple(voices)[:MAX_REPORTED_VOICES],
                      uploads=tuple(uploads)[-MAX_REPORTED_UPLOADS:], admits=admits,
                      open_access=not state.settings.api_keys, reported_at=time.time())


def every_replica_full(entries: Iterable[tuple[LoadReport | None, Callable[[float], int | None]]], now: float,
                       fresh_s: float) -> bool:
    """Whether a new stream would be refused by every replica (LoadReport.known_full), so a proxy can answer the
    refusal itself: `entries` are (report, streams started minus ended there since a time) per replica; no
    replicas, or one without a report, is never full."""
    entries = list(entries)
    return bool(entries) and all(
        load is not None and load.reported_at is not None and load.known_full(net_since(load.reported_at), now,
                                                                                fresh_s)
        for load, net_since in entries)


def in_flight_now(report: LoadReport | None, open_here: int, net_since_report: int | None) -> int:
    """A replica's streams now, as one router can tell: its last report's count moved on by what this router saw
    start and end there since (`net_since_report`: the StreamLedger of scale/proxy.py), and never fewer than the
    streams this router holds open there (`open_here`). The report alone is up to a reporting period old: in a
    closed loop, where streams end in waves, an old high count would keep new streams off a replica whose streams
    just ended and send them all to the other. Without the ledger reaching back to the report (None), the larger
    of the report's count and `open_here`. Streams other routers sent since the report are not seen, and across
    hosts the report's time (the replica's clock) is off by the two clocks' difference."""
    if report is None:
        return open_here
    if net_since_report is None:
        return max(report.in_flight, open_here)
    return max(open_here, report.in_flight + net_since_report)


def rank_replicas(loads: Mapping[Hashable, LoadReport | None], routed_here: Mapping[Hashable, int] | None = None,
                  voice: str | None = None, in_flight: Mapping[Hashable, int] | None = None,
                  avoid: Collection[Hashable] = ()) -> list[Hashable]:
    """Replica ids, best first, for one new stream.

    A replica's load is `in_flight` (the router's estimate of its streams now, `in_flight_now`; else its
    report's count) or, when larger, `routed_here` (the streams this router sent there that are still open).
    Order: replicas in `avoid` (those that refused this very request) last; then ready replicas before unready
    ones; those that can meet the first-audio budget before those that
    cannot; among those that can, replicas holding `voice` (a voice name or an upload_key: the request's prompt)
    first, then the least loaded (streams per LM slot),
    then the lowest expected first audio; replicas that cannot meet it follow by expected first audio, so when
    none can, the request goes to the one closest to its budget, whose admission refuses it at once
    (503 overloaded with Retry-After). Ties go in random order, so idle replicas share the work. A replica
    without a report yet ranks as idle and ready.
    """
    routed_here = routed_here or {}
    in_flight = in_flight or {}

    def key(replica: Hashable) -> tuple:
        load = loads.get(replica) or LoadReport()
        n = max(in_flight.get(replica, load.in_flight), routed_here.get(replica, 0))
        expected_s = load.expected_first_audio_s(n)
        fits = load.fits_budget(n)
        holds_voice = voice is not None and load.holds(voice)
        expected = expected_s if expected_s is not None else 0.0
        if fits:
            return (replica in avoid, not load.ready, False, not holds_voice, n / (load.capacity or 1), expected,
                    random.random())
        return (replica in avoid, not load.ready, True, False, expected, n / (load.capacity or 1), random.random())

    return sorted(loads, key=key)


# ---------------------------------------------------------------- /metrics across replicas

class _Families(Collector):
    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):  # noqa: ANN201 (prometheus_client's Metric objects)
        return iter(self.families)


def merge_metrics(texts: Mapping[str, str]) -> bytes:
    """Each replica's Prometheus text (replica id → text) as one exposition, every sample labelled
    `replica="<id>"`: families keep one HELP/TYPE and hold the samples of every replica. Sum over the label
    for totals (`sum without (replica) (...)`)."""
    merged: dict[str, Any] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            samples = [sample._replace(labels={REPLICA_LABEL: replica, **sample.labels}) for sample in family.samples]
            target = merged.setdefault(family.name, family)
            if target is family:
                target.samples = samples
            else:
                target.samples.extend(samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
