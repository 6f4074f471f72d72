"""Run several requests on one engine at once, from plain threads (shared by the engine tests)."""

from __future__ import annotations

import threading
from typing import Any


def synthesize_together(engine: Any, params: list) -> list:
    """Start every request at once; each result is its SynthesisResult or the exception it ended with."""
    results: list = [None] * len(params)

    def work(i: int) -> None:
        try:
            results[i] = engine.synthesize(params[i])
        except Exception as exc:  # the caller asserts on it
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(params))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results
