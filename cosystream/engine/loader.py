"""Build our models from a validated checkpoint and move them to the engine's device and dtype."""

from __future__ import annotations

import torch

from cosystream.checkpoint import Checkpoint, check_and_load
from cosystream.models.qwen2 import SpeechLM, convert_official_state


def load_llm(ckpt: Checkpoint, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
             ) -> SpeechLM:
    dims = ckpt.hparams.llm
    with torch.device("meta"):
        model = SpeechLM(dims)
    model = model.to_empty(device="cpu")
    check_and_load(model, convert_official_state(ckpt.llm_state(), dims), "llm.pt")
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
