"""Requests of a synchronous `Engine` sent at once from threads, as concurrent clients would (tests)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any


def synthesize_concurrently(engine: Any, params: Sequence[Any], timeout_s: float = 600.0) -> list:
    """`engine.synthesize(p)` for every `p` on a thread of its own, all started together; a result is None
    where its thread raised or did not finish within `timeout_s`."""
    results: list = [None] * len(params)

    def worker(i: int) -> None:
        results[i] = engine.synthesize(params[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(params))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    return results
