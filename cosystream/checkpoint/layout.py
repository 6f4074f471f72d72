"""The official release layout of a CosyVoice2 model directory (spec/checkpoints.md §1)."""

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


def locate_model_files(model_dir: str | Path) -> ModelFiles:
    """Check that `model_dir` has the CosyVoice2 release layout; name the first missing file otherwise."""
    root = Path(model_dir).expanduser()
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory (expected a CosyVoice2 model directory)")
    if (root / "cosyvoice3.yaml").is_file() and not (root / "cosyvoice2.yaml").is_file():
        raise CheckpointError(f"{root}/cosyvoice3.yaml: CosyVoice3 models are not supported yet")
    for rel, what in REQUIRED_FILES.items():
        path = root / rel
        if not path.is_file():
            raise CheckpointError(f"{rel}: missing from {root} (expected {what})")
        if path.stat().st_size == 0:
            raise CheckpointError(f"{rel}: empty file in {root} (expected {what})")
    spk2info = root / "spk2info.pt"
    return ModelFiles(
        root=root,
        yaml=root / "cosyvoice2.yaml",
        llm=root / "llm.pt",
        flow=root / "flow.pt",
        hift=root / "hift.pt",
        campplus=root / "campplus.onnx",
        speech_tokenizer=root / "speech_tokenizer_v2.onnx",
        tokenizer_dir=root / "CosyVoice-BlankEN",
        spk2info=spk2info if spk2info.is_file() else None,
    )
