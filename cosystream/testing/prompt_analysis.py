"""A stand-in for the torch prompt analyzer that PromptBatcher drives (tests): it answers at once and records
each batch's size."""

from __future__ import annotations

import torch

from cosystream.frontend.audio import PromptAudio
from cosystream.frontend.torch_prompt import PromptAnalysis


class RecordingAnalyzer:
    """Records each batch's size and answers at once: tokens and mel of the prompt's length, an x-vector of the
    prompt's first sample (so a caller can tell its own answer), enough to build voice prompts from."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.device = torch.device("cpu")

    def close(self) -> None:
        pass

    def analyse(self, prompts: list[PromptAudio]) -> list[PromptAnalysis]:
        self.batches.append(len(prompts))
        return [PromptAnalysis(tokens=torch.zeros(p.wav_16k.numel() // 640, dtype=torch.int32),
                               mel=torch.zeros(p.wav_16k.numel() // 320, 80),
                               xvector=torch.full((192,), float(p.wav_16k[0]))) for p in prompts]
