"""What the engine hands back: audio chunks (CPU float32 PCM) and per-request timings."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SAMPLE_RATE = 24000


@dataclass
class StageTimes:
    """Seconds spent per stage of one request (wall clock, measured by the engine thread)."""

    queue_s: float = 0.0  # submitted -> admitted to the LM
    frontend_s: float = 0.0  # text normalisation, tokenisation, prompt audio features
    prompt_s: float = 0.0  # ... of which the voice made ready (a new recording: decoding, analysis, transcript;
    #                        the same recording sent by another request just before: the wait for its analysis)
    prompt_analysis_s: float = 0.0  # ... of which its batched analysis (the wait for its batch included; 0: none)
    llm_prefill_s: float = 0.0
    first_token_s: float = 0.0  # admitted -> first speech token
    first_chunk_ready_s: float = 0.0  # submitted -> the first chunk's tokens all there (the LM's share)
    first_chunk_start_s: float = 0.0  # submitted -> the first chunk's flow batch handed to the worker
    first_chunk_flow_s: float = 0.0
    first_chunk_vocoder_s: float = 0.0
    first_audio_s: float = 0.0  # submitted -> first chunk ready
    total_s: float = 0.0
    num_tokens: int = 0
    audio_s: float = 0.0
    predicted_first_audio_s: float | None = None  # admission's prediction of first_audio_s (None: not predicted)
    predicted_first_chunk_start_s: float | None = None  # ... of first_chunk_start_s (tokens and flow slot there)

    @property
    def rtf(self) -> float:
        return self.total_s / self.audio_s if self.audio_s > 0 else float("inf")

    def as_dict(self) -> dict[str, float]:
        out = {k: round(v, 6) if isinstance(v, float) else v for k, v in self.__dict__.items()}
        out["rtf"] = round(self.rtf, 6) if self.audio_s > 0 else None
        return out


@dataclass
class AudioChunk:
    pcm: np.ndarray  # float32 [num_samples] at sample_rate, in [-1, 1]
    index: int
    is_final: bool = False
    sample_rate: int = SAMPLE_RATE
    times: StageTimes | None = None  # set on the final chunk
    request_id: str = ""


@dataclass
class SynthesisResult:
    pcm: np.ndarray
    sample_rate: int = SAMPLE_RATE
    times: StageTimes = field(default_factory=StageTimes)
    num_chunks: int = 0
