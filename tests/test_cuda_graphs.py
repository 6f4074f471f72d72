"""cuda_graphs.capturing: Python's garbage collector is held off for exactly the capture (a collection inside it
can tear down a CUDA graph left in a reference cycle, which a running capture refuses). The capture itself needs
CUDA: here torch.cuda.graph is a stand-in that records what the capture would see."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import pytest
import torch

from cosystream import cuda_graphs


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    calls: list[dict] = []

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global") -> Iterator[None]:
        calls.append({"gc_during": gc.isenabled(), "mode": capture_error_mode, "pool": pool, "stream": stream})
        yield

    monkeypatch.setattr(torch.cuda, "graph", graph)
    return calls


def test_the_collector_is_off_during_the_capture_and_back_on_after(seen: list[dict]) -> None:
    assert gc.isenabled()
    with cuda_graphs.capturing("graph", "pool", "stream"):  # type: ignore[arg-type]
        inside = gc.isenabled()
    assert not inside and gc.isenabled()
    assert seen == [{"gc_during": False, "mode": "thread_local", "pool": "pool", "stream": "stream"}]


def test_a_failed_capture_turns_the_collector_back_on(seen: list[dict]) -> None:
    with pytest.raises(RuntimeError), cuda_graphs.capturing("graph", None, None):  # type: ignore[arg-type]
        raise RuntimeError("capture refused")
    assert gc.isenabled()


def test_a_collector_switched_off_by_the_caller_stays_off(seen: list[dict]) -> None:
    gc.disable()
    try:
        with cuda_graphs.capturing("graph", None, None):  # type: ignore[arg-type]
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
