"""Write a model directory in the official CosyVoice2 release layout with random weights.

`tiny` uses the golden fixture set's dims (fast tests); `0.5b` the real CosyVoice2-0.5B shapes, so
speed can be measured without the real download. The two ONNX side models are small random
stand-ins with the official input/output conventions (spec/checkpoints.md §7): real ones are
half a gigabyte and only run once per registered voice, outside the hot path.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cosystream.checkpoint.hparams import load_hparams
from cosystream.models.qwen2 import official_keys
from cosystream.testing.onnx_standins import write_campplus, write_speech_tokenizer
from cosystream.testing.release_layout import (
    byte_vocab,
    llm_shapes,
    random_llm_state,
    write_byte_bpe_tokenizer,
)
from cosystream.testing.release_layout import unfold_weight_norm as _unfold_weight_norm
from cosystream.testing.yaml_template import SIZES, qwen_config, render_yaml

_SPECIAL_TEXT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def random_checkpoint(out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Create `out_dir` (must not already hold a model) and return it."""
    if size not in SIZES:
        raise ValueError(f"size: one of {sorted(SIZES)}, got {size!r}")
    out = Path(out_dir)
    if (out / "cosyvoice2.yaml").exists():
        raise FileExistsError(f"{out}: already holds a model (cosyvoice2.yaml exists)")
    (out / "CosyVoice-BlankEN").mkdir(parents=True, exist_ok=True)
    dims = SIZES[size]
    (out / "cosyvoice2.yaml").write_text(render_yaml(dims))
    _write_tokenizer(out / "CosyVoice-BlankEN", dims.text_vocab)
    (out / "CosyVoice-BlankEN" / "config.json").write_text(json.dumps(qwen_config(dims), indent=2))
    hp = load_hparams(out / "cosyvoice2.yaml", out / "CosyVoice-BlankEN" / "config.json")
    gen = torch.Generator().manual_seed(seed)
    torch.save(_llm_state(hp.llm, gen), out / "llm.pt")
    torch.save(_module_state("flow", hp, gen), out / "flow.pt")
    torch.save(_module_state("hift", hp, gen), out / "hift.pt")
    write_speech_tokenizer(out / "speech_tokenizer_v2.onnx", seed)
    write_campplus(out / "campplus.onnx", seed)
    return out


def _llm_state(dims, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return random_llm_state(official_keys(dims), llm_shapes(dims), gen)


def _module_state(which: str, hp, gen: torch.Generator) -> dict[str, torch.Tensor]:
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    if which == "flow":
        from cosystream.models.flow import Flow

        return {k: v.contiguous() for k, v in Flow(hp.flow).state_dict().items()}
    from cosystream.models.hift import HiFTGenerator, is_weight_norm_key

    state = HiFTGenerator(hp.hift).state_dict()
    return _unfold_weight_norm(state, is_weight_norm_key)


def _write_tokenizer(folder: Path, vocab_rows: int) -> None:
    """Every byte one token, then Qwen's three special tokens right after the bytes."""
    vocab = byte_vocab()
    first = len(vocab)
    assert first + len(_SPECIAL_TEXT_TOKENS) + 17 < vocab_rows
    write_byte_bpe_tokenizer(folder, vocab, {t: first + i for i, t in enumerate(_SPECIAL_TEXT_TOKENS)})
