"""The RAS sampling rule (fixtures: sampling.safetensors, manifest sampling)."""

from __future__ import annotations

import math

import pytest
import torch

from cosystream.models.sampling import (
    SamplingBatch,
    hash_uniform,
    nucleus_candidates,
    ras_sample_reference,
    sample_tokens,
)

EOS = 6561


def _batch(n: int, params: dict, history: list[int], seeds: torch.Tensor | None = None,
           steps: int = 1000) -> SamplingBatch:
    hist = torch.full((n, max(params["win_size"], 1)), -1, dtype=torch.int64)
    tail = history[-params["win_size"]:]
    if tail:
        hist[:, -len(tail):] = torch.tensor(tail)
    return SamplingBatch(
        seeds=seeds if seeds is not None else torch.arange(n, dtype=torch.int64),
        steps=torch.full((n,), steps, dtype=torch.int64),
        min_len=torch.zeros(n, dtype=torch.int64),
        top_p=torch.full((n,), params["top_p"]),
        top_k=torch.full((n,), params["top_k"], dtype=torch.int64),
        repeat_threshold=torch.full((n,), params["win_size"] * params["tau_r"]),
        window=torch.full((n,), params["win_size"], dtype=torch.int64),
        history=hist,
        forced=torch.full((n,), -1, dtype=torch.int64),
        greedy=torch.zeros(n, dtype=torch.bool),
        ban_special=torch.zeros(n, dtype=torch.bool),
    )


@pytest.mark.parity
@pytest.mark.parametrize("case", range(4))
def test_nucleus_candidate_set(case, load_fixture, manifest):
    f, params = load_fixture("sampling"), manifest["sampling"]["ras_params"]
    logp = f[f"nucleus_case{case}_logp"]
    ids, vals, keep = nucleus_candidates(logp.softmax(-1).unsqueeze(0), torch.tensor([params["top_p"]]),
                                         torch.tensor([params["top_k"]]))
    assert ids[0][keep[0]].tolist() == f[f"nucleus_case{case}_ids"].tolist()
    torch.testing.assert_close(vals[0][keep[0]], f[f"nucleus_case{case}_probs"], atol=1e-7, rtol=1e-6)


@pytest.mark.parity
def test_reference_rule_reproduces_official_draws(load_fixture, manifest):
    f, info = load_fixture("sampling"), manifest["sampling"]
    p = info["ras_params"]
    for name, case in info["ras_cases"].items():
        got = []
        for seed in range(len(case["torch_seeded_outputs_seed0_19"])):
            torch.manual_seed(seed)
            got.append(ras_sample_reference(f["ras_peaked_logp"].clone(), case["history"], p["top_p"], p["top_k"],
                                            p["win_size"], p["tau_r"]))
        assert got == case["torch_seeded_outputs_seed0_19"], name


@pytest.mark.parity
def test_batched_sampler_fallback_rule(load_fixture, manifest):
    """The fast sampler fires the repetition fallback exactly when the official rule does."""
    f, info = load_fixture("sampling"), manifest["sampling"]
    p, top = info["ras_params"], info["peaked_top_id"]
    n = 2000
    for name, case in info["ras_cases"].items():
        batch = _batch(n, p, case["history"])
        tokens = sample_tokens(f["ras_peaked_logp"].expand(n, -1).clone(), batch, EOS)
        if case["fallback_expected"]:
            assert top not in tokens.tolist(), name
            # the fallback draws from the recorded full distribution with the top id excluded
            probs = f["ras_fallback_probs"]
            common = probs.argmax().item()
            freq = (tokens == common).float().mean().item()
            assert abs(freq - probs[common].item()) < 4 * (probs[common].item() / n) ** 0.5 + 0.01, name
        else:
            assert (tokens == top).float().mean().item() > 0.8, name


@pytest.mark.parity
def test_batched_sampler_matches_candidate_distribution(load_fixture, manifest):
    f, p = load_fixture("sampling"), manifest["sampling"]["ras_params"]
    n = 4000
    logp = f["nucleus_case3_logp"]
    tokens = sample_tokens(logp.expand(n, -1).clone(), _batch(n, p, []), EOS)
    ids, probs = f["nucleus_case3_ids"], f["nucleus_case3_probs"]
    assert set(tokens.tolist()) <= set(ids.tolist())
    expected = probs / probs.sum()
    observed = torch.stack([(tokens == i).float().mean() for i in ids])
    assert (observed - expected).abs().max().item() < 0.03


def test_eos_masked_below_min_len_and_forced_tokens():
    logp = torch.full((3, 6564), -30.0)
    logp[:, EOS] = 0.0
    batch = _batch(3, {"top_p": 0.8, "top_k": 25, "win_size": 10, "tau_r": 0.1}, [])
    batch.steps = torch.tensor([0, 5, 5])
    batch.min_len = torch.tensor([2, 2, 2])
    batch.forced = torch.tensor([-1, -1, 42])
    tokens = sample_tokens(logp, batch, EOS)
    assert tokens[0].item() != EOS and tokens[1].item() == EOS and tokens[2].item() == 42


def test_ban_special_masks_every_stop_class_below_min_len():
    logp = torch.full((2, 6564), -30.0)
    logp[:, 6561:] = 0.0
    batch = _batch(2, {"top_p": 0.8, "top_k": 25, "win_size": 10, "tau_r": 0.1}, [])
    batch.min_len, batch.steps = torch.tensor([5, 5]), torch.tensor([0, 0])
    batch.ban_special = torch.tensor([False, True])
    tokens = sample_tokens(logp, batch, EOS).tolist()
    assert tokens[0] in (6562, 6563) and tokens[1] < EOS


def test_draws_depend_only_on_seed_and_step():
    seeds, steps = torch.tensor([7, 8, 7]), torch.tensor([3, 3, 3])
    u = hash_uniform(seeds, steps, 1, 100)
    assert torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])
    assert u.min().item() > 0.0 and u.max().item() < 1.0
    big = hash_uniform(torch.arange(200), torch.zeros(200, dtype=torch.int64), 1, 500)
    assert abs(big.mean().item() - 0.5) < 0.01 and abs(big.var().item() - 1 / 12) < 0.005


def _history_with_top_at(top: int, back: int, width: int, copies: int) -> list[int]:
    """`width` tokens, newest last: `top` exactly `back` steps back, `copies - 1` more at the newest positions,
    every other token distinct from `top`."""
    history = [(top + 1 + i) % EOS for i in range(width)]
    history = [t if t != top else (t + width + 1) % EOS for t in history]
    history[width - back] = top
    for i in range(1, copies):
        history[width - i] = top
    return history


@pytest.mark.parity
@pytest.mark.parametrize("extra_width", [0, 2])  # history exactly the window, or wider (a batch's max window)
def test_repeat_exactly_win_size_back_counts_and_one_further_does_not(load_fixture, manifest, extra_width):
    """The window's oldest step is inside it: with the needed repeats, the oldest exactly win_size steps back,
    the official rule falls back; moved one step further back, it does not. Both samplers agree."""
    f, info = load_fixture("sampling"), manifest["sampling"]
    p, top = info["ras_params"], info["peaked_top_id"]
    win = p["win_size"]
    copies = max(1, math.ceil(win * p["tau_r"]))  # the fewest repeats that trigger the fallback
    assert copies <= win, "the set's RAS parameters never fall back"
    n = 500
    for back, fallback in ((win, True), (win + 1, False)):
        history = _history_with_top_at(top, back, win + 1 + extra_width, copies)
        in_window = history[-win:]
        assert in_window.count(top) == (copies if fallback else copies - 1)
        reference = []
        for seed in range(20):
            torch.manual_seed(seed)
            reference.append(ras_sample_reference(f["ras_peaked_logp"].clone(), history, p["top_p"], p["top_k"],
                                                  win, p["tau_r"]))
        batch = _batch(n, p, [])
        batch.history = torch.tensor(history[-(win + extra_width):]).expand(n, -1).clone()
        tokens = sample_tokens(f["ras_peaked_logp"].expand(n, -1).clone(), batch, EOS).tolist()
        if fallback:
            assert top not in reference and top not in tokens, back
        else:
            assert reference.count(top) > 10 and tokens.count(top) > 0.8 * n, back
