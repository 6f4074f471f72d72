"""Warm-up calibration of the token-to-wave phase costs (engine/calibration.py) on the fixture model."""

from __future__ import annotations

from cosystream.engine.scheduler import CostModel


def test_phase_costs_are_measured_at_two_batch_sizes_and_feed_the_cost_model(engine):
    async_engine = engine.async_engine
    core = async_engine.core
    free_before = async_engine.token2wav.free_slots()
    cost = CostModel()
    core.scheduler, saved = type(core.scheduler)(cost), core.scheduler
    try:
        measured = core.call(async_engine.measure_phase_costs, (1, 2), 10, 100, 1)  # short: CPU time
    finally:
        core.scheduler = saved
    sizes = {1, 2} if free_before is None else {min(n, free_before) for n in (1, 2)}
    assert {key for key in measured} == {(kind, n) for kind in ("first", "chunks") for n in sizes}
    assert all(seconds > 0 for seconds in measured.values())
    # the cost model learnt both kinds from them (timings on a shared CPU are noisy: no exact fit asked)
    for (kind, n), seconds in measured.items():
        assert seconds / 2 < cost.phase_s(kind, n) < 2 * seconds
    assert async_engine.token2wav.free_slots() == free_before  # every calibration stream gave its slot back
