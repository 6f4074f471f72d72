"""Open an official CosyVoice2 or CosyVoice3 model directory: layout, hyper-parameters and state dicts.

    ckpt = load_checkpoint("pretrained_models/CosyVoice2-0.5B")
    ckpt.hparams.llm.hidden_size, ckpt.llm_state(), ckpt.flow_state(), ckpt.hift_state()
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cosystream.checkpoint.hparams import (
    CV3HParams,
    EncoderDims,
    EstimatorDims,
    FlowDims,
    HiftDims,
    HParams,
    LLMDims,
    MelDims,
    load_hparams,
    load_hparams_cv3,
)
from cosystream.checkpoint.layout import ModelFiles, locate_model_files
from cosystream.checkpoint.weights import check_and_load, fold_weight_norm, load_state_dict

__all__ = [
    "Checkpoint", "load_checkpoint", "check_and_load", "HParams", "LLMDims", "FlowDims", "HiftDims",
    "MelDims", "EncoderDims", "EstimatorDims", "ModelFiles", "CV3HParams",
]


@dataclass(frozen=True)
class Checkpoint:
    """A validated model directory; state dicts are read lazily (they are large)."""

    files: ModelFiles
    hparams: HParams | CV3HParams

    @property
    def family(self) -> str:
        """"cosyvoice2" or "cosyvoice3" (chosen by the yaml's file name)."""
        return self.files.family

    def llm_state(self) -> dict[str, torch.Tensor]:
        return load_state_dict(self.files.llm)

    def flow_state(self) -> dict[str, torch.Tensor]:
        return load_state_dict(self.files.flow)

    def hift_state(self) -> dict[str, torch.Tensor]:
        """hift.pt with any `generator.` prefix removed and weight norms folded."""
        state = {k.replace("generator.", ""): v for k, v in load_state_dict(self.files.hift).items()}
        return fold_weight_norm(state)


def load_checkpoint(model_dir: str | Path) -> Checkpoint:
    files = locate_model_files(model_dir)
    read = load_hparams_cv3 if files.family == "cosyvoice3" else load_hparams
    return Checkpoint(files=files, hparams=read(files.yaml, files.tokenizer_dir / "config.json"))
