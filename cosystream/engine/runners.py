"""The contract between the engine core and a model family's runners (typed, structural).

The core drives two runners: a speech LM runner (a static KV cache with a row per stream, one batched
decode step at a time, launched ahead and read later) and a token-to-wave runner (token chunks of many
streams to audio, each stream's state opened and released by the core). CosyVoice2's runners are
`lm_runner.LMRunner` and `token2wav.Token2WavRunner`; another model family plugs in by providing the
same methods. Nothing here imports torch's model code: the protocols name behaviour, not classes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from cosystream.engine import faults
from cosystream.engine.chunking import ChunkPlan

# (pcm float32 at 24 kHz, flow seconds, vocoder seconds) of one chunk
ChunkAudio = tuple[np.ndarray, float, float]


class StageWatch(Protocol):
    """Per-stage host and GPU seconds of the token-to-wave batches (engine/stopwatch.py)."""

    def start(self) -> None: ...

    def lap(self, stage: str, tag: str | None = None) -> None: ...

    def stats(self) -> dict[str, float]: ...


class SpeechLMRunner(Protocol):
    """Rows of a static KV cache, one per stream; `launch` queues a decode step of rows [0, num_rows),
    `collect` waits for its tokens (a row not marked active neither advances nor changes)."""

    device: torch.device
    max_slots: int
    max_len: int

    def set_row_sampling(self, slot: int, rs: Any) -> None: ...

    def set_active(self, slot: int, active: bool) -> None: ...

    def set_min_len(self, slot: int, min_len: int) -> None: ...

    def override_last_token(self, slot: int, token: int) -> None: ...

    def prefill(self, slot: int, embeds: torch.Tensor, start_pos: int = 0) -> int: ...

    def prefill_many(self, items: list[tuple[int, torch.Tensor]]) -> list[int]: ...

    def launch(self, num_rows: int, max_position: int) -> Any: ...

    def collect(self, ticket: Any) -> list[int]: ...

    def decode(self, num_rows: int, max_position: int) -> list[int]: ...

    def capture_prefill(self, slot: int, max_positions: int = 512) -> int: ...

    def capture_all(self, max_position: int | None = None) -> int: ...


class SpeechLMDims(Protocol):
    speech_token_size: int
    fill_token: int
    mix_ratio: Any


class TokenFilter(Protocol):
    """Per segment: whether a generated speech token reaches the flow (the LM is fed every token)."""

    def keep(self, token: int) -> bool: ...


class SpeechLMModel(Protocol):
    """What the core reads of the LM itself: prompt embeddings, the embeddings of streamed text, and what
    differs between families (special rows, the text-streaming prompt, the filter of generated tokens)."""

    dims: SpeechLMDims
    text_embedding: torch.nn.Embedding
    fill: int  # the id text streaming forces while it waits for text

    def embed_prompt(self, text_ids: torch.Tensor, prompt_speech_tokens: torch.Tensor,
                     prompt_text_ids: torch.Tensor) -> torch.Tensor: ...

    def special_rows(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def bistream_prompt(self, prompt_text_ids: torch.Tensor, prompt_speech_tokens: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def token_filter(self) -> TokenFilter: ...


class Token2WavRunner(Protocol):
    """Token chunks of many streams to audio. A stream is opened (`start`) before its first chunk, in a
    flow slot when the runner has a pool (`needs_slot`, `free_slots`); `run` voices a batch of chunks;
    `release` gives a stream's slot back. Only one thread calls it at a time."""

    watch: StageWatch
    final_attention: str  # "full": a segment's last chunk is a whole-utterance pass (the official one)
    final_reads_slot: bool  # whether that pass reads the stream's slot (else the slot may go back before it)

    def start(self, inputs: Any, voice_key: str | None, key: Any = None, speed: float = 1.0,
              max_target_tokens: int = 256, seed: int = 0, stored: dict | None = None) -> Any: ...

    def open_streams(self, items: Sequence[dict[str, Any]]) -> list[Any]:
        """The streams a batch opens, each item `start`'s keyword arguments: each stream's state, or the
        exception that kept it from opening (the others open)."""
        ...

    def finished_prompt_passes(self) -> list[tuple[int, float]]:
        """(voices, seconds) of each batched flow pass over new voices' prompts done since the last call."""
        ...

    def run(self, jobs: Sequence[tuple[Any, list[int], ChunkPlan]],
            should_stop: Callable[[], bool] | None = None) -> list[ChunkAudio] | None: ...

    def opened(self) -> None: ...

    def release(self, state: Any) -> None: ...

    def can_start(self, inputs: Any, max_target_tokens: int) -> bool: ...

    def needs_slot(self, inputs: Any, max_target_tokens: int) -> bool: ...

    def free_slots(self) -> int | None: ...

    def flow_slots(self) -> int | None: ...

    def has_prompt(self, voice_key: str | None, stored: dict | None = None) -> bool: ...

    def flow_group(self, st: Any, plan: ChunkPlan) -> Hashable | None: ...

    def forget_voice(self, voice_key: str) -> None: ...

    def slot_gauges(self) -> dict[str, float]: ...


def start_or_error(runner: Token2WavRunner, item: dict[str, Any], device: torch.device, **extra: Any) -> Any:
    """The stream `runner.start(**item, **extra)` opens, or the exception that kept it from opening (its device
    memory released): one stream that cannot open fails alone."""
    try:
        return runner.start(**item, **extra)
    except Exception as e:  # e.g. out of memory building the voice's prompt state
        faults.release_device_memory(e, device)
        return e
