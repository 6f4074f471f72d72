"""Mutable per-request engine state: segments, generated tokens, chunk cursor, timestamps.

Plain Python (no CUDA): the engine thread is the only writer. A request is a list of text segments
synthesised in order; each segment has its own LM run and its own token-to-wave stream, and the
segment after the one being voiced may already be generating tokens (pipelining).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cosystream.engine.chunking import ChunkPlanner
from cosystream.outputs import AudioChunk, StageTimes


class LMStatus(enum.Enum):
    pending = "pending"  # not yet admitted to an LM slot
    decoding = "decoding"
    waiting_text = "waiting_text"  # bistream: needs more text before the next step
    done = "done"


@dataclass
class Segment:
    """One text segment: its model inputs, its speech tokens and its streaming state."""

    inputs: Any  # frontend.ModelInputs
    planner: ChunkPlanner
    min_len: int
    max_len: int
    tokens: list[int] = field(default_factory=list)  # the speech tokens that reach the flow
    generated: int = 0  # speech tokens the LM generated (the length limits count these)
    token_filter: Any = None  # the LM's per-segment filter of what reaches the flow (runners.TokenFilter)
    lm_status: LMStatus = LMStatus.pending
    slot: int = -1
    pos: int = 0  # next LM cache position of this segment's row
    t2w: Any = None  # token2wav stream state, created when the segment starts producing audio
    text_stream: bool = False  # text arrives over time (bistream)
    bistream: Any = None  # its BistreamState, created at admission
    text_backlog: list[int] = field(default_factory=list)  # text ids received before admission
    text_closed: bool = False
    t_row: float | None = None  # when it took its LM row (the cost model's LM hold time)
    t_slot: float | None = None  # when its stream took the flow slot it still holds (the slot hold time)
    t_lm_done: float | None = None  # when its LM finished (the cost model's slot tail: LM done to slot back)

    @property
    def skips_lm(self) -> bool:
        return self.inputs.mode == "vc"


@dataclass
class RequestState:
    request_id: str
    segments: list[Segment]
    sampling: Any  # RowSampling template (seed is per segment)
    emit: Callable[[AudioChunk | BaseException], None]
    voice_key: str | None = None  # registered voice: its prompt caches are reused
    voice_cache: dict | None = None  # the voice's stored flow prompt cache (CPU tensors), if any
    force_tokens: int | None = None
    speed: float = 1.0
    lm_index: int = 0  # the segment the LM works on
    audio_index: int = 0  # the segment being voiced
    chunks_emitted: int = 0
    cancelled: bool = False
    finished: bool = False
    times: StageTimes = field(default_factory=StageTimes)
    t_submit: float = field(default_factory=time.perf_counter)
    t_admit: float | None = None
    t_first_token: float | None = None
    t_first_ready: float | None = None  # when its first chunk's tokens were all there
    predicted_first_audio_s: float | None = None  # admission's prediction (None: not predicted)

    @property
    def lm_segment(self) -> Segment | None:
        return self.segments[self.lm_index] if self.lm_index < len(self.segments) else None

    @property
    def audio_segment(self) -> Segment | None:
        return self.segments[self.audio_index] if self.audio_index < len(self.segments) else None

    @property
    def is_first_chunk(self) -> bool:
        return self.chunks_emitted == 0
