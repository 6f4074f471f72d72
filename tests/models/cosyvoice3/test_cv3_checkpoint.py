"""Opening a CosyVoice3 model directory: family detection, hyper-parameters, strict loads, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cosystream.checkpoint import load_checkpoint
from cosystream.checkpoint.hparams import CV3HParams
from cosystream.engine.cv3_loader import load_cv3_flow, load_cv3_hift, load_cv3_llm
from cosystream.engine.loader import load_flow
from cosystream.errors import CheckpointError


def _linked_copy(src: Path, dst: Path, skip: str | None = None) -> Path:
    """A copy of a model directory whose files are symlinks (cheap), without `skip`."""
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        if path.is_dir() or str(rel) == skip:
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        (dst / rel).symlink_to(path)
    return dst


@pytest.mark.parity
def test_fixture_directory_is_cosyvoice3(cv3_checkpoint, cv3_model_dir):
    assert cv3_checkpoint.family == "cosyvoice3"
    hp = cv3_checkpoint.hparams
    assert isinstance(hp, CV3HParams)
    cfg = json.loads((cv3_model_dir / "CosyVoice-BlankEN" / "config.json").read_text())
    assert (hp.llm.hidden_size, hp.llm.num_layers, hp.llm.text_vocab_size) == (
        cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"])
    assert hp.flow.dit.static_chunk_size == hp.chunk_size * hp.token_mel_ratio
    assert hp.mel.fmax is None  # fmax: null -> sr/2
    assert cv3_checkpoint.files.speech_tokenizer.name == "speech_tokenizer_v3.onnx"


@pytest.mark.parity
def test_strict_loads_keep_every_tensor(cv3_checkpoint, cv3_model_dir):
    lm = load_cv3_llm(cv3_checkpoint)
    raw = torch.load(cv3_model_dir / "llm.pt", weights_only=True)
    assert torch.equal(lm.speech_embedding.weight, raw["speech_embedding.weight"])
    assert torch.equal(lm.llm_decoder.weight, raw["llm_decoder.weight"])
    flow = load_cv3_flow(cv3_checkpoint)
    raw = torch.load(cv3_model_dir / "flow.pt", weights_only=True)
    assert set(flow.state_dict()) == set(raw)
    for key, value in raw.items():
        assert torch.equal(flow.state_dict()[key], value), key
    hift = load_cv3_hift(cv3_checkpoint, noise_seconds=0.1)
    assert hift.f0_predictor.classifier.weight.dtype == torch.float64
    raw = torch.load(cv3_model_dir / "hift.pt", weights_only=True)
    assert torch.equal(hift.m_source.l_linear.weight, raw["m_source.l_linear.weight"])


@pytest.mark.parity
@pytest.mark.parametrize("name", ["cosyvoice3.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx",
                                  "speech_tokenizer_v3.onnx", "CosyVoice-BlankEN/config.json"])
def test_missing_file_is_named(cv3_model_dir, tmp_path, name):
    d = _linked_copy(cv3_model_dir, tmp_path / "m", skip=name)
    expected = "cosyvoice2.yaml" if name == "cosyvoice3.yaml" else name  # no yaml at all: the CV2 name is asked for
    with pytest.raises(CheckpointError, match=expected.replace(".", r"\.")):
        load_checkpoint(d)


@pytest.mark.parity
@pytest.mark.parametrize("file,key", [("flow.pt", "decoder.estimator.transformer_blocks.0.attn.to_q.weight"),
                                      ("hift.pt", "conv_post.bias"),
                                      ("llm.pt", "llm.model.model.layers.0.mlp.up_proj.weight")])
def test_missing_key_is_named(cv3_model_dir, tmp_path, file, key):
    d = _linked_copy(cv3_model_dir, tmp_path / "m", skip=file)
    state = torch.load(cv3_model_dir / file, weights_only=True)
    del state[key]
    state["extra.weight"] = torch.zeros(2)
    torch.save(state, d / file)
    loader = {"flow.pt": load_cv3_flow, "hift.pt": lambda c: load_cv3_hift(c, noise_seconds=0.1),
              "llm.pt": load_cv3_llm}[file]
    with pytest.raises(CheckpointError, match=rf"{file.replace('.', '[.]')}: .*missing keys: .*{key}.*"
                                              r"unexpected keys: extra\.weight"):
        loader(load_checkpoint(d))


@pytest.mark.parity
def test_yaml_key_errors_name_the_key(cv3_model_dir, tmp_path):
    d = _linked_copy(cv3_model_dir, tmp_path / "m", skip="cosyvoice3.yaml")
    text = (cv3_model_dir / "cosyvoice3.yaml").read_text().replace("            depth:", "            layers:")
    (d / "cosyvoice3.yaml").write_text(text)
    with pytest.raises(CheckpointError, match=r"cosyvoice3\.yaml: missing key `flow\.decoder\.estimator\.depth`"):
        load_checkpoint(d)


@pytest.mark.parity
def test_cosyvoice2_runners_refuse_a_cosyvoice3_directory(cv3_checkpoint):
    with pytest.raises(CheckpointError, match="cosyvoice3"):
        load_flow(cv3_checkpoint)


def test_cosyvoice2_yaml_wins_when_both_are_present(tmp_path):
    """As the official AutoModel: cosyvoice2.yaml is tested first."""
    from cosystream.checkpoint.layout import locate_model_files
    from cosystream.testing.random_model import random_checkpoint

    d = random_checkpoint(tmp_path / "m", "tiny", seed=1)
    shutil.copy(d / "cosyvoice2.yaml", d / "cosyvoice3.yaml")
    assert locate_model_files(d).family == "cosyvoice2"
