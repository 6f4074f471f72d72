"""Which weights the decode step's L2 prefetch branch asks for, and when (cosystream.kernels.prefetch; the
kernels themselves and their graphs are checked on a GPU in tests/gpu/test_pdl.py)."""

from __future__ import annotations

import torch

from cosystream.kernels import prefetch, reference

MB = 2**20


def _weights(sizes_mb: list[float]) -> list[torch.Tensor]:
    return [torch.empty(int(mb * MB) // 2, dtype=torch.bfloat16) for mb in sizes_mb]


def _trace(sizes_mb: list[float], window_mb: float) -> tuple[list[torch.Tensor], list[tuple[int, list[int]]]]:
    """(weights, [(the linear about to run, -1 at the start; the weights asked for then)])."""
    weights = _weights(sizes_mb)
    asked: list[tuple[int, list[int]]] = []
    where = {w.data_ptr(): i for i, w in enumerate(weights)}
    position = [-1]
    plan = prefetch._Plan(weights, window_mb * MB,
                          launch=lambda ws: asked.append((position[0], [where[w.data_ptr()] for w in ws])))
    plan.ahead_of(-1)
    for i in range(len(weights)):
        position[0] = i
        plan.ahead_of(i)
    return weights, asked


def test_every_weight_is_asked_for_once_in_reading_order_and_before_its_linear() -> None:
    layer = [2.0, 1.6, 17.4, 8.7]  # CosyVoice2-0.5B's q/k/v, o, gate/up, down
    for window in (0.5, 8.0, 20.0, 64.0):
        _, asked = _trace(layer * 3 + [11.8], window)
        order = [w for _, ws in asked for w in ws]
        assert order == list(range(13))
        for at, ws in asked:
            assert all(w > at for w in ws)  # never the weight of a linear already launched


def test_the_window_bounds_how_far_ahead_weights_are_asked_for() -> None:
    sizes = [2.0, 1.6, 17.4, 8.7] * 3 + [11.8]
    _, asked = _trace(sizes, 20.0)
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    for at, ws in asked:
        first = at + 1
        for w in ws:
            # within the window of the bytes after the running linear, or the very next weight
            assert w == first or starts[w] - starts[first] < 20.0
    # at the start, the first weights up to the window: q/k/v, o and gate/up (3.6 MB before it < 20)
    assert asked[0] == (-1, [0, 1, 2])
    # a tiny window still keeps one weight ahead
    _, asked = _trace(sizes, 0.001)
    assert [ws for _, ws in asked] == [[i] for i in range(13)]


def test_prefetching_is_a_no_op_where_it_cannot_run(monkeypatch) -> None:
    weights = _weights([1.0, 1.0])
    monkeypatch.setattr(prefetch, "WINDOW_MB", 16.0)
    assert not prefetch.usable(weights)  # CPU tensors
    launched = []
    monkeypatch.setattr(prefetch, "_prefetch", launched.append)
    with prefetch.prefetching(weights):
        prefetch.before(weights[0])
    with reference.prefetching(weights):
        pass
    assert launched == []
    monkeypatch.setattr(prefetch, "WINDOW_MB", 0.0)
    assert not prefetch.usable(weights)

