"""Admission control: refuse a new synthesis stream at once when it could not start in time.

Every synthesis request passes `Admission.admit` before it reaches the engine and `release` when it ends
(SynthesisSession does both). Two limits, both off by default (ServerSettings):

* per client: at most `max_per_client` open streams per API key (or remote address) → 429 too_many_streams;
* latency budget: the expected first-audio latency of a new stream must not exceed `budget_s` → 503 overloaded.

The expected latency is an estimate from what the server measures itself (docs/reliability.md):

    expected = service_first_audio + wait,   wait = max(0, in_flight - capacity + 1) * service_time / capacity

`service_first_audio` and `service_time` are moving averages of the engine's own timings of finished
requests, without their queue time (first_audio_s - queue_s and total_s - queue_s); `capacity` is the
engine's LM slot count (EngineConfig.max_streams); `in_flight` the streams this server has admitted and
not yet finished. So a stream that would find a free slot is expected to take what streams take now;
one that would queue also waits for `in_flight - capacity + 1` streams to finish, each slot freeing
after `service_time` on average.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from cosystream.server.errors import ApiError

EWMA_WEIGHT = 0.2  # weight of the newest observation: about the last ten requests count
MIN_RETRY_AFTER_S = 1.0


class Ewma:
    """Exponentially weighted moving average; None until the first observation."""

    def __init__(self, weight: float = EWMA_WEIGHT) -> None:
        self.weight = weight
        self.value: float | None = None

    def observe(self, x: float) -> None:
        if not math.isfinite(x) or x < 0:
            return  # a broken timing must not poison the estimate
        self.value = x if self.value is None else self.value + self.weight * (x - self.value)


class Admission:
    """Live admission figures of one server; methods run on the event loop only (no lock needed)."""

    def __init__(self, budget_s: float | None, max_per_client: int | None, capacity: int | None) -> None:
        self.budget_s = budget_s
        self.max_per_client = max_per_client
        self.capacity = capacity if isinstance(capacity, int) and capacity > 0 else None
        self.num_in_flight = 0
        self.per_client: Counter[str] = Counter()
        self.service_first_audio_s = Ewma()
        self.service_s = Ewma()

    def expected_first_audio_s(self) -> float | None:
        """The expected first-audio latency of a stream admitted now (engine side); None before any data."""
        first_audio_s = self.service_first_audio_s.value
        if first_audio_s is None:
            return None
        return first_audio_s + self.expected_wait_s()

    def expected_wait_s(self) -> float:
        """Expected time until an LM slot is free for one more stream."""
        service_s = self.service_s.value
        if self.capacity is None or service_s is None:
            return 0.0
        num_ahead = self.num_in_flight - self.capacity + 1
        return max(0, num_ahead) * service_s / self.capacity

    def admit(self, client: str) -> None:
        """Count one more stream of `client`, or raise ApiError 429 / 503 (with Retry-After) and count nothing."""
        if self.max_per_client is not None and self.per_client[client] >= self.max_per_client:
            retry_s = max(MIN_RETRY_AFTER_S, self.service_s.value or MIN_RETRY_AFTER_S)
            raise ApiError(429, "too_many_streams", f"client: {self.per_client[client]} streams open, the limit "
                           f"per client is {self.max_per_client}", retry_after_s=retry_s)
        expected_s = self.expected_first_audio_s()
        # An idle server always admits: refusing would teach the estimate nothing and help no one.
        if self.budget_s is not None and expected_s is not None and self.num_in_flight > 0 \
                and expected_s > self.budget_s:
            retry_s = max(MIN_RETRY_AFTER_S, expected_s - self.budget_s)
            raise ApiError(503, "overloaded", f"expected first audio in {expected_s:.2f} s, over the budget of "
                           f"{self.budget_s:g} s ({self.num_in_flight} streams in flight); retry later",
                           retry_after_s=retry_s)
        self.num_in_flight += 1
        self.per_client[client] += 1

    def release(self, client: str) -> None:
        self.num_in_flight -= 1
        self.per_client[client] -= 1
        if self.per_client[client] <= 0:
            del self.per_client[client]  # the table holds clients with open streams only

    def observe(self, times: Any) -> None:
        """Learn from a finished request's engine timings (outputs.StageTimes)."""
        queue_s = float(getattr(times, "queue_s", 0.0) or 0.0)
        first_audio_s = getattr(times, "first_audio_s", None)
        total_s = getattr(times, "total_s", None)
        if isinstance(first_audio_s, (int, float)) and first_audio_s > 0:
            self.service_first_audio_s.observe(first_audio_s - queue_s)
        if isinstance(total_s, (int, float)) and total_s > 0:
            self.service_s.observe(total_s - queue_s)
