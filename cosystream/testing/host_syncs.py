"""Where the host waited for the GPU: torch's sync debug mode around a block, its warnings collected.

    with recorded_host_syncs() as syncs:
        analyzer.analyse(prompts)
    assert len(syncs) <= 3          # each a warnings.WarningMessage (its filename and lineno: the call site)
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# the text of a sync warning (the mode's one-time notice that it is a prototype is not one)
_SYNC_MESSAGE = "called a synchronizing"


@contextmanager
def recorded_host_syncs() -> Iterator[list[warnings.WarningMessage]]:
    """Yields a list that holds, once the block is done, one warning per host synchronisation inside it."""
    syncs: list[warnings.WarningMessage] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs.extend(w for w in caught if _SYNC_MESSAGE in str(w.message))
