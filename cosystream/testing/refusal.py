"""A forced refusal for tests of routing across replicas (ReplicaSpec.engine_hook): the engine of a process
refuses every new stream, as its first-audio budget does when it predicts a late first audio (503 overloaded
with Retry-After), while a marker file for that process exists in the directory named by $COSYSTREAM_REFUSE_DIR.
Only synthesis refuses: the replica's load report stays as it was, as a report published before a burst does.
Without the variable the engine is returned as it is."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from cosystream.errors import Overloaded

REFUSE_DIR_ENV = "COSYSTREAM_REFUSE_DIR"


def refusal_marker(directory: str | Path, pid: int) -> Path:
    """The file whose existence makes the engine of process `pid` refuse."""
    return Path(directory) / f"refuse-{pid}"


class _RefusingEngine:
    def __init__(self, engine: Any, marker: Path) -> None:
        self._engine = engine
        self._marker = marker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def synthesize(self, params: Any) -> AsyncIterator[Any]:
        if self._marker.exists():
            raise Overloaded("overloaded: refusal forced by a test; retry later", retry_after_s=1.0)
        async for chunk in self._engine.synthesize(params):
            yield chunk


def refusing_engine(engine: Any) -> Any:
    """The engine hook: `engine`, refusing while this process's marker exists ($COSYSTREAM_REFUSE_DIR)."""
    directory = os.environ.get(REFUSE_DIR_ENV)
    return engine if not directory else _RefusingEngine(engine, refusal_marker(directory, os.getpid()))
