"""Speech-token sampling: the official RAS rule (spec/llm.md §6), batched and free of host syncs.

`sample_tokens` draws one token per row with per-row settings. Randomness comes from a counter-based
hash of (request seed, step, candidate), so a request's tokens do not depend on which other requests
share its batch, and the whole step can be replayed inside a CUDA graph. `ras_sample_reference` is a
line-by-line statement of the official rule with torch's global generator, kept for parity tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_K = 64  # static width of the candidate set; per-row top_k may be anything up to this
_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingBatch:
    """Per-row sampling state and settings; every tensor has a leading batch dimension B.

    history [B, W]: the last W generated tokens (-1 = empty), newest last; W = max window in batch.
    """

    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64, tokens generated so far
    min_len: torch.Tensor  # [B] int64, EOS is masked while steps < min_len
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64 (<= MAX_TOP_K)
    repeat_threshold: torch.Tensor  # [B] float32: win_size * tau_r
    window: torch.Tensor  # [B] int64: win_size, at most W
    history: torch.Tensor  # [B, W] int64
    forced: torch.Tensor  # [B] int64, -1 = sample; otherwise emit this token (benchmark mode)
    greedy: torch.Tensor  # [B] bool
    ban_special: torch.Tensor  # [B] bool: below min_len mask every stop class, not only EOS (benchmarks)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer finaliser evaluated in int64 so no product overflows (multipliers < 2^31).
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & _MASK32
    return x ^ (x >> 16)


def hash_uniform(seeds: torch.Tensor, steps: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """Uniform (0, 1) float32 [B, n], a pure function of (seed, step, stream, column)."""
    h = _mix32(seeds & _MASK32)
    h = _mix32(h ^ (steps & _MASK32))
    h = _mix32(h ^ (stream * 0x9E3779B1 & _MASK32))
    cols = torch.arange(n, device=seeds.device, dtype=torch.int64)
    bits = _mix32(_mix32(h.unsqueeze(1) ^ cols) + cols)
    return ((bits >> 8).to(torch.float32) + 0.5) / float(1 << 24)


def _gumbel(seeds: torch.Tensor, steps: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    return -torch.log(-torch.log(hash_uniform(seeds, steps, stream, n)))


def nucleus_candidates(probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The official top-p/top-k candidate set per row: (ids, probs, keep) each [B, MAX_TOP_K].

    An entry is kept while the mass before it is < top_p and fewer than top_k are kept, so the entry
    that crosses top_p is included (spec/llm.md §6 step A).
    """
    k = min(MAX_TOP_K, probs.shape[-1])
    vals, ids = torch.topk(probs, k, dim=-1, sorted=True)
    mass_before = torch.cumsum(vals, dim=-1) - vals
    rank = torch.arange(k, device=probs.device)
    keep = (mass_before < top_p.unsqueeze(1)) & (rank < top_k.unsqueeze(1))
    return ids, vals, keep


def sample_tokens(logp: torch.Tensor, batch: SamplingBatch, eos_token: int) -> torch.Tensor:
    """One token per row [B] int64 from log-probabilities logp [B, V] (float32)."""
    scores = logp.clone()
    below_min = batch.steps < batch.min_len
    scores[:, eos_token] = torch.where(below_min, float("-inf"), scores[:, eos_token])
    others = (below_min & batch.ban_special).unsqueeze(1)
    scores[:, eos_token + 1:] = scores[:, eos_token + 1:].masked_fill(others, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    ids, vals, keep = nucleus_candidates(probs, batch.top_p, batch.top_k)
    g1 = _gumbel(batch.seeds, batch.steps, 1, ids.shape[1])
    pick_scores = torch.where(keep, torch.log(vals) + g1, float("-inf"))
    drawn = ids.gather(1, pick_scores.argmax(dim=1, keepdim=True)).squeeze(1)
    # PARITY: RAS fallback when the drawn token occurs >= win*tau_r times in the recent window;
    # redraw from the full distribution with the drawn token excluded (current official HEAD).
    width = batch.history.shape[1]
    in_window = torch.arange(width, device=logp.device) >= (width - batch.window).unsqueeze(1)
    repeats = ((batch.history == drawn.unsqueeze(1)) & in_window).sum(dim=1).to(torch.float32)
    excluded = scores.scatter(1, drawn.unsqueeze(1), float("-inf"))
    g2 = _gumbel(batch.seeds, batch.steps, 2, scores.shape[1])
    fallback = (excluded + g2).argmax(dim=1)
    token = torch.where(repeats >= batch.repeat_threshold, fallback, drawn)
    token = torch.where(batch.greedy, scores.argmax(dim=1), token)
    return torch.where(batch.forced >= 0, batch.forced, token)


def ras_sample_reference(logp: torch.Tensor, decoded: list[int], top_p: float, top_k: int, win_size: int,
                         tau_r: float) -> int:
    """The official `ras_sampling` on one row with torch's global RNG (for parity tests only)."""
    probs = logp.softmax(dim=0)
    sorted_p, sorted_ids = probs.sort(descending=True, stable=True)
    kept_p, kept_ids, mass = [], [], 0.0
    for p, i in zip(sorted_p.tolist(), sorted_ids.tolist(), strict=True):
        if not (mass < top_p and len(kept_p) < top_k):
            break
        mass += p
        kept_p.append(p)
        kept_ids.append(i)
    top = kept_ids[int(torch.tensor(kept_p).multinomial(1, replacement=True))]
    if sum(t == top for t in decoded[-win_size:]) >= win_size * tau_r:
        scores = logp.clone()
        scores[top] = float("-inf")
        top = int(scores.softmax(dim=0).multinomial(1, replacement=True))
    return top
