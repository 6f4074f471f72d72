"""Token -> chunk arithmetic of the streaming schedule (spec/streaming.md §2); pure Python.

A `ChunkPlanner` answers one question per step: given how many speech tokens exist and whether the LM
is done, is a chunk ready, and which tokens does it cover?
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from cosystream.config import ChunkSchedule


@dataclass(frozen=True)
class ChunkPlan:
    """Tokens [offset, offset + num_new) produce this chunk's frames; [offset + num_new, token_end) are
    look-ahead only (empty for the final chunk)."""

    index: int
    offset: int
    num_new: int
    token_end: int
    is_final: bool
    provisional: bool = False  # ends inside an attention block: computed but not kept as final state


class ChunkPlanner:
    def __init__(self, schedule: ChunkSchedule, prompt_len: int, block: int = 25, stream: bool = True,
                 first_hop: int | None = None) -> None:
        self.lookahead = schedule.lookahead
        self.max_hop = schedule.max_hop
        self.growth = schedule.growth
        self.stream = stream
        self.hop = first_hop or schedule.first_hop
        self.prompt_len, self.block = prompt_len, block
        # PARITY: pad the first hop so prompt + first hop ends on an attention-block boundary.
        self.pad = (math.ceil(prompt_len / block) * block - prompt_len) if schedule.pad_prompt else 0
        if (prompt_len + self.hop + self.pad) % block:
            # A short first hop chosen for latency: no padding; the chunk is provisional and every
            # later chunk ends on a block boundary again.
            self.pad = 0
        self.offset = 0
        self.index = 0
        self.finished = False
        self.first_chunk_tokens = self.hop + self.pad + self.lookahead  # tokens the first chunk reads

    @property
    def this_hop(self) -> int:
        if self.offset == 0:
            return self.hop + self.pad
        end = math.ceil((self.prompt_len + self.offset + self.hop) / self.block) * self.block
        return end - self.prompt_len - self.offset

    def tokens_needed(self) -> int:
        """Tokens that must exist before the next non-final chunk is ready."""
        if not self.stream:
            return 1 << 40  # only the final chunk, once the LM is done
        return self.offset + self.this_hop + self.lookahead

    def has_plan(self, available: int, done: bool) -> bool:
        """Would next_plan(available, done) return a chunk? (It does not change the planner.)"""
        return not self.finished and ((self.stream and available >= self.tokens_needed()) or done)

    def next_is_final(self, available: int) -> bool:
        """Would the next plan, once there is one, be the final chunk? (It does not change the planner.)"""
        return not (self.stream and available >= self.tokens_needed())

    def peek_plan(self, available: int, done: bool) -> ChunkPlan | None:
        """The plan next_plan(available, done) would return, leaving this planner as it is."""
        return copy.copy(self).next_plan(available, done)

    def next_plan(self, available: int, done: bool) -> ChunkPlan | None:
        if self.finished:
            return None
        if self.stream and available >= self.tokens_needed():
            provisional = (self.prompt_len + self.offset + self.this_hop) % self.block != 0
            plan = ChunkPlan(self.index, self.offset, self.this_hop, self.tokens_needed(), is_final=False,
                             provisional=provisional)
            self.offset += self.this_hop
            self.hop = min(self.max_hop, int(self.hop * self.growth))
            self.index += 1
            return plan
        if done:
            self.finished = True
            return ChunkPlan(self.index, self.offset, available - self.offset, available, is_final=True)
        return None
