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
    shapes = _llm_shapes(dims)
    state: dict[str, torch.Tensor] = {}
    for key in official_keys(dims):
        if key == "llm.model.lm_head.weight":
            continue
        shape = shapes(key)
        if key.endswith("norm.weight") or key.endswith("layernorm.weight"):
            state[key] = torch.ones(shape)
        elif key.endswith(".bias"):
            state[key] = torch.randn(shape, generator=gen) * 0.02
        else:
            fan_in = shape[-1] if len(shape) > 1 and "embed" not in key else 1
            state[key] = torch.randn(shape, generator=gen) * (fan_in ** -0.5 if fan_in > 1 else 0.02)
    # the Qwen head is tied to the text embedding: one storage, as in the official file
    state["llm.model.lm_head.weight"] = state["llm.model.model.embed_tokens.weight"]
    return state


def _llm_shapes(dims):
    q, kv = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    d, ffn, classes = dims.hidden_size, dims.intermediate_size, dims.num_speech_classes
    table = {
        "llm_embedding.weight": (2, d), "speech_embedding.weight": (classes, d),
        "llm_decoder.weight": (classes, d), "llm_decoder.bias": (classes,),
        "embed_tokens.weight": (dims.text_vocab_size, d), "norm.weight": (d,),
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
        "q_proj.weight": (q, d), "q_proj.bias": (q,), "k_proj.weight": (kv, d), "k_proj.bias": (kv,),
        "v_proj.weight": (kv, d), "v_proj.bias": (kv,), "o_proj.weight": (d, q),
        "gate_proj.weight": (ffn, d), "up_proj.weight": (ffn, d), "down_proj.weight": (d, ffn),
    }

    def shape(key: str) -> tuple[int, ...]:
        for suffix, s in table.items():
            if key == suffix or key.endswith("." + suffix):
                return s
        raise KeyError(key)

    return shape


def _module_state(which: str, hp, gen: torch.Generator) -> dict[str, torch.Tensor]:
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    if which == "flow":
        from cosystream.models.flow import Flow

        return {k: v.contiguous() for k, v in Flow(hp.flow).state_dict().items()}
    from cosystream.models.hift import HiFTGenerator, is_weight_norm_key

    state = HiFTGenerator(hp.hift).state_dict()
    return _unfold_weight_norm(state, is_weight_norm_key)


def _unfold_weight_norm(state: dict[str, torch.Tensor], is_wn) -> dict[str, torch.Tensor]:
    """Write weight-normalised convs as the official `parametrizations` pair (g, v)."""
    out: dict[str, torch.Tensor] = {}
    for key, w in state.items():
        if is_wn(key):
            stem = key[: -len(".weight")]
            g = w.flatten(1).norm(dim=1).view(-1, *([1] * (w.dim() - 1)))
            out[f"{stem}.parametrizations.weight.original0"] = g.clone()
            out[f"{stem}.parametrizations.weight.original1"] = w.clone()
        else:
            out[key] = w.clone()
    return out


def _bytes_to_unicode() -> dict[int, str]:
    # The byte-level BPE alphabet: printable bytes map to themselves, the rest to code points >= 256.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _write_tokenizer(folder: Path, vocab_rows: int) -> None:
    """A byte-level BPE with no merges (every byte one token) plus Qwen's three special tokens."""
    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode().values())}
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    first = len(vocab)
    assert first + len(_SPECIAL_TEXT_TOKENS) + 17 < vocab_rows
    added = {str(first + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": True}
             for i, t in enumerate(_SPECIAL_TEXT_TOKENS)}
    config = {
        "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "errors": "replace",
        "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": first, "eos_token_id": first}))
