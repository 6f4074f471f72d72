"""One Triton kernel for everything after the speech head in an LM decode step: sample and record.

PERF: the torch path (`models.sampling.sample_tokens`, then the runner's state update and the
non-finite check) is ~190 small kernels per step: log-softmax, masks, softmax, top-k, cumsum, two
counter hashes evaluated op by op, the RAS fallback over the whole vocabulary, the history roll.
Here one program per row does all of it with the row in registers: the nucleus candidates are taken
in descending order by repeated arg-max until top-p or top-k stops them (the loop stops early, so a
step costs a few dozen reductions, not a sort), the RAS fallback's vocabulary-wide hash runs only
for rows whose draw repeats, and the row's state (next input, step count, history, position,
emitted token) is written in place.

Numbers: the same rule and the same counter-based random stream as `sample_tokens` (a token is a
pure function of seed, step and logits), up to float32 rounding of the softmax.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from cosystream.kernels import pdl_launch

STREAM_KEYS = (0x9E3779B1, 0x3C6EF362)  # (stream · 0x9E3779B1) mod 2^32 for hash streams 1 (top-p draw), 2 (RAS)


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton

    from cosystream.kernels import _sample_jit

    return SimpleNamespace(sample_record_kernel=_sample_jit.sample_record_kernel,
                           next_power_of_2=triton.next_power_of_2)


def sample_and_record(logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, min_len: torch.Tensor,
                      top_p: torch.Tensor, top_k: torch.Tensor, repeat_threshold: torch.Tensor, window: torch.Tensor,
                      history: torch.Tensor, forced: torch.Tensor, greedy: torch.Tensor, ban_special: torch.Tensor,
                      active: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, out: torch.Tensor, *,
                      eos: int, max_top_k: int, max_position: int, non_finite_token: int,
                      rows: torch.Tensor | None = None) -> None:
    """Rows [0, B) of a decode step, from the head's logits [B, V] (any float dtype, unit last stride).

    Per row: draw a token as `models.sampling.sample_tokens` does (log-softmax in float32, stop classes
    masked below min_len, top-p/top-k with Gumbel-max, the RAS fallback, greedy, forced); write
    out[b] = token (or `non_finite_token` when the logits hold NaN/inf); and, for active rows only,
    tokens[b] = token, steps[b] += 1, history[b] rolled left with the token appended, and
    positions[b] = min(positions[b] + 1, max_position). The per-row tensors are 1-D of length >= B,
    history [>= B, W] contiguous.

    rows [B] (int64): logits row b goes to state row rows[b] instead (new prompts of a prefill in any cache
    rows); rows[b] < 0 marks a padding row, which writes nothing. The rows must be distinct, and the state
    may have been written by the kernels just before (it is read after the wait for them).
    """
    k = _kernels()
    batch, vocab = logits.shape
    hist_width = history.shape[1]
    assert logits.stride(1) == 1 and history.is_contiguous()
    assert rows is None or (rows.shape == (batch,) and rows.dtype == torch.int64)
    k.sample_record_kernel[(batch,)](
        logits, logits.stride(0), seeds, steps, min_len, top_p, top_k, repeat_threshold, window, history, forced,
        greedy, ban_special, active, tokens, positions, out, out if rows is None else rows, vocab, eos, max_position,
        non_finite_token, STREAM_KEYS[0], STREAM_KEYS[1], HIST=hist_width, MAX_K=min(max_top_k, vocab),
        BLOCK_V=k.next_power_of_2(vocab), BLOCK_H=max(k.next_power_of_2(hist_width + 1), 16),
        HAS_ROWS=rows is not None, num_warps=8, **pdl_launch(logits, early=True))
