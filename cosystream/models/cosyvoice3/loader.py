"""Build the CosyVoice3 models from a `Checkpoint` with strict key checks (spec/cosyvoice3.md §1)."""

from __future__ import annotations

import torch

from cosystream.checkpoint import Checkpoint, check_and_load
from cosystream.checkpoint.cosyvoice3 import CV3HParams
from cosystream.errors import CheckpointError
from cosystream.models.cosyvoice3.flow import CV3Flow
from cosystream.models.cosyvoice3.hift import CausalHiFT, load_hift_state
from cosystream.models.cosyvoice3.lm import CosyVoice3LM, convert_official_state


def _hparams(ckpt: Checkpoint) -> CV3HParams:
    if not isinstance(ckpt.hparams, CV3HParams):
        raise CheckpointError(f"{ckpt.files.yaml.name}: not a CosyVoice3 model directory")
    return ckpt.hparams


def load_cv3_llm(ckpt: Checkpoint, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
                 ) -> CosyVoice3LM:
    dims = _hparams(ckpt).llm
    with torch.device("meta"):
        model = CosyVoice3LM(dims)
    model = model.to_empty(device="cpu")
    check_and_load(model, convert_official_state(ckpt.llm_state(), dims), "llm.pt")
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_cv3_flow(ckpt: Checkpoint, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
                  ) -> CV3Flow:
    model = CV3Flow(_hparams(ckpt).flow)
    check_and_load(model, ckpt.flow_state(), "flow.pt")
    noise = model.decoder.rand_noise.clone()
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    # PARITY: the ODE noise stays float32 whatever the compute dtype.
    model.decoder.rand_noise = noise.to(device)
    return model


def load_cv3_hift(ckpt: Checkpoint, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  noise_seconds: float = 300.0) -> CausalHiFT:
    """The causal HiFT; its F0 predictor stays float64 and the fixed source noise covers
    `noise_seconds` of audio (the official table holds 300 s)."""
    hp = _hparams(ckpt)
    model = CausalHiFT(hp.hift)
    model.f0_predictor.double()
    check_and_load(model, load_hift_state(ckpt.files.hift, hp.hift), "hift.pt")
    f0_state = {k: v.clone() for k, v in model.f0_predictor.state_dict().items()}
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    # PARITY: the official casts the F0 predictor (weight norm included) to float64 in place; the float64
    # weights folded above are restored after the move, not re-widened from the model dtype.
    model.f0_predictor.double().load_state_dict(f0_state)
    model.init_noise(noise_seconds)
    return model
