"""Write a model directory in the Fun-CosyVoice3 release layout with random weights.

`tiny` uses the CosyVoice3 fixture set's dims; `0.5b` the real Fun-CosyVoice3-0.5B shapes
(spec/cosyvoice3.md §2, spec/checkpoints.md §3.2-3.6), so speed can be measured without the download.
The text tokenizer keeps Qwen's real special ids (151643-151645), so the CosyVoice3 specials get their
real ids (`<|endofprompt|>` = 151646, which the LM requires); the vocabulary rows are the real 151936.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from cosystream.checkpoint.hparams import CV3HParams, load_hparams_cv3
from cosystream.models.cosyvoice3.flow import CV3Flow
from cosystream.models.cosyvoice3.hift import CausalHiFT
from cosystream.models.cosyvoice3.lm import official_keys
from cosystream.models.hift import is_weight_norm_key
from cosystream.testing.onnx_standins import write_campplus, write_speech_tokenizer
from cosystream.testing.random_model import _bytes_to_unicode, _llm_shapes, _unfold_weight_norm

QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
TEXT_VOCAB = 151936


@dataclass(frozen=True)
class CV3Size:
    llm_hidden: int
    llm_layers: int
    llm_heads: int
    llm_kv_heads: int
    llm_ffn: int
    lookahead_channels: int
    dit_dim: int
    dit_depth: int
    dit_heads: int
    dit_dim_head: int
    hift_channels: int


SIZES_CV3 = {
    # The CosyVoice3 fixture set's dims (fixtures README §C1).
    "tiny": CV3Size(64, 2, 4, 2, 128, 64, 64, 2, 2, 32, 32),
    # Fun-CosyVoice3-0.5B (spec/cosyvoice3.md §2, checkpoints.md §3.2-3.6).
    "0.5b": CV3Size(896, 24, 14, 2, 4864, 1024, 1024, 22, 16, 64, 512),
}

_TEMPLATE = """\
# Random-weight CosyVoice3 model written by `cosystream make-random-model --family cosyvoice3`.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

sample_rate: 24000
llm_input_size: {llm_hidden}
llm_output_size: {llm_hidden}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2
chunk_size: 25
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.CosyVoice3LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: 6561
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: 80
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: 80
        channels: {lookahead_channels}
        pre_lookahead_len: 3
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {dit_dim}
            depth: {dit_depth}
            heads: {dit_heads}
            dim_head: {dit_dim_head}
            ff_mult: 2
            mel_dim: 80
            mu_dim: 80
            spk_dim: 80
            out_channels: 80
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
    in_channels: 80
    base_channels: {hift_channels}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    conv_pre_look_right: 4
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {hift_channels}

get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
    version: cosyvoice3
allowed_special: 'all'
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: null
    center: False
"""


def render_yaml_cv3(size: CV3Size) -> str:
    return _TEMPLATE.format(**size.__dict__)


def qwen_config_cv3(size: CV3Size) -> dict:
    eot = QWEN_SPECIALS["<|endoftext|>"]
    return {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": eot, "eos_token_id": eot,
        "hidden_act": "silu", "hidden_size": size.llm_hidden, "initializer_range": 0.02,
        "intermediate_size": size.llm_ffn, "max_position_embeddings": 32768, "max_window_layers": size.llm_layers,
        "model_type": "qwen2", "num_attention_heads": size.llm_heads, "num_hidden_layers": size.llm_layers,
        "num_key_value_heads": size.llm_kv_heads, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "float32", "use_cache": True,
        "use_sliding_window": False, "vocab_size": TEXT_VOCAB,
    }


def random_checkpoint_cv3(out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Create `out_dir` (must not already hold a model) and return it."""
    if size not in SIZES_CV3:
        raise ValueError(f"size: one of {sorted(SIZES_CV3)}, got {size!r}")
    out = Path(out_dir)
    for name in ("cosyvoice2.yaml", "cosyvoice3.yaml"):
        if (out / name).exists():
            raise FileExistsError(f"{out}: already holds a model ({name} exists)")
    blank = out / "CosyVoice-BlankEN"
    blank.mkdir(parents=True, exist_ok=True)
    dims = SIZES_CV3[size]
    (out / "cosyvoice3.yaml").write_text(render_yaml_cv3(dims))
    _write_tokenizer(blank)
    (blank / "config.json").write_text(json.dumps(qwen_config_cv3(dims), indent=2))
    hp = load_hparams_cv3(out / "cosyvoice3.yaml", blank / "config.json")
    gen = torch.Generator().manual_seed(seed)
    torch.save(_llm_state(hp, gen), out / "llm.pt")
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    torch.save({k: v.contiguous() for k, v in CV3Flow(hp.flow).state_dict().items()}, out / "flow.pt")
    torch.save(_unfold_weight_norm(CausalHiFT(hp.hift).state_dict(), is_weight_norm_key), out / "hift.pt")
    write_speech_tokenizer(out / "speech_tokenizer_v3.onnx", seed)
    write_campplus(out / "campplus.onnx", seed)
    return out


def _llm_state(hp: CV3HParams, gen: torch.Generator) -> dict[str, torch.Tensor]:
    dims = hp.llm
    base = _llm_shapes(dims)
    classes = hp.num_speech_classes

    def shape(key: str) -> tuple[int, ...]:
        if key in ("speech_embedding.weight", "llm_decoder.weight"):
            return (classes, dims.hidden_size)
        return base(key)

    state: dict[str, torch.Tensor] = {}
    for key in official_keys(dims):
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
    state["llm.model.lm_head.weight"] = state["llm.model.model.embed_tokens.weight"]  # tied, one storage
    return state


def _write_tokenizer(folder: Path) -> None:
    """A byte-level BPE with no merges (every byte one token) and Qwen's three specials at their real ids."""
    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode().values())}
    vocab.update(QWEN_SPECIALS)  # in the vocabulary too, so that added tokens continue after 151645
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for t, i in QWEN_SPECIALS.items()}
    config = {
        "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "errors": "replace",
        "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    eot = QWEN_SPECIALS["<|endoftext|>"]
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": eot, "eos_token_id": eot}))
