"""Writers both random-model families share: the byte-level text tokenizer, the random speech-LM state and
the official weight-norm layout of the vocoder (`random_model.py`, `random_model_cv3.py`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from cosystream.testing.onnx_standins import write_campplus, write_speech_tokenizer

ShapeOf = Callable[[str], tuple[int, ...]]

TEXT_LM_DIR = "CosyVoice-BlankEN"  # the Qwen2 config and text tokenizer, beside the yaml


def start_model_dir(out_dir: str | Path, size: str, sizes: Iterable[str], yaml_names: Iterable[str]) -> Path:
    """Check `size`, refuse a folder that already holds a model (one of `yaml_names` exists), and create
    the folder with its text-LM subfolder."""
    if size not in sizes:
        raise ValueError(f"size: one of {sorted(sizes)}, got {size!r}")
    out = Path(out_dir)
    for name in yaml_names:
        if (out / name).exists():
            raise FileExistsError(f"{out}: already holds a model ({name} exists)")
    (out / TEXT_LM_DIR).mkdir(parents=True, exist_ok=True)
    return out


def write_yaml_and_qwen_config(out: Path, yaml_name: str, yaml_text: str, qwen: dict,
                               write_tokenizer: Callable[[Path], None]) -> tuple[Path, Path]:
    """The model yaml, the text tokenizer and the Qwen2 `config.json`; returns (yaml path, config path)."""
    (out / yaml_name).write_text(yaml_text)
    write_tokenizer(out / TEXT_LM_DIR)
    config = out / TEXT_LM_DIR / "config.json"
    config.write_text(json.dumps(qwen, indent=2))
    return out / yaml_name, config


def reseed_torch(gen: torch.Generator) -> None:
    """Seed torch's global generator from `gen` (the modules' own initialisers draw from it)."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))


def write_side_models(out: Path, speech_tokenizer_name: str, seed: int) -> None:
    """The two ONNX stand-ins: the speech tokenizer (`speech_tokenizer_name`) and CAM++."""
    write_speech_tokenizer(out / speech_tokenizer_name, seed)
    write_campplus(out / "campplus.onnx", seed)


def llm_shapes(dims) -> ShapeOf:
    """The official shape of each speech-LM key for the LM dims `dims`."""
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


def random_llm_state(keys: Iterable[str], shape: ShapeOf, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights for the official speech-LM `keys`, drawn from `gen` in key order; norms are ones."""
    state: dict[str, torch.Tensor] = {}
    for key in keys:
        if key == "llm.model.lm_head.weight":
            continue
        s = shape(key)
        if key.endswith("norm.weight") or key.endswith("layernorm.weight"):
            state[key] = torch.ones(s)
        elif key.endswith(".bias"):
            state[key] = torch.randn(s, generator=gen) * 0.02
        else:
            fan_in = s[-1] if len(s) > 1 and "embed" not in key else 1
            state[key] = torch.randn(s, generator=gen) * (fan_in ** -0.5 if fan_in > 1 else 0.02)
    # the Qwen head is tied to the text embedding: one storage, as in the official file
    state["llm.model.lm_head.weight"] = state["llm.model.model.embed_tokens.weight"]
    return state


def unfold_weight_norm(state: dict[str, torch.Tensor], is_wn) -> dict[str, torch.Tensor]:
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


def bytes_to_unicode() -> dict[int, str]:
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


def byte_vocab() -> dict[str, int]:
    """Every byte one token, ids 0-255."""
    return {ch: i for i, ch in enumerate(bytes_to_unicode().values())}


def write_byte_bpe_tokenizer(folder: Path, vocab: dict[str, int], specials: dict[str, int]) -> None:
    """A byte-level BPE with no merges and Qwen's three special tokens at the ids `specials` gives them;
    `<|endoftext|>` is also the generation config's bos and eos."""
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for t, i in specials.items()}
    config = {
        "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "errors": "replace",
        "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    eot = specials["<|endoftext|>"]
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": eot, "eos_token_id": eot}))
