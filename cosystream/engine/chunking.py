"""Token -> chunk arithmetic of the streaming schedule (spec/streaming.md §2); pure Python.

A `ChunkPlanner` answers one question per step: given how many speech tokens exist and whether the LM
is done, is a chunk ready, and which tokens does it cover?
"""

from __future__ import annotations

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


class ChunkPlanner:
    def __init__(self, schedule: ChunkSchedule, prompt_len: int, block: int = 25, stream: bool = True,
                 first_hop: int | None = None) -> None:
        self.lookahead = schedule.lookahead
        self.max_hop = schedule.max_hop
        self.growth = schedule.growth
        self.stream = stream
        self.hop = first_hop or schedule.first_hop
        # PARITY: pad the first hop so prompt + first hop ends on an attention-block boundary.
        self.pad = (math.ceil(prompt_len / block) * block - prompt_len) if schedule.pad_prompt else 0
        self.offset = 0
        self.index = 0
        self.finished = False

    @property
    def this_hop(self) -> int:
        return self.hop + self.pad if self.offset == 0 else self.hop

    def tokens_needed(self) -> int:
        """Tokens that must exist before the next non-final chunk is ready."""
        if not self.stream:
            return 1 << 40  # only the final chunk, once the LM is done
        return self.offset + self.this_hop + self.lookahead

    def next_plan(self, available: int, done: bool) -> ChunkPlan | None:
        if self.finished:
            return None
        if self.stream and available >= self.tokens_needed():
            plan = ChunkPlan(self.index, self.offset, self.this_hop, self.tokens_needed(), is_final=False)
            self.offset += self.this_hop
            self.hop = min(self.max_hop, int(self.hop * self.growth))
            self.index += 1
            return plan
        if done:
            self.finished = True
            return ChunkPlan(self.index, self.offset, available - self.offset, available, is_final=True)
        return None
