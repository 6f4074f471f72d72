"""The yaml written by `make-random-model`: the official tags and keys, sizes filled in.

The sections both families share live here once; each family names what it has of its own in a `FamilyYaml`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSize:
    """Sizes that differ between the tiny test model and the real CosyVoice2-0.5B."""

    llm_hidden: int
    llm_layers: int
    llm_heads: int
    llm_kv_heads: int
    llm_ffn: int
    text_vocab: int
    enc_heads: int
    enc_ffn: int
    enc_blocks: int
    est_channels: int
    est_head_dim: int
    est_blocks: int
    est_mid_blocks: int
    est_heads: int
    hift_channels: int


SIZES = {
    # The fixture set's dims (shared/fixtures/README.md "Tiny sizes").
    "tiny": ModelSize(64, 2, 4, 2, 128, 1536, 4, 64, 1, 64, 32, 1, 2, 2, 32),
    # CosyVoice2-0.5B (spec/checkpoints.md §2.3, §3.1).
    "0.5b": ModelSize(896, 24, 14, 2, 4864, 151936, 8, 2048, 6, 256, 64, 4, 12, 8, 512),
}

# The sections both families share, as `str.format` templates: the family's file supplies its class names
# and the fields that differ (`render_family_yaml`), plus its own `flow` estimator/encoder lines.
_HEADER = """\
# Random-weight {model_title} model written by {written_by}.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

sample_rate: 24000
llm_input_size: {{llm_hidden}}
llm_output_size: {{llm_hidden}}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2
chunk_size: 25
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.{llm_class}
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

flow: !new:cosyvoice.flow.flow.{flow_class}
    input_size: {flow_input_size}
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
"""

_CFM_DECODER = """\
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
"""

_TAIL = """\
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.{hift_class}
    in_channels: 80
    base_channels: {{hift_channels}}
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
{hift_extra}\
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.{f0_class}
        num_class: 1
        in_channels: 80
        cond_channels: {{hift_channels}}

get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
{tokenizer_extra}\
allowed_special: 'all'
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: {fmax}
    center: False
"""


@dataclass(frozen=True)
class FamilyYaml:
    """What one family's yaml has of its own; everything else is the shared sections above."""

    model_title: str
    written_by: str  # the header comment's command
    llm_class: str
    flow_class: str
    flow_input_size: int
    flow_body: str  # the flow lines between `pre_lookahead_len` and the decoder (encoder or lookahead layer)
    estimator: str  # the estimator node's lines up to its chunk settings
    hift_class: str
    f0_class: str
    fmax: str
    hift_extra: str = ""  # whole lines, each ending in a newline
    tokenizer_extra: str = ""


def render_family_yaml(family: FamilyYaml, size: object) -> str:
    """The family's yaml with `size`'s fields filled in."""
    names = {k: getattr(family, k) for k in FamilyYaml.__dataclass_fields__}
    template = (_HEADER.format(**names) + family.flow_body + _CFM_DECODER + family.estimator
                + _TAIL.format(**names))
    return template.format(**vars(size))


CV2_YAML = FamilyYaml(
    model_title="CosyVoice2",
    written_by="`cosystream make-random-model` (official layout and tags)",
    llm_class="Qwen2LM",
    flow_class="CausalMaskedDiffWithXvec",
    flow_input_size=512,
    flow_body="""\
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: 512
        attention_heads: {enc_heads}
        linear_units: {enc_ffn}
        num_blocks: {enc_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: 512
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: !ref <chunk_size>
""",
    estimator="""\
        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: 320
            out_channels: 80
            channels: [{est_channels}]
            dropout: 0.0
            attention_head_dim: {est_head_dim}
            n_blocks: {est_blocks}
            num_mid_blocks: {est_mid_blocks}
            num_heads: {est_heads}
            act_fn: 'gelu'
""",
    hift_class="HiFTGenerator",
    f0_class="ConvRNNF0Predictor",
    fmax="8000",
)


def render_yaml(size: ModelSize) -> str:
    return render_family_yaml(CV2_YAML, size)


def qwen_config(size: ModelSize, endoftext_id: int = 256, vocab_size: int | None = None) -> dict:
    """The Qwen2 `config.json` for the LM sizes of `size` (either family's); the text vocabulary is
    `size.text_vocab` unless `vocab_size` is given."""
    return {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": endoftext_id,
        "eos_token_id": endoftext_id, "hidden_act": "silu", "hidden_size": size.llm_hidden,
        "initializer_range": 0.02, "intermediate_size": size.llm_ffn, "max_position_embeddings": 32768,
        "max_window_layers": size.llm_layers, "model_type": "qwen2", "num_attention_heads": size.llm_heads,
        "num_hidden_layers": size.llm_layers, "num_key_value_heads": size.llm_kv_heads, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "float32",
        "use_cache": True, "use_sliding_window": False,
        "vocab_size": size.text_vocab if vocab_size is None else vocab_size,
    }
