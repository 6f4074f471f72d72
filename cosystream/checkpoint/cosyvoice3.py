"""Read `cosyvoice3.yaml` (Fun-CosyVoice3 release) into dimension records (spec/cosyvoice3.md §1-2).

The file is parsed with the same tag-as-data reader as the CosyVoice2 yaml; only the classes and the
keys differ: `CosyVoice3LM`, `CausalMaskedDiffWithDiT` with a `PreLookaheadLayer` and a `DiT` estimator,
and `CausalHiFTGenerator` with a causal F0 predictor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cosystream.checkpoint.hparams import (
    HiftDims,
    LLMDims,
    MelDims,
    Tagged,
    _mel_dims,
    _qwen_config,
    _Reader,
    read_hyperpyyaml,
)
from cosystream.errors import CheckpointError

# PARITY: CosyVoice3LM hard-codes 200 extra rows after the 6561 speech codes (spec/cosyvoice3.md §4).
EXTRA_SPEECH_IDS = 200


@dataclass(frozen=True)
class DiTDims:
    dim: int
    depth: int
    heads: int
    dim_head: int
    ff_mult: int
    mel_dim: int
    mu_dim: int
    spk_dim: int
    out_channels: int
    static_chunk_size: int  # mel frames (50 Hz) of one attention block when streaming
    conv_pos_kernel: int = 31  # PARITY: CausalConvPositionEmbedding defaults (not in the yaml)
    conv_pos_groups: int = 16
    time_freq_dim: int = 256


@dataclass(frozen=True)
class CV3FlowDims:
    input_size: int  # token embedding width (80)
    output_size: int  # mel bins
    vocab_size: int
    spk_embed_dim: int
    pre_lookahead_len: int
    pre_lookahead_channels: int
    token_mel_ratio: int
    dit: DiTDims
    inference_cfg_rate: float
    n_timesteps: int
    t_scheduler: str


@dataclass(frozen=True)
class CausalHiftDims(HiftDims):
    conv_pre_look_right: int = 4
    f0_look_right: int = 3  # PARITY: CausalConvRNNF0Predictor conv 0 has kernel 4, right-padded by 3


@dataclass(frozen=True)
class CV3HParams:
    version: str  # "cosyvoice3"
    sample_rate: int
    token_frame_rate: int
    token_mel_ratio: int
    chunk_size: int
    llm: LLMDims
    flow: CV3FlowDims
    hift: CausalHiftDims
    mel: MelDims

    @property
    def num_speech_classes(self) -> int:
        """Rows of the speech embedding and of the LM head: 6561 codes + 200 special ids."""
        return self.llm.speech_token_size + EXTRA_SPEECH_IDS


def _llm_dims(r: _Reader, qwen: dict) -> LLMDims:
    llm = r.node("llm", target_suffix="CosyVoice3LM")
    sampling = r.get("llm.sampling")
    sargs = sampling.args if isinstance(sampling, Tagged) else {}
    hidden, heads = qwen["hidden_size"], qwen["num_attention_heads"]
    for key in ("llm.llm_input_size", "llm.llm_output_size"):
        if r.num(key) != hidden:
            raise CheckpointError(f"{r.file}: {key.split('.')[-1]} {r.num(key)} differs from the Qwen2 hidden "
                                  f"size {hidden}")
    mix = llm.get("mix_ratio", [5, 15])
    return LLMDims(
        hidden_size=hidden,
        num_layers=qwen["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=qwen["num_key_value_heads"],
        head_dim=int(qwen.get("head_dim", hidden // heads)),
        intermediate_size=qwen["intermediate_size"],
        rms_norm_eps=float(qwen.get("rms_norm_eps", 1e-6)),
        rope_theta=float(qwen.get("rope_theta", 1e6)),
        text_vocab_size=qwen["vocab_size"],
        speech_token_size=r.num("llm.speech_token_size"),
        mix_ratio=(int(mix[0]), int(mix[1])),
        top_p=float(sargs.get("top_p", 0.8)),
        top_k=int(sargs.get("top_k", 25)),
        win_size=int(sargs.get("win_size", 10)),
        tau_r=float(sargs.get("tau_r", 0.1)),
    )


def _flow_dims(r: _Reader) -> CV3FlowDims:
    r.node("flow", target_suffix="CausalMaskedDiffWithDiT")
    r.node("flow.pre_lookahead_layer", target_suffix="PreLookaheadLayer")
    r.node("flow.decoder", target_suffix="CausalConditionalCFM")
    r.node("flow.decoder.estimator", target_suffix="DiT")
    cfm = r.get("flow.decoder.cfm_params")
    cfm_args = cfm.args.get("content", cfm.args) if isinstance(cfm, Tagged) else cfm
    if not isinstance(cfm_args, dict):
        raise CheckpointError(f"{r.file}: flow.decoder.cfm_params must be a mapping")
    scheduler = str(cfm_args.get("t_scheduler", "cosine"))
    if scheduler != "cosine":
        raise CheckpointError(f"{r.file}: flow t_scheduler {scheduler!r} is not supported (only 'cosine')")
    est = "flow.decoder.estimator."
    mel_dim = r.num(est + "mel_dim", default=80)
    dit = DiTDims(
        dim=r.num(est + "dim"),
        depth=r.num(est + "depth"),
        heads=r.num(est + "heads"),
        dim_head=r.num(est + "dim_head"),
        ff_mult=r.num(est + "ff_mult"),
        mel_dim=mel_dim,
        mu_dim=r.num(est + "mu_dim", default=mel_dim),
        spk_dim=r.num(est + "spk_dim"),
        out_channels=r.num(est + "out_channels", default=mel_dim),
        static_chunk_size=r.num(est + "static_chunk_size", default=50),
    )
    if r.get(est + "long_skip_connection", False):
        raise CheckpointError(f"{r.file}: DiT long_skip_connection is not supported (the release has it off)")
    lookahead = r.num("flow.pre_lookahead_len", default=3)
    if r.num("flow.pre_lookahead_layer.pre_lookahead_len", default=lookahead) != lookahead:
        raise CheckpointError(f"{r.file}: flow.pre_lookahead_layer.pre_lookahead_len differs from "
                              "flow.pre_lookahead_len")
    return CV3FlowDims(
        input_size=r.num("flow.input_size"),
        output_size=r.num("flow.output_size"),
        vocab_size=r.num("flow.vocab_size"),
        spk_embed_dim=r.num("flow.spk_embed_dim"),
        pre_lookahead_len=lookahead,
        pre_lookahead_channels=r.num("flow.pre_lookahead_layer.channels"),
        token_mel_ratio=r.num("flow.token_mel_ratio", default=2),
        dit=dit,
        inference_cfg_rate=float(cfm_args.get("inference_cfg_rate", 0.7)),
        n_timesteps=10,  # PARITY: fixed in the official flow.inference
        t_scheduler=scheduler,
    )


def _hift_dims(r: _Reader) -> CausalHiftDims:
    r.node("hift", target_suffix="CausalHiFTGenerator")
    r.node("hift.f0_predictor", target_suffix="CausalConvRNNF0Predictor")
    dil = r.get("hift.resblock_dilation_sizes")
    sdil = r.get("hift.source_resblock_dilation_sizes")
    return CausalHiftDims(
        in_channels=r.num("hift.in_channels"),
        base_channels=r.num("hift.base_channels"),
        nb_harmonics=r.num("hift.nb_harmonics"),
        sampling_rate=r.num("hift.sampling_rate"),
        nsf_alpha=r.num("hift.nsf_alpha", float),
        nsf_sigma=r.num("hift.nsf_sigma", float),
        nsf_voiced_threshold=r.num("hift.nsf_voiced_threshold", float),
        upsample_rates=r.ints("hift.upsample_rates"),
        upsample_kernel_sizes=r.ints("hift.upsample_kernel_sizes"),
        istft_n_fft=r.num("hift.istft_params.n_fft"),
        istft_hop_len=r.num("hift.istft_params.hop_len"),
        resblock_kernel_sizes=r.ints("hift.resblock_kernel_sizes"),
        resblock_dilation_sizes=tuple(tuple(int(x) for x in d) for d in dil),
        source_resblock_kernel_sizes=r.ints("hift.source_resblock_kernel_sizes"),
        source_resblock_dilation_sizes=tuple(tuple(int(x) for x in d) for d in sdil),
        lrelu_slope=r.num("hift.lrelu_slope", float, default=0.1),
        audio_limit=r.num("hift.audio_limit", float, default=0.99),
        f0_cond_channels=r.num("hift.f0_predictor.cond_channels"),
        conv_pre_look_right=r.num("hift.conv_pre_look_right", default=4),
    )


def load_hparams_cv3(yaml_path: Path, qwen_config_path: Path) -> CV3HParams:
    """Read `cosyvoice3.yaml` and the Qwen2 config into a `CV3HParams`; errors name the file and key."""
    data = read_hyperpyyaml(yaml_path, overrides={"qwen_pretrain_path": str(qwen_config_path.parent)})
    r = _Reader(yaml_path.name, data)
    hp = CV3HParams(
        version="cosyvoice3",
        sample_rate=r.num("sample_rate"),
        token_frame_rate=r.num("token_frame_rate", default=25),
        token_mel_ratio=r.num("token_mel_ratio", default=2),
        chunk_size=r.num("chunk_size", default=25),
        llm=_llm_dims(r, _qwen_config(qwen_config_path)),
        flow=_flow_dims(r),
        hift=_hift_dims(r),
        mel=_mel_dims(r),
    )
    if hp.sample_rate != 24000 or hp.token_mel_ratio != 2:
        raise CheckpointError(
            f"{r.file}: sample_rate {hp.sample_rate} / token_mel_ratio {hp.token_mel_ratio} unsupported "
            "(CosyVoice3 uses 24000 / 2)")
    if hp.flow.input_size != hp.flow.output_size or hp.flow.dit.mel_dim != hp.flow.output_size:
        raise CheckpointError(f"{r.file}: flow input_size {hp.flow.input_size}, output_size "
                              f"{hp.flow.output_size} and DiT mel_dim {hp.flow.dit.mel_dim} must agree")
    return hp
