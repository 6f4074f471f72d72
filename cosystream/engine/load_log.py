"""What the engine is loading and how long each part took, as log lines (logger `cosystream.engine`).

A model load takes tens of seconds on a CPU; `serve`, `say` and `voices add` show these lines while it runs.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

log = logging.getLogger("cosystream.engine")

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def loading(part: str) -> Iterator[None]:
    """Log `part` before it loads and its seconds after."""
    quoted = json.dumps(part) if " " in part else part  # key=value lines stay machine-splittable
    log.info("event=loading part=%s", quoted)
    t0 = time.perf_counter()
    yield
    log.info("event=loaded part=%s load_s=%.2f", quoted, time.perf_counter() - t0)


def logged_load(part: str) -> Callable[[F], F]:
    """Decorate a loader so that every call runs inside `loading(part)`."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with loading(part):
                return fn(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap
