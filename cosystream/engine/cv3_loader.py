"""Build the CosyVoice3 models from a `Checkpoint` with strict key checks (spec/cosyvoice3.md §1)."""

from __future__ import annotations

from pathlib import Path

import torch

from cosystream.checkpoint import Checkpoint, check_and_load
from cosystream.checkpoint.hparams import CV3HParams
from cosystream.checkpoint.weights import fold_weight_norm, load_state_dict
from cosystream.errors import CheckpointError
from cosystream.models.cosyvoice3.flow import CV3Flow
from cosystream.models.cosyvoice3.hift import CausalHiFT
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
    check_and_load(model, load_hift_state(ckpt.files.hift), "hift.pt")
    f0_state = {k: v.clone() for k, v in model.f0_predictor.state_dict().items()}
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    # PARITY: the official casts the F0 predictor (weight norm included) to float64 in place; the float64
    # weights folded above are restored after the move, not re-widened from the model dtype.
    model.f0_predictor.double().load_state_dict(f0_state)
    model.init_noise(noise_seconds)
    return model


def load_hift_state(path: Path) -> dict[str, torch.Tensor]:
    """hift.pt with `generator.` removed and weight norms folded: in float64 for the F0 predictor (the
    official casts that module, parametrisation included, to float64), float32 elsewhere."""
    raw = {k.replace("generator.", ""): v for k, v in load_state_dict(path).items()}
    f0 = {k: v.double() for k, v in raw.items() if k.startswith("f0_predictor.")}
    rest = {k: v for k, v in raw.items() if not k.startswith("f0_predictor.")}
    out = fold_weight_norm(rest)
    out.update(_fold_double(f0))
    return out


def _fold_double(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    g_suffix, v_suffix = ".parametrizations.weight.original0", ".parametrizations.weight.original1"
    for key, value in state.items():
        if key.endswith(g_suffix):
            stem = key[: -len(g_suffix)]
            v = state.get(stem + v_suffix)
            if v is None:
                out[key] = value  # the strict load names it
                continue
            norm = v.flatten(1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))
            out[stem + ".weight"] = v * (value / norm)
        elif key.endswith(v_suffix):
            if state.get(key[: -len(v_suffix)] + g_suffix) is None:
                out[key] = value
        else:
            out[key] = value
    return out
