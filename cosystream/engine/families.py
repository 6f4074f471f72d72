"""The one place where a model family picks its runners: the speech LM, its runner and the token-to-wave
runner, built from a validated checkpoint (`Checkpoint.family`, chosen by the yaml's file name).

Everything after this point is family-blind: the core talks to the LM through `runners.SpeechLMModel` (its
special rows, text-streaming prompt and token filter) and to the token-to-wave side through
`runners.Token2WavRunner`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cosystream.checkpoint import Checkpoint
from cosystream.config import EngineConfig
from cosystream.engine.lm_runner import LMRunner
from cosystream.errors import CheckpointError

# (lm, lm runner, token-to-wave runner)
FamilyRunners = tuple[Any, LMRunner, Any]


def _lm_runner(lm: torch.nn.Module, config: EngineConfig) -> LMRunner:
    return LMRunner(lm, config.max_streams, config.max_len, use_graphs=config.cuda_graphs, compile=config.compile,
                    fused_kernels=config.fused_kernels)


def _cosyvoice2(ckpt: Checkpoint, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> FamilyRunners:
    from cosystream.engine.loader import load_flow, load_hift, load_llm
    from cosystream.engine.token2wav import Token2WavRunner

    lm = load_llm(ckpt, device, dtype)
    t2w = Token2WavRunner(load_flow(ckpt, device, dtype), load_hift(ckpt, device, dtype), config)
    return lm, _lm_runner(lm, config), t2w


def _cosyvoice3(ckpt: Checkpoint, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> FamilyRunners:
    from cosystream.engine.cv3_loader import load_cv3_flow, load_cv3_hift, load_cv3_llm
    from cosystream.engine.cv3_token2wav import CV3Token2WavRunner
    from cosystream.engine.load_log import loading

    with loading("speech LM (llm.pt)"):
        lm = load_cv3_llm(ckpt, device, dtype)
    with loading("flow (flow.pt)"):
        flow = load_cv3_flow(ckpt, device, dtype)
    with loading("vocoder (hift.pt) and its source-noise table"):
        hift = load_cv3_hift(ckpt, device, dtype)
    t2w = CV3Token2WavRunner(flow, hift, final_attention=config.final_attention, flow_slots=config.flow_slots,
                             slot_frames=config.flow_frames, cuda_graphs=config.cuda_graphs)
    return lm, _lm_runner(lm, config), t2w


_BUILDERS: dict[str, Callable[[Checkpoint, EngineConfig, torch.device, torch.dtype], FamilyRunners]] = {
    "cosyvoice2": _cosyvoice2,
    "cosyvoice3": _cosyvoice3,
}
FAMILIES = tuple(_BUILDERS)


def build_runners(ckpt: Checkpoint, config: EngineConfig, device: torch.device, dtype: torch.dtype
                  ) -> FamilyRunners:
    """(speech LM, its LMRunner, token-to-wave runner) for the checkpoint's family, on `device` in `dtype`."""
    builder = _BUILDERS.get(ckpt.family)
    if builder is None:
        raise CheckpointError(f"{ckpt.files.yaml.name}: no runners for model family {ckpt.family!r} "
                              f"(supported: {', '.join(FAMILIES)})")
    return builder(ckpt, config, device, dtype)
