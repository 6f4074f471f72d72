"""LMRunner: the padded (graph-shaped) prefill and slot-batched decode give the tokens of the plain path."""

from __future__ import annotations

import pytest
import torch

from cosystream.engine.lm_runner import LMRunner, RowSampling
from cosystream.engine.loader import load_llm


@pytest.fixture(scope="module")
def lm(checkpoint):
    return load_llm(checkpoint)


def _sampling(seed: int) -> RowSampling:
    return RowSampling(seed=seed, top_p=0.8, top_k=25, win_size=10, tau_r=0.1, min_len=1000, ban_special=True)


def _run(lm, prompts: dict[int, torch.Tensor], steps: int, padded_prefill: bool) -> dict[int, list[int]]:
    runner = LMRunner(lm, max_slots=4, max_len=512, use_graphs=False)
    out = {}
    for slot, prompt in prompts.items():
        runner.set_row_sampling(slot, _sampling(slot))
        out[slot] = [runner._prefill_graphed(slot, prompt) if padded_prefill else runner.prefill(slot, prompt)]
        runner.set_active(slot, True)
    top = max(prompts) + 1
    for _ in range(steps):
        tokens = runner.decode(top, 200)
        for slot in prompts:
            out[slot].append(tokens[slot])
    return out


def test_padded_prefill_and_batched_decode_match_each_stream_alone(lm):
    g = torch.Generator().manual_seed(0)
    prompts = {0: torch.randn(37, lm.dims.hidden_size, generator=g) * 0.5,
               2: torch.randn(70, lm.dims.hidden_size, generator=g) * 0.5}
    together = _run(lm, prompts, steps=6, padded_prefill=True)
    for slot, prompt in prompts.items():
        alone = _run(lm, {slot: prompt}, steps=6, padded_prefill=False)
        assert together[slot] == alone[slot]


def test_prompts_prefilled_together_match_each_stream_alone(lm):
    """One padded replay for prompts of one length bucket (rows beyond them repeat the last prompt)."""
    g = torch.Generator().manual_seed(1)
    lengths = {0: 37, 1: 50, 2: 70, 3: 41}  # 37, 50, 41 share a bucket (3 prompts -> 4 rows); 70 does not
    prompts = {slot: torch.randn(n, lm.dims.hidden_size, generator=g) * 0.5 for slot, n in lengths.items()}
    runner = LMRunner(lm, max_slots=4, max_len=512, use_graphs=False)
    for slot in prompts:
        runner.set_row_sampling(slot, _sampling(slot))
        runner.set_active(slot, True)
    first = runner._prefill_padded(list(prompts.items()))
    together = {slot: [token] for slot, token in zip(prompts, first, strict=True)}
    for _ in range(5):
        tokens = runner.decode(4, 200)
        for slot in prompts:
            together[slot].append(tokens[slot])
    assert runner.positions.tolist() == [n + 5 for n in lengths.values()]
    for slot, prompt in prompts.items():
        assert together[slot] == _run(lm, {slot: prompt}, steps=5, padded_prefill=False)[slot]


def test_idle_rows_keep_their_state(lm):
    """A row that is not decoding (free or parked) is not advanced by other rows' steps."""
    runner = LMRunner(lm, max_slots=3, max_len=256, use_graphs=False)
    runner.set_row_sampling(1, _sampling(1))
    runner.prefill(1, torch.randn(10, lm.dims.hidden_size))
    before = (runner.positions[1].item(), runner.sampling.steps[1].item(), runner.sampling.history[1].clone())
    runner.set_row_sampling(0, _sampling(0))
    runner.prefill(0, torch.randn(12, lm.dims.hidden_size))
    runner.set_active(0, True)
    for _ in range(4):
        runner.decode(2, 40)
    assert runner.positions[1].item() == before[0] and runner.sampling.steps[1].item() == before[1]
    assert torch.equal(runner.sampling.history[1], before[2])


def test_decode_steps_of_more_rows_than_the_prefetch_limit_run_without_it(lm, monkeypatch):
    from cosystream.kernels import prefetch

    monkeypatch.setattr(prefetch, "MAX_ROWS", 2)
    windows = []
    real = lm.decode
    monkeypatch.setattr(lm, "decode", lambda *a: (windows.append(a[-1]), real(*a))[1])
    runner = LMRunner(lm, max_slots=4, max_len=512, use_graphs=False, l2_prefetch_mb=6.0)
    prompt = torch.randn(20, lm.dims.hidden_size, generator=torch.Generator().manual_seed(3)) * 0.5
    for slot in range(4):
        runner.set_row_sampling(slot, _sampling(slot))
        runner.prefill(slot, prompt)
        runner.set_active(slot, True)
    runner.decode(1, 200)  # bucket 1
    runner.decode(2, 200)  # bucket 2
    runner.decode(3, 200)  # bucket 4 > MAX_ROWS
    assert windows == [6.0, 6.0, 0.0]
