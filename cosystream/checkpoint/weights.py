"""Load the `.pt` state dicts of a model directory and check them against a module, key by key.

Weight-normalised convolutions are folded here (spec/checkpoints.md §5) so models only see plain
`weight` tensors.
"""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path

import torch

from cosystream.errors import CheckpointError

_MAX_NAMES = 8


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read a `torch.save`d state dict (tensors only; nothing is unpickled but tensors)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path.name}: missing") from e
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path.name}: cannot be read as a torch.save state dict (truncated or wrong file?): {first_line}"
        ) from e
    if isinstance(state, Mapping) and "state_dict" in state and isinstance(state["state_dict"], Mapping):
        state = state["state_dict"]
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path.name}: expected a state dict (mapping of names to tensors), "
                              f"got {type(state).__name__}")
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{path.name}: entries that are not tensors: {_names(bad)}")
    return dict(state)


def _names(keys: list[str]) -> str:
    shown = ", ".join(sorted(keys)[:_MAX_NAMES])
    more = len(keys) - _MAX_NAMES
    return shown + (f" (and {more} more)" if more > 0 else "")


def fold_weight_norm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace every weight-norm pair (new `parametrizations` or legacy `weight_g/_v`) by `weight`.

    w = g · v / ‖v‖, the norm over every axis but 0, computed in float32.
    """
    out: dict[str, torch.Tensor] = {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    suffixes = {".parametrizations.weight.original0": "g", ".parametrizations.weight.original1": "v",
                ".weight_g": "g", ".weight_v": "v"}
    for key, value in state.items():
        for suffix, role in suffixes.items():
            if key.endswith(suffix):
                pairs.setdefault(key[: -len(suffix)], {})[role] = value
                break
        else:
            out[key] = value
    for stem, pair in pairs.items():
        if set(pair) != {"g", "v"}:
            raise CheckpointError(f"weight norm of `{stem}`: has only {sorted(pair)}, expected both g and v")
        g, v = pair["g"].float(), pair["v"].float()
        norm = v.flatten(1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))
        out[f"{stem}.weight"] = v * (g / norm)  # PARITY: the order torch weight_norm uses
    return out


def check_and_load(module: torch.nn.Module, state: Mapping[str, torch.Tensor], file_name: str) -> None:
    """Load `state` into `module` strictly: every key, every shape, or one error naming the culprits."""
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [f"{k} {tuple(state[k].shape)} (expected {tuple(expected[k].shape)})"
             for k in expected if k in state and state[k].shape != expected[k].shape]
    problems = []
    if missing:
        problems.append(f"missing keys: {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_names(unexpected)}")
    if wrong:
        problems.append(f"wrong shapes: {_names(wrong)}")
    if problems:
        raise CheckpointError(f"{file_name}: does not match the model built from the yaml; " + "; ".join(problems))
    with torch.no_grad():
        for key, target in expected.items():
            target.copy_(state[key].to(target.dtype))
