"""A flow slot given back while the worker runs a batch is back in the pool only when the batch stops: the
cost model learns the slot's hold and its tail after the LM's end from that moment, so admission's prediction
of when slots come back includes the wait for the batch (engine/voicing.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cosystream.engine import voicing
from cosystream.engine.core import EngineCore
from cosystream.engine.scheduler import Scheduler
from cosystream.engine.voicing import Voicing


class _Pool:
    def __init__(self) -> None:
        self.released: list[object] = []

    def release(self, state: object) -> None:
        self.released.append(state)


class _Engine(Voicing):
    """The voicing side's slot bookkeeping over a stand-in pool, with the core's deferral of pool calls."""

    _t2w_later = EngineCore._t2w_later

    def __init__(self, busy: bool) -> None:
        self.t2w = _Pool()
        self.scheduler = Scheduler()
        self._in_flight = [object()] if busy else None
        self._after_batch: list = []
        self._slots_after_batch = 0


@pytest.fixture
def clock(monkeypatch):
    now = SimpleNamespace(t=100.0)
    monkeypatch.setattr(voicing.time, "perf_counter", lambda: now.t)
    return now


def _segment(text_stream: bool = False) -> SimpleNamespace:
    return SimpleNamespace(t_slot=90.0, t_lm_done=99.0, text_stream=text_stream, t2w="state")


def test_a_slot_given_back_during_a_batch_is_measured_when_the_batch_stops(clock):
    engine, seg = _Engine(busy=True), _segment()
    engine._release_later(seg.t2w, engine._slot_released(seg))
    assert engine.t2w.released == [] and engine._slots_after_batch == 1 and seg.t_slot is None
    assert engine.scheduler.cost.slot_tail_s() == 0.0  # nothing learnt before the slot is back
    clock.t = 100.7  # the batch stops
    for fn in engine._after_batch:
        fn()
    assert engine.t2w.released == ["state"]
    assert engine.scheduler.cost.slot_tail_s() == pytest.approx(1.7)  # from the LM's end to the pool
    assert engine.scheduler.cost.slot_hold_s() == pytest.approx(10.7)


def test_a_slot_given_back_to_an_idle_worker_is_back_at_once(clock):
    engine, seg = _Engine(busy=False), _segment()
    engine._release_later(seg.t2w, engine._slot_released(seg))
    assert engine.t2w.released == ["state"] and engine._slots_after_batch == 0
    assert engine.scheduler.cost.slot_tail_s() == pytest.approx(1.0)
    # a text stream's LM ends with its client: its tail says nothing about the worker
    text, seg = _Engine(busy=False), _segment(text_stream=True)
    text._release_later(seg.t2w, text._slot_released(seg))
    assert text.scheduler.cost.slot_tail_s() == 0.0 and text.scheduler.cost.slot_hold_s() == pytest.approx(10.0)
