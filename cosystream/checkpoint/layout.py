"""The official release layouts of CosyVoice2 and CosyVoice3 model directories (spec/checkpoints.md §1).

As the official `AutoModel` does, the family is chosen by the yaml's file name: `cosyvoice3.yaml`
selects CosyVoice3 (spec/cosyvoice3.md §1), `cosyvoice2.yaml` CosyVoice2.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cosystream.errors import CheckpointError

# What each required file holds, for error messages.
REQUIRED_FILES: dict[str, str] = {
    "cosyvoice2.yaml": "the model's HyperPyYAML hyper-parameters",
    "llm.pt": "the Qwen2LM state dict (torch.save)",
    "flow.pt": "the CausalMaskedDiffWithXvec state dict (torch.save)",
    "hift.pt": "the HiFTGenerator state dict (torch.save)",
    "campplus.onnx": "the CAM++ speaker-embedding ONNX model",
    "speech_tokenizer_v2.onnx": "the speech tokenizer v2 ONNX model",
    "CosyVoice-BlankEN/config.json": "the Qwen2 backbone config",
    "CosyVoice-BlankEN/vocab.json": "the Qwen2 BPE vocabulary",
    "CosyVoice-BlankEN/merges.txt": "the Qwen2 BPE merges",
}

REQUIRED_FILES_CV3: dict[str, str] = {
    "cosyvoice3.yaml": "the model's HyperPyYAML hyper-parameters",
    "llm.pt": "the CosyVoice3LM state dict (torch.save)",
    "flow.pt": "the CausalMaskedDiffWithDiT state dict (torch.save)",
    "hift.pt": "the CausalHiFTGenerator state dict (torch.save)",
    "campplus.onnx": "the CAM++ speaker-embedding ONNX model",
    "speech_tokenizer_v3.onnx": "the speech tokenizer v3 ONNX model",
    "CosyVoice-BlankEN/config.json": "the Qwen2 backbone config",
    "CosyVoice-BlankEN/vocab.json": "the Qwen2 BPE vocabulary",
    "CosyVoice-BlankEN/merges.txt": "the Qwen2 BPE merges",
}

# yaml name -> (family, required files, speech tokenizer file)
_FAMILIES = {
    "cosyvoice2.yaml": ("cosyvoice2", REQUIRED_FILES, "speech_tokenizer_v2.onnx"),
    "cosyvoice3.yaml": ("cosyvoice3", REQUIRED_FILES_CV3, "speech_tokenizer_v3.onnx"),
}


@dataclass(frozen=True)
class ModelFiles:
    """Paths of every file of one model directory that cosystream reads."""

    root: Path
    yaml: Path
    llm: Path
    flow: Path
    hift: Path
    campplus: Path
    speech_tokenizer: Path
    tokenizer_dir: Path
    spk2info: Path | None
    family: str = "cosyvoice2"  # "cosyvoice2" or "cosyvoice3"


def locate_model_files(model_dir: str | Path) -> ModelFiles:
    """Check that `model_dir` has a CosyVoice2 or CosyVoice3 release layout; name the first missing file otherwise.

    A directory holding cosyvoice2.yaml is CosyVoice2 (as in the official `AutoModel`, which tests
    for cosyvoice2.yaml before cosyvoice3.yaml); one holding only cosyvoice3.yaml is CosyVoice3.
    """
    root = Path(model_dir).expanduser()
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory (expected a CosyVoice2 or CosyVoice3 model directory)")
    yaml_name = "cosyvoice3.yaml" if (root / "cosyvoice3.yaml").is_file() and not (
        root / "cosyvoice2.yaml").is_file() else "cosyvoice2.yaml"
    family, required, tokenizer_file = _FAMILIES[yaml_name]
    for rel, what in required.items():
        path = root / rel
        if not path.is_file():
            raise CheckpointError(f"{rel}: missing from {root} (expected {what})")
        if path.stat().st_size == 0:
            raise CheckpointError(f"{rel}: empty file in {root} (expected {what})")
    spk2info = root / "spk2info.pt"
    return ModelFiles(
        root=root,
        yaml=root / yaml_name,
        llm=root / "llm.pt",
        flow=root / "flow.pt",
        hift=root / "hift.pt",
        campplus=root / "campplus.onnx",
        speech_tokenizer=root / tokenizer_file,
        tokenizer_dir=root / "CosyVoice-BlankEN",
        spk2info=spk2info if spk2info.is_file() else None,
        family=family,
    )
