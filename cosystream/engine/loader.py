"""Build our models from a validated checkpoint and move them to the engine's device and dtype."""

from __future__ import annotations

import torch

from cosystream.checkpoint import Checkpoint, check_and_load
from cosystream.engine.load_log import logged_load
from cosystream.engine.meta_init import weights_left_uninitialized
from cosystream.errors import CheckpointError
from cosystream.models.qwen2 import SpeechLM, convert_official_state


def _require_cosyvoice2(ckpt: Checkpoint) -> None:
    if ckpt.family != "cosyvoice2":
        raise CheckpointError(f"{ckpt.files.yaml.name}: the CosyVoice2 runners cannot load a {ckpt.family} model "
                              "(use cosystream.engine.cv3_loader)")


@logged_load("speech LM (llm.pt)")
def load_llm(ckpt: Checkpoint, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
             ) -> SpeechLM:
    _require_cosyvoice2(ckpt)
    dims = ckpt.hparams.llm
    with torch.device("meta"), weights_left_uninitialized():  # no torch._dynamo/Triton import (meta_init.py)
        model = SpeechLM(dims)
    model = model.to_empty(device="cpu")
    check_and_load(model, convert_official_state(ckpt.llm_state(), dims), "llm.pt")
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


@logged_load("flow (flow.pt)")
def load_flow(ckpt: Checkpoint, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    from cosystream.models.flow import Flow

    _require_cosyvoice2(ckpt)
    model = Flow(ckpt.hparams.flow)
    check_and_load(model, ckpt.flow_state(), "flow.pt")
    noise = model.decoder.rand_noise.clone()
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    # PARITY: the ODE noise stays float32 whatever the compute dtype (spec/flow.md §4).
    model.decoder.rand_noise = noise.to(device)
    model.decoder.estimator.fuse_projections()
    model.encoder.fuse_projections()
    return model


@logged_load("vocoder (hift.pt)")
def load_hift(ckpt: Checkpoint, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    from cosystream.models.hift import HiFTGenerator

    _require_cosyvoice2(ckpt)
    model = HiFTGenerator(ckpt.hparams.hift)
    check_and_load(model, ckpt.hift_state(), "hift.pt")
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
