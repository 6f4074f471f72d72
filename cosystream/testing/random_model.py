"""Write a model directory in the official CosyVoice2 release layout with random weights.

`tiny` uses the golden fixture set's dims (fast tests); `0.5b` the real CosyVoice2-0.5B shapes, so
speed can be measured without the real download. The two ONNX side models are small random
stand-ins with the official input/output conventions (spec/checkpoints.md §7): real ones are
half a gigabyte and only run once per registered voice, outside the hot path.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cosystream.checkpoint.hparams import load_hparams
from cosystream.models.qwen2 import official_keys
from cosystream.testing.release_layout import (
    byte_vocab,
    llm_shapes,
    random_llm_state,
    reseed_torch,
    start_model_dir,
    write_byte_bpe_tokenizer,
    write_side_models,
    write_yaml_and_qwen_config,
)
from cosystream.testing.release_layout import unfold_weight_norm as _unfold_weight_norm
from cosystream.testing.yaml_template import SIZES, qwen_config, render_yaml

_SPECIAL_TEXT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def random_checkpoint(out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Create `out_dir` (must not already hold a model) and return it."""
    out = start_model_dir(out_dir, size, SIZES, ("cosyvoice2.yaml",))
    dims = SIZES[size]
    yaml_path, config = write_yaml_and_qwen_config(out, "cosyvoice2.yaml", render_yaml(dims), qwen_config(dims),
                                                   lambda folder: _write_tokenizer(folder, dims.text_vocab))
    hp = load_hparams(yaml_path, config)
    gen = torch.Generator().manual_seed(seed)
    torch.save(_llm_state(hp.llm, gen), out / "llm.pt")
    torch.save(_module_state("flow", hp, gen), out / "flow.pt")
    torch.save(_module_state("hift", hp, gen), out / "hift.pt")
    write_side_models(out, "speech_tokenizer_v2.onnx", seed)
    return out


def _llm_state(dims, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return random_llm_state(official_keys(dims), llm_shapes(dims), gen)


def _module_state(which: str, hp, gen: torch.Generator) -> dict[str, torch.Tensor]:
    reseed_torch(gen)
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
