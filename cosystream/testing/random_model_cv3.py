"""Write a model directory in the Fun-CosyVoice3 release layout with random weights.

`tiny` uses the CosyVoice3 fixture set's dims; `0.5b` the real Fun-CosyVoice3-0.5B shapes
(spec/cosyvoice3.md §2, spec/checkpoints.md §3.2-3.6), so speed can be measured without the download.
The text tokenizer keeps Qwen's real special ids (151643-151645), so the CosyVoice3 specials get their
real ids (`<|endofprompt|>` = 151646, which the LM requires); the vocabulary rows are the real 151936.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from cosystream.checkpoint.hparams import CV3HParams, load_hparams_cv3
from cosystream.models.cosyvoice3.flow import CV3Flow
from cosystream.models.cosyvoice3.hift import CausalHiFT
from cosystream.models.cosyvoice3.lm import official_keys
from cosystream.models.hift import is_weight_norm_key
from cosystream.testing.release_layout import (
    byte_vocab,
    llm_shapes,
    random_llm_state,
    reseed_torch,
    start_model_dir,
    unfold_weight_norm,
    write_byte_bpe_tokenizer,
    write_side_models,
    write_yaml_and_qwen_config,
)
from cosystream.testing.yaml_template import FamilyYaml, qwen_config, render_family_yaml

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

CV3_YAML = FamilyYaml(
    model_title="CosyVoice3",
    written_by="`cosystream make-random-model --family cosyvoice3`",
    llm_class="CosyVoice3LM",
    flow_class="CausalMaskedDiffWithDiT",
    flow_input_size=80,
    flow_body="""\
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: 80
        channels: {lookahead_channels}
        pre_lookahead_len: 3
""",
    estimator="""\
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
""",
    hift_class="CausalHiFTGenerator",
    f0_class="CausalConvRNNF0Predictor",
    fmax="null",
    hift_extra="    conv_pre_look_right: 4\n",
    tokenizer_extra="    version: cosyvoice3\n",
)


def render_yaml_cv3(size: CV3Size) -> str:
    return render_family_yaml(CV3_YAML, size)


def qwen_config_cv3(size: CV3Size) -> dict:
    return qwen_config(size, QWEN_SPECIALS["<|endoftext|>"], TEXT_VOCAB)


def random_checkpoint_cv3(out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Create `out_dir` (must not already hold a model) and return it."""
    out = start_model_dir(out_dir, size, SIZES_CV3, ("cosyvoice2.yaml", "cosyvoice3.yaml"))
    dims = SIZES_CV3[size]
    yaml_path, config = write_yaml_and_qwen_config(out, "cosyvoice3.yaml", render_yaml_cv3(dims),
                                                   qwen_config_cv3(dims), _write_tokenizer)
    hp = load_hparams_cv3(yaml_path, config)
    gen = torch.Generator().manual_seed(seed)
    torch.save(_llm_state(hp, gen), out / "llm.pt")
    reseed_torch(gen)
    torch.save({k: v.contiguous() for k, v in CV3Flow(hp.flow).state_dict().items()}, out / "flow.pt")
    torch.save(unfold_weight_norm(CausalHiFT(hp.hift).state_dict(), is_weight_norm_key), out / "hift.pt")
    write_side_models(out, "speech_tokenizer_v3.onnx", seed)
    return out


def _llm_state(hp: CV3HParams, gen: torch.Generator) -> dict[str, torch.Tensor]:
    dims = hp.llm
    base = llm_shapes(dims)
    classes = hp.num_speech_classes

    def shape(key: str) -> tuple[int, ...]:
        if key in ("speech_embedding.weight", "llm_decoder.weight"):
            return (classes, dims.hidden_size)
        return base(key)

    return random_llm_state(official_keys(dims), shape, gen)


def _write_tokenizer(folder: Path) -> None:
    """Every byte one token, and Qwen's three specials at their real ids."""
    vocab = byte_vocab()
    vocab.update(QWEN_SPECIALS)  # in the vocabulary too, so that added tokens continue after 151645
    write_byte_bpe_tokenizer(folder, vocab, QWEN_SPECIALS)


def hparams_cv3(size: str) -> CV3HParams:
    """The hyperparameters a random model of `size` has, without writing its weights (benchmarks, tests)."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "cosyvoice3.yaml").write_text(render_yaml_cv3(SIZES_CV3[size]))
        (d / "config.json").write_text(json.dumps(qwen_config_cv3(SIZES_CV3[size])))
        return load_hparams_cv3(d / "cosyvoice3.yaml", d / "config.json")
