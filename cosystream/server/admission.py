"""Admission control at the server: the per-client stream limit. The first-audio budget is the engine's.

Every synthesis request passes `Admission.admit` before it reaches the engine and `release` when it ends
(SynthesisSession does both): at most `max_per_client` open streams per API key (or remote address) →
429 too_many_streams (off by default, ServerSettings).

Whether a new stream can start in time is decided by the engine itself (`EngineConfig.first_audio_budget_s`,
`cosystream serve --first-audio-budget-s`): its scheduler predicts the stream's first audio from the
engine's live state and cost model and refuses with `Overloaded`, which every entry point (HTTP, WebSocket)
answers as 503 `overloaded` with Retry-After (docs/reliability.md).
"""

from __future__ import annotations

from collections import Counter

from cosystream.server.errors import ApiError

MIN_RETRY_AFTER_S = 1.0


class Admission:
    """Open streams per client; methods run on the event loop only (no lock needed)."""

    def __init__(self, max_per_client: int | None) -> None:
        self.max_per_client = max_per_client
        self.num_in_flight = 0
        self.per_client: Counter[str] = Counter()

    def admit(self, client: str) -> None:
        """Count one more stream of `client`, or raise ApiError 429 (with Retry-After) and count nothing."""
        if self.max_per_client is not None and self.per_client[client] >= self.max_per_client:
            raise ApiError(429, "too_many_streams", f"client: {self.per_client[client]} streams open, the limit "
                           f"per client is {self.max_per_client}", retry_after_s=MIN_RETRY_AFTER_S)
        self.num_in_flight += 1
        self.per_client[client] += 1

    def release(self, client: str) -> None:
        self.num_in_flight -= 1
        self.per_client[client] -= 1
        if self.per_client[client] <= 0:
            del self.per_client[client]  # the table holds clients with open streams only
