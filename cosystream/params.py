"""Per-request settings: what to say, in which voice and mode, and how to sample."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np


class Mode(str, enum.Enum):
    zero_shot = "zero_shot"
    cross_lingual = "cross_lingual"
    instruct2 = "instruct2"
    sft = "sft"
    vc = "vc"


@dataclass(frozen=True)
class SamplingParams:
    """RAS sampling (spec/llm.md §6); None takes the model's yaml value."""

    top_p: float | None = None
    top_k: int | None = None
    win_size: int | None = None
    tau_r: float | None = None
    seed: int | None = None  # None: a random seed per request
    greedy: bool = False  # argmax instead of sampling (deterministic tests)


# Audio given with a request: a file path, the file's bytes, or (samples, sample_rate).
AudioInput = str | bytes | tuple[np.ndarray, int]


@dataclass(frozen=True)
class SynthesisParams:
    # what to say: a string, or an async iterator of text pieces (text streaming in, "bistream")
    text: str | AsyncIterator[str] = ""
    mode: Mode = Mode.zero_shot
    # the voice: a registered name, or a prompt wav with its transcript
    voice: str | None = None
    prompt_audio: AudioInput | None = None
    prompt_text: str = ""
    instruct_text: str = ""  # instruct2: e.g. "用四川话说这句话<|endofprompt|>"
    source_audio: AudioInput | None = None  # vc: the speech to convert
    sft_speaker: str | None = None  # sft: a speaker id of spk2info.pt
    # delivery
    stream: bool = True
    speed: float = 1.0  # non-streaming only (spec/hift.md §6)
    first_hop: int | None = None  # override the engine schedule's first hop (tokens)
    # sampling and benchmarking
    sampling: SamplingParams = field(default_factory=SamplingParams)
    force_tokens: int | None = None  # benchmark mode: generate exactly this many tokens, ignore EOS
    request_id: str | None = None
