"""The fused sample-and-record kernel draws what `models.sampling.sample_tokens` draws and updates a
decode row's state as `LMRunner` does on the torch path."""

from __future__ import annotations

import pytest
import torch

from cosystream.kernels import sample
from cosystream.models.sampling import MAX_TOP_K, SamplingBatch, hash_uniform, sample_tokens

EOS, VOCAB, WIN, MAX_POS = 200, 203, 10, 99  # a small speech vocabulary: 200 tokens + 3 stop classes
NON_FINITE = -1


def _batch(rows: int, device: str, seed: int) -> tuple[SamplingBatch, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(0, 12, (rows, WIN), generator=g)  # few distinct tokens: RAS fires often
    history[0] = -1  # a fresh stream
    batch = SamplingBatch(
        seeds=torch.randint(-2**62, 2**62, (rows,), generator=g),
        steps=torch.randint(0, 2**33, (rows,), generator=g),  # step counters past 32 bits wrap as in the hash
        min_len=torch.randint(0, 3, (rows,), generator=g) * 2**33,  # a third of rows below min_len
        top_p=torch.rand(rows, generator=g) * 0.9 + 0.05,
        top_k=torch.randint(1, MAX_TOP_K + 1, (rows,), generator=g),
        repeat_threshold=torch.randint(1, 6, (rows,), generator=g).float(),
        window=torch.randint(1, WIN + 1, (rows,), generator=g),
        history=history,
        forced=torch.where(torch.rand(rows, generator=g) < 0.1, 7, -1),
        greedy=torch.rand(rows, generator=g) < 0.1,
        ban_special=torch.rand(rows, generator=g) < 0.5)
    # logits peaked on a few tokens, so top-p stops the candidate loop at different ranks
    logits = torch.randn(rows, VOCAB, generator=g) * 3
    logits[:, :12] += 4 * torch.rand(rows, 12, generator=g)
    batch = SamplingBatch(*(getattr(batch, f).to(device) for f in SamplingBatch.__dataclass_fields__))
    return batch, logits.to(device)


def _state(rows: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"active": (torch.rand(rows, generator=g) < 0.8).to(device),
            "tokens": torch.randint(0, VOCAB, (rows,), generator=g).to(device),
            "positions": torch.randint(0, MAX_POS + 1, (rows,), generator=g).to(device),
            "out": torch.full((rows,), 12345, device=device)}


def _run_kernel(logits: torch.Tensor, b: SamplingBatch, st: dict[str, torch.Tensor]) -> None:
    sample.sample_and_record(logits, b.seeds, b.steps, b.min_len, b.top_p, b.top_k, b.repeat_threshold, b.window,
                             b.history, b.forced, b.greedy, b.ban_special, st["active"], st["tokens"],
                             st["positions"], st["out"], eos=EOS, max_top_k=MAX_TOP_K, max_position=MAX_POS,
                             non_finite_token=NON_FINITE)


def _run_reference(logits: torch.Tensor, b: SamplingBatch, st: dict[str, torch.Tensor]) -> None:
    """LMRunner's torch path: sample_tokens, then the record rule, the non-finite mark and positions."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    token = sample_tokens(logp, b, EOS)
    active = st["active"]
    st["tokens"].copy_(torch.where(active, token, st["tokens"]))
    b.steps.add_(active.long())
    rolled = torch.cat([b.history[:, 1:], token.unsqueeze(1)], dim=1)
    b.history.copy_(torch.where(active.unsqueeze(1), rolled, b.history))
    st["out"].copy_(torch.where(torch.isfinite(logp).all(dim=-1), token, NON_FINITE))
    st["positions"].copy_(torch.clamp(st["positions"] + active.long(), max=MAX_POS))


def _clone(b: SamplingBatch, st: dict[str, torch.Tensor]) -> tuple[SamplingBatch, dict[str, torch.Tensor]]:
    return (SamplingBatch(*(getattr(b, f).clone() for f in SamplingBatch.__dataclass_fields__)),
            {k: v.clone() for k, v in st.items()})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_draws_and_records_as_the_torch_path(device: str, seed: int) -> None:
    rows = 48
    batch, logits = _batch(rows, device, seed)
    logits[3, 17] = float("nan")
    logits[4, 0] = float("inf")
    state = _state(rows, device)
    ref_batch, ref_state = _clone(batch, state)
    _run_kernel(logits, batch, state)
    _run_reference(logits, ref_batch, ref_state)
    assert torch.equal(state["out"], ref_state["out"])
    assert torch.equal(state["positions"], ref_state["positions"])
    assert torch.equal(batch.steps, ref_batch.steps)
    finite = torch.ones(rows, dtype=torch.bool, device=device)
    finite[3:5] = False  # the token drawn for a row with NaN/inf is never used (the request fails)
    assert torch.equal(state["tokens"][finite], ref_state["tokens"][finite])
    assert torch.equal(batch.history[finite], ref_batch.history[finite])
    assert state["out"][3] == NON_FINITE and state["out"][4] == NON_FINITE


def test_kernel_exercises_every_branch(device: str) -> None:
    """The comparison above means something only if rows took the fallback, greedy and forced branches
    and the candidate loop stopped at many different ranks."""
    batch, logits = _batch(48, device, 0)
    logp = torch.log_softmax(logits.float(), dim=-1)
    plain = SamplingBatch(**{**{f: getattr(batch, f) for f in SamplingBatch.__dataclass_fields__},
                             "greedy": torch.zeros_like(batch.greedy), "forced": torch.full_like(batch.forced, -1),
                             "repeat_threshold": torch.full_like(batch.repeat_threshold, 1e9)})
    no_ras = sample_tokens(logp, plain, EOS)
    with_ras = sample_tokens(logp, SamplingBatch(**{**plain.__dict__, "repeat_threshold": batch.repeat_threshold}),
                             EOS)
    assert (no_ras != with_ras).sum() >= 3
    assert batch.greedy.sum() >= 2 and (batch.forced >= 0).sum() >= 2
    sorted_p = torch.softmax(logp, -1).sort(descending=True).values
    stop_rank = ((sorted_p.cumsum(-1) - sorted_p) < batch.top_p.unsqueeze(1)).sum(-1).clamp(max=MAX_TOP_K)
    assert len(set(torch.minimum(stop_rank, batch.top_k).tolist())) >= 8


def test_kernel_noise_is_the_reference_hash(device: str) -> None:
    """Uniform top-p=1 rows: the draw is the arg-max of log p + Gumbel(hash) over the top_k candidates, so
    a wrong bit in the kernel's hash changes the tokens of most rows."""
    rows = 64
    batch, _ = _batch(rows, device, 3)
    logits = torch.zeros(rows, VOCAB, device=device)
    logits[:, :40] = torch.linspace(1.0, 0.0, 40, device=device)  # distinct probabilities, ranks = ids
    batch.top_p.fill_(1.0)
    batch.top_k.fill_(40)
    batch.repeat_threshold.fill_(1e9)
    batch.greedy.zero_()
    batch.forced.fill_(-1)
    state = _state(rows, device)
    ref_batch, ref_state = _clone(batch, state)
    _run_kernel(logits, batch, state)
    _run_reference(logits, ref_batch, ref_state)
    assert torch.equal(state["out"], ref_state["out"])
    assert len(set(state["out"].tolist())) >= 10  # the noise actually moves the draws
    u = hash_uniform(ref_batch.seeds, ref_batch.steps - ref_state["active"].long(), 1, 40)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0


def test_runner_decode_with_the_fused_sampler_gives_the_torch_paths_tokens(checkpoint, device: str) -> None:
    """LMRunner end to end: rows with sampling, RAS and an idle row decode the same tokens and keep the
    same state whether the step ends in the torch sampler or the kernel (interpreter on the CPU)."""
    from cosystream.engine.lm_runner import LMRunner, RowSampling
    from cosystream.engine.loader import load_llm

    lm = load_llm(checkpoint, device)  # float32 on both paths: the same logits reach both samplers
    g = torch.Generator().manual_seed(0)
    prompts = {0: torch.randn(20, lm.dims.hidden_size, generator=g), 2: torch.randn(33, lm.dims.hidden_size,
                                                                                 generator=g)}

    def run(fused: bool) -> tuple[list[list[int]], LMRunner]:
        runner = LMRunner(lm, max_slots=4, max_len=128, use_graphs=False)
        runner.fused_sampler = fused
        for slot, prompt in prompts.items():
            runner.set_row_sampling(slot, RowSampling(seed=slot, top_p=0.8, top_k=25, win_size=10, tau_r=0.1,
                                                      min_len=1000, ban_special=True))
            runner.prefill(slot, prompt)
            runner.set_active(slot, slot == 0)  # row 2 is prefilled but parked
        return [runner.decode(3, 60) for _ in range(8)], runner

    fused_tokens, fused = run(True)
    torch_tokens, plain = run(False)
    assert [t[0] for t in fused_tokens] == [t[0] for t in torch_tokens]
    assert len(set(t[0] for t in fused_tokens)) > 1
    for name in ("tokens", "positions"):
        assert torch.equal(getattr(fused, name), getattr(plain, name)), name
    assert torch.equal(fused.sampling.history, plain.sampling.history)
    assert torch.equal(fused.sampling.steps, plain.sampling.steps)


def test_kernel_with_row_indices_records_into_those_rows_only(device: str) -> None:
    """`rows`: logits row b is drawn and recorded into state row rows[b] (a prefill's new prompts sit in any
    cache rows); rows[b] = -1 is padding and writes nothing; every other row keeps its state."""
    batch, logits = _batch(48, device, 1)
    state = _state(48, device)
    targets = torch.tensor([30, 2, -1, 17, 41, -1], device=device)
    live = targets >= 0
    kernel_batch, kernel_state = _clone(batch, state)
    kernel_state["active"].fill_(True)
    sample.sample_and_record(logits[:6], kernel_batch.seeds, kernel_batch.steps, kernel_batch.min_len,
                             kernel_batch.top_p, kernel_batch.top_k, kernel_batch.repeat_threshold,
                             kernel_batch.window, kernel_batch.history, kernel_batch.forced, kernel_batch.greedy,
                             kernel_batch.ban_special, kernel_state["active"], kernel_state["tokens"],
                             kernel_state["positions"], kernel_state["out"], eos=EOS, max_top_k=MAX_TOP_K,
                             max_position=MAX_POS, non_finite_token=NON_FINITE, rows=targets)
    # the reference: the rows gathered, drawn and recorded as a batch of their own, then put back
    picked = targets[live]
    ref_batch = SamplingBatch(*(getattr(batch, f)[picked].clone() for f in SamplingBatch.__dataclass_fields__))
    ref_state = {k: v[picked].clone() for k, v in state.items()}
    ref_state["active"].fill_(True)
    _run_reference(logits[:6][live], ref_batch, ref_state)
    want_batch, want_state = _clone(batch, state)
    for f in SamplingBatch.__dataclass_fields__:
        getattr(want_batch, f)[picked] = getattr(ref_batch, f)
    for k in ("tokens", "positions", "out"):
        want_state[k][picked] = ref_state[k]
    for f in SamplingBatch.__dataclass_fields__:
        assert torch.equal(getattr(kernel_batch, f), getattr(want_batch, f)), f
    for k in ("tokens", "positions", "out"):
        assert torch.equal(kernel_state[k], want_state[k]), k
    assert not torch.equal(want_state["out"], state["out"])  # the drawn rows did change


def test_runner_prefill_with_the_fused_sampler_gives_the_torch_paths_first_tokens(checkpoint, device: str) -> None:
    """LMRunner's batched prefill (the graph body on CUDA) ends in the sample kernel with row indices: three
    prompts in three cache rows and a padding row draw the torch sampler's first tokens and leave the
    same row state, and the decode steps after them agree too."""
    from cosystream.engine.lm_runner import LMRunner, RowSampling
    from cosystream.engine.loader import load_llm

    lm = load_llm(checkpoint, device)
    g = torch.Generator().manual_seed(1)
    prompts = [(3, torch.randn(21, lm.dims.hidden_size, generator=g)),
               (0, torch.randn(30, lm.dims.hidden_size, generator=g)),
               (2, torch.randn(25, lm.dims.hidden_size, generator=g))]

    def run(fused: bool) -> tuple[list[int], list[list[int]], LMRunner]:
        runner = LMRunner(lm, max_slots=4, max_len=128, use_graphs=False)
        runner.fused_sampler = fused
        for slot, _ in prompts:
            runner.set_row_sampling(slot, RowSampling(seed=slot + 7, top_p=0.8, top_k=25, win_size=10, tau_r=0.1,
                                                      min_len=1000, ban_special=True))
        first = runner._prefill_padded([(slot, p.to(device)) for slot, p in prompts])  # one bucket of 4 rows
        for slot, _ in prompts:
            runner.set_active(slot, True)
        return first, [runner.decode(4, 60) for _ in range(4)], runner

    fused_first, fused_steps, fused = run(True)
    torch_first, torch_steps, plain = run(False)
    assert fused_first == torch_first and fused_steps == torch_steps
    assert len(set(fused_first)) > 1
    for name in ("tokens", "positions"):
        assert torch.equal(getattr(fused, name), getattr(plain, name)), name
    assert torch.equal(fused.sampling.history, plain.sampling.history)
    assert torch.equal(fused.sampling.steps, plain.sampling.steps)
    assert fused.positions[[3, 0, 2]].tolist() == [21 + 4, 30 + 4, 25 + 4]
