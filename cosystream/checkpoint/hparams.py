"""Read `cosyvoice2.yaml` (HyperPyYAML) into plain dimension records, without running any of its tags.

The official file names classes of the official code with `!new:`/`!name:` tags and computes a few
values with `!ref`; we parse the tags as data, resolve the references ourselves and keep only what
inference needs (spec/checkpoints.md §2). `cosyvoice3.yaml` is read here too (its LM, DiT flow and causal
HiFT records): the models layer may import only this module of `checkpoint`, so both families' records live
in it, past 600 lines.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from cosystream.errors import CheckpointError


@dataclass(frozen=True)
class Tagged:
    """A `!new:`/`!name:` node: the tag kind, the dotted target and its keyword arguments."""

    kind: str
    target: str
    args: dict[str, Any]


@dataclass(frozen=True)
class _Ref:
    expr: str


class _HyperLoader(yaml.SafeLoader):
    """A safe loader that turns HyperPyYAML tags into data instead of imports."""


def _construct_tagged(loader: _HyperLoader, suffix: str, node: yaml.Node) -> Any:
    kind, _, target = suffix.partition(":")
    if isinstance(node, yaml.MappingNode):
        args = loader.construct_mapping(node, deep=True)
    elif isinstance(node, yaml.SequenceNode):
        args = {"__args__": loader.construct_sequence(node, deep=True)}
    else:
        args = {"__value__": loader.construct_scalar(node)} if node.value != "" else {}
    if kind == "ref":
        return _Ref(str(loader.construct_scalar(node)))
    return Tagged(kind=kind, target=target, args=dict(args))


_HyperLoader.add_multi_constructor("!", _construct_tagged)

_REF_KEY = re.compile(r"<([^<>]+)>")
_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv}


def _eval_arith(expr: str) -> Any:
    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            return _ARITH[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(expr)

    return ev(ast.parse(expr, mode="eval"))


def _resolve(value: Any, top: dict[str, Any], seen: tuple[str, ...] = ()) -> Any:
    if isinstance(value, _Ref):
        keys = _REF_KEY.findall(value.expr)
        if len(keys) == 1 and value.expr.strip() == f"<{keys[0]}>":
            return _lookup(keys[0], top, seen)
        text = _REF_KEY.sub(lambda m: repr(_lookup(m.group(1), top, seen)), value.expr)
        return _eval_arith(text)
    if isinstance(value, Tagged):
        return Tagged(value.kind, value.target, {k: _resolve(v, top, seen) for k, v in value.args.items()})
    if isinstance(value, dict):
        return {k: _resolve(v, top, seen) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, top, seen) for v in value]
    return value


def _lookup(key: str, top: dict[str, Any], seen: tuple[str, ...]) -> Any:
    if key in seen:
        raise ValueError(f"circular !ref <{key}>")
    if key not in top:
        raise ValueError(f"!ref <{key}> names no top-level key")
    return _resolve(top[key], top, seen + (key,))


def read_hyperpyyaml(path: Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parse a HyperPyYAML file into plain data with every `!ref` resolved (tags become `Tagged`)."""
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_HyperLoader)  # noqa: S506 (safe subclass)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path.name}: not valid YAML ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path.name}: expected a mapping at the top level, got {type(raw).__name__}")
    raw.update(overrides or {})
    try:
        return {k: _resolve(v, raw) for k, v in raw.items()}
    except ValueError as e:
        raise CheckpointError(f"{path.name}: cannot resolve reference: {e}") from e


# ---------------------------------------------------------------------------------------------------
# Dimension records


@dataclass(frozen=True)
class LLMDims:
    """Qwen2 backbone (from CosyVoice-BlankEN/config.json) plus the speech head (from the yaml)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    text_vocab_size: int
    speech_token_size: int  # 6561 speech codes; the head has speech_token_size + 3 classes
    mix_ratio: tuple[int, int]
    top_p: float
    top_k: int
    win_size: int
    tau_r: float

    @property
    def eos_token(self) -> int:
        return self.speech_token_size

    @property
    def fill_token(self) -> int:
        return self.speech_token_size + 2

    @property
    def num_speech_classes(self) -> int:
        return self.speech_token_size + 3


@dataclass(frozen=True)
class EncoderDims:
    output_size: int
    attention_heads: int
    linear_units: int
    num_blocks: int
    num_up_blocks: int
    static_chunk_size: int  # tokens (25 Hz)


@dataclass(frozen=True)
class EstimatorDims:
    in_channels: int
    out_channels: int
    channels: int
    attention_head_dim: int
    n_blocks: int
    num_mid_blocks: int
    num_heads: int
    static_chunk_size: int  # mel frames (50 Hz)


@dataclass(frozen=True)
class FlowDims:
    input_size: int
    output_size: int  # mel bins
    vocab_size: int
    spk_embed_dim: int
    pre_lookahead_len: int
    token_mel_ratio: int
    encoder: EncoderDims
    estimator: EstimatorDims
    inference_cfg_rate: float
    n_timesteps: int
    t_scheduler: str


@dataclass(frozen=True)
class HiftDims:
    in_channels: int
    base_channels: int
    nb_harmonics: int
    sampling_rate: int
    nsf_alpha: float
    nsf_sigma: float
    nsf_voiced_threshold: float
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    istft_n_fft: int
    istft_hop_len: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    source_resblock_kernel_sizes: tuple[int, ...]
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    lrelu_slope: float
    audio_limit: float
    f0_cond_channels: int


@dataclass(frozen=True)
class MelDims:
    """The 24 kHz prompt mel (`feat_extractor`, Matcha `mel_spectrogram`)."""

    n_fft: int
    num_mels: int
    sampling_rate: int
    hop_size: int
    win_size: int
    fmin: float
    fmax: float | None
    center: bool


@dataclass(frozen=True)
class HParams:
    version: str  # "cosyvoice2"
    sample_rate: int
    token_frame_rate: int
    token_mel_ratio: int
    chunk_size: int
    llm: LLMDims
    flow: FlowDims
    hift: HiftDims
    mel: MelDims


class _Reader:
    """Typed access to the parsed yaml that names the file and key path in every error."""

    def __init__(self, file: str, data: dict[str, Any]) -> None:
        self.file = file
        self.data = data

    def node(self, path: str, kind: str | None = None, target_suffix: str | None = None) -> dict[str, Any]:
        value = self.get(path)
        if not isinstance(value, Tagged):
            raise CheckpointError(f"{self.file}: `{path}` must be a tagged object, got {value!r}")
        if target_suffix and not value.target.endswith(target_suffix):
            raise CheckpointError(f"{self.file}: `{path}` is {value.target}, expected a {target_suffix}")
        return value.args

    def get(self, path: str, default: Any = ...) -> Any:
        cur: Any = self.data
        for part in path.split("."):
            if isinstance(cur, Tagged):
                cur = cur.args
            if not isinstance(cur, dict) or part not in cur:
                if default is not ...:
                    return default
                raise CheckpointError(f"{self.file}: missing key `{path}`")
            cur = cur[part]
        return cur

    def num(self, path: str, typ: type = int, default: Any = ...) -> Any:
        value = self.get(path, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CheckpointError(f"{self.file}: `{path}` must be a number, got {value!r}")
        if typ is int and float(value) != int(value):
            raise CheckpointError(f"{self.file}: `{path}` must be an integer, got {value!r}")
        return typ(value)

    def ints(self, path: str) -> tuple[int, ...]:
        value = self.get(path)
        if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
            raise CheckpointError(f"{self.file}: `{path}` must be a list of integers, got {value!r}")
        return tuple(value)


def _qwen_config(config_path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise CheckpointError(f"{config_path.parent.name}/config.json: missing (the Qwen2 backbone config)") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_path.parent.name}/config.json: not valid JSON ({e})") from e
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size")
    missing = [k for k in required if not isinstance(cfg.get(k), int)]
    if missing:
        raise CheckpointError(f"{config_path.parent.name}/config.json: missing integer fields {missing}")
    if cfg.get("use_sliding_window"):
        raise CheckpointError(f"{config_path.parent.name}/config.json: sliding-window attention is not supported")
    return cfg


def _llm_dims(r: _Reader, qwen: dict[str, Any]) -> LLMDims:
    return _speech_lm_dims(r, qwen, "Qwen2LM", ("llm.llm_input_size",))


def _speech_lm_dims(r: _Reader, qwen: dict[str, Any], target_suffix: str, width_keys: tuple[str, ...]) -> LLMDims:
    """The speech LM's dims from the yaml's `llm` node (class `target_suffix`) and the Qwen2 config; each of
    `width_keys` must equal the Qwen2 hidden size."""
    llm = r.node("llm", target_suffix=target_suffix)
    sampling = r.get("llm.sampling")
    sargs = sampling.args if isinstance(sampling, Tagged) else {}
    hidden, heads = qwen["hidden_size"], qwen["num_attention_heads"]
    for key in width_keys:
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


def _cfm_args(r: _Reader) -> dict[str, Any]:
    """The flow decoder's `cfm_params` mapping (an `omegaconf.DictConfig` node or a plain mapping)."""
    cfm = r.get("flow.decoder.cfm_params")
    cfm_args = cfm.args.get("content", cfm.args) if isinstance(cfm, Tagged) else cfm
    if not isinstance(cfm_args, dict):
        raise CheckpointError(f"{r.file}: flow.decoder.cfm_params must be a mapping")
    return cfm_args


def _t_scheduler(r: _Reader, cfm_args: dict[str, Any]) -> str:
    scheduler = str(cfm_args.get("t_scheduler", "cosine"))
    if scheduler != "cosine":
        raise CheckpointError(f"{r.file}: flow t_scheduler {scheduler!r} is not supported (only 'cosine')")
    return scheduler


def _flow_dims(r: _Reader) -> FlowDims:
    r.node("flow", target_suffix="CausalMaskedDiffWithXvec")
    r.node("flow.encoder", target_suffix="UpsampleConformerEncoder")
    r.node("flow.decoder.estimator", target_suffix="CausalConditionalDecoder")
    channels = r.ints("flow.decoder.estimator.channels")
    if len(channels) != 1:
        raise CheckpointError(f"{r.file}: flow.decoder.estimator.channels must hold one width, got {channels}")
    cfm_args = _cfm_args(r)
    encoder = EncoderDims(
        output_size=r.num("flow.encoder.output_size"),
        attention_heads=r.num("flow.encoder.attention_heads"),
        linear_units=r.num("flow.encoder.linear_units"),
        num_blocks=r.num("flow.encoder.num_blocks"),
        num_up_blocks=r.num("flow.encoder.num_up_blocks", default=4),
        static_chunk_size=r.num("flow.encoder.static_chunk_size", default=r.num("chunk_size", default=25)),
    )
    estimator = EstimatorDims(
        in_channels=r.num("flow.decoder.estimator.in_channels"),
        out_channels=r.num("flow.decoder.estimator.out_channels"),
        channels=channels[0],
        attention_head_dim=r.num("flow.decoder.estimator.attention_head_dim"),
        n_blocks=r.num("flow.decoder.estimator.n_blocks"),
        num_mid_blocks=r.num("flow.decoder.estimator.num_mid_blocks"),
        num_heads=r.num("flow.decoder.estimator.num_heads"),
        static_chunk_size=r.num("flow.decoder.estimator.static_chunk_size", default=50),
    )
    scheduler = _t_scheduler(r, cfm_args)
    return FlowDims(
        input_size=r.num("flow.input_size"),
        output_size=r.num("flow.output_size"),
        vocab_size=r.num("flow.vocab_size"),
        spk_embed_dim=r.num("flow.spk_embed_dim"),
        pre_lookahead_len=r.num("flow.pre_lookahead_len", default=3),
        token_mel_ratio=r.num("flow.token_mel_ratio", default=2),
        encoder=encoder,
        estimator=estimator,
        inference_cfg_rate=float(cfm_args.get("inference_cfg_rate", 0.7)),
        n_timesteps=10,  # PARITY: fixed in the official flow.inference (spec/flow.md §4)
        t_scheduler=scheduler,
    )


def _hift_dims(r: _Reader) -> HiftDims:
    r.node("hift", target_suffix="HiFTGenerator")
    if r.get("hift").target.endswith("CausalHiFTGenerator"):
        raise CheckpointError(f"{r.file}: CausalHiFTGenerator (CosyVoice3) is not supported yet")
    return HiftDims(**_hift_fields(r))


def _hift_fields(r: _Reader) -> dict[str, Any]:
    """The `HiftDims` fields, read alike from the CosyVoice2 and the CosyVoice3 vocoder node."""
    dil = r.get("hift.resblock_dilation_sizes")
    sdil = r.get("hift.source_resblock_dilation_sizes")
    return dict(
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
    )


def _mel_dims(r: _Reader) -> MelDims:
    return MelDims(
        n_fft=r.num("feat_extractor.n_fft"),
        num_mels=r.num("feat_extractor.num_mels"),
        sampling_rate=r.num("feat_extractor.sampling_rate"),
        hop_size=r.num("feat_extractor.hop_size"),
        win_size=r.num("feat_extractor.win_size"),
        fmin=r.num("feat_extractor.fmin", float, default=0.0),
        fmax=r.num("feat_extractor.fmax", float, default=None),
        center=bool(r.get("feat_extractor.center", False)),
    )


_HP = TypeVar("_HP", "HParams", "CV3HParams")


def _read_release(yaml_path: Path, qwen_config_path: Path, make: Callable[..., _HP], family: str,
                  llm: Callable[[_Reader, dict[str, Any]], LLMDims], flow: Callable[[_Reader], Any],
                  hift: Callable[[_Reader], Any]) -> tuple[_HP, _Reader]:
    """Both families' hparams: the yaml's rates, then `llm`, `flow` and `hift` (the family's readers of
    those sections) and the mel settings, in that order; the rates checked. Returns (hparams, reader)."""
    data = read_hyperpyyaml(yaml_path, overrides={"qwen_pretrain_path": str(qwen_config_path.parent)})
    r = _Reader(yaml_path.name, data)
    hp = make(
        version=family.lower(),
        sample_rate=r.num("sample_rate"),
        token_frame_rate=r.num("token_frame_rate", default=25),
        token_mel_ratio=r.num("token_mel_ratio", default=2),
        chunk_size=r.num("chunk_size", default=25),
        llm=llm(r, _qwen_config(qwen_config_path)),
        flow=flow(r),
        hift=hift(r),
        mel=_mel_dims(r),
    )
    if hp.sample_rate != 24000 or hp.token_mel_ratio != 2:
        raise CheckpointError(
            f"{r.file}: sample_rate {hp.sample_rate} / token_mel_ratio {hp.token_mel_ratio} unsupported "
            f"({family} uses 24000 / 2)")
    return hp, r


def load_hparams(yaml_path: Path, qwen_config_path: Path) -> HParams:
    """Read the model's yaml and the Qwen2 config into an `HParams`; errors name the file and key."""
    hp, _ = _read_release(yaml_path, qwen_config_path, HParams, "CosyVoice2", _llm_dims, _flow_dims, _hift_dims)
    return hp


# ---------------------------------------------------------------------------------------------------
# CosyVoice3 (Fun-CosyVoice3 release, `cosyvoice3.yaml`; spec/cosyvoice3.md §1-2): the same tag-as-data
# reader; the classes differ: `CosyVoice3LM`, `CausalMaskedDiffWithDiT` with a `PreLookaheadLayer` and a
# `DiT` estimator, `CausalHiFTGenerator` with a causal F0 predictor.

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


def _cv3_llm_dims(r: _Reader, qwen: dict) -> LLMDims:
    return _speech_lm_dims(r, qwen, "CosyVoice3LM", ("llm.llm_input_size", "llm.llm_output_size"))


def _cv3_flow_dims(r: _Reader) -> CV3FlowDims:
    r.node("flow", target_suffix="CausalMaskedDiffWithDiT")
    r.node("flow.pre_lookahead_layer", target_suffix="PreLookaheadLayer")
    r.node("flow.decoder", target_suffix="CausalConditionalCFM")
    r.node("flow.decoder.estimator", target_suffix="DiT")
    cfm_args = _cfm_args(r)
    scheduler = _t_scheduler(r, cfm_args)
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


def _cv3_hift_dims(r: _Reader) -> CausalHiftDims:
    r.node("hift", target_suffix="CausalHiFTGenerator")
    r.node("hift.f0_predictor", target_suffix="CausalConvRNNF0Predictor")
    return CausalHiftDims(
        **_hift_fields(r),
        conv_pre_look_right=r.num("hift.conv_pre_look_right", default=4),
    )


def load_hparams_cv3(yaml_path: Path, qwen_config_path: Path) -> CV3HParams:
    """Read `cosyvoice3.yaml` and the Qwen2 config into a `CV3HParams`; errors name the file and key."""
    hp, r = _read_release(yaml_path, qwen_config_path, CV3HParams, "CosyVoice3", _cv3_llm_dims, _cv3_flow_dims,
                          _cv3_hift_dims)
    if hp.flow.input_size != hp.flow.output_size or hp.flow.dit.mel_dim != hp.flow.output_size:
        raise CheckpointError(f"{r.file}: flow input_size {hp.flow.input_size}, output_size "
                              f"{hp.flow.output_size} and DiT mel_dim {hp.flow.dit.mel_dim} must agree")
    return hp
