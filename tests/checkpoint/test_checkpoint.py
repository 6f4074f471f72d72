"""Opening model directories: the fixture set, random models, and every way a directory can be broken."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cosystream.checkpoint import load_checkpoint
from cosystream.checkpoint.weights import fold_weight_norm
from cosystream.engine.loader import load_flow, load_hift, load_llm
from cosystream.errors import CheckpointError
from cosystream.testing.random_model import random_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return random_checkpoint(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=3)


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parity
def test_fixture_model_dir_loads_every_key(checkpoint, model_dir):
    cfg = json.loads((model_dir / "CosyVoice-BlankEN" / "config.json").read_text())
    llm = checkpoint.hparams.llm
    assert (llm.hidden_size, llm.num_layers, llm.num_heads, llm.num_kv_heads) == (
        cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"])
    assert checkpoint.hparams.flow.estimator.static_chunk_size == 2 * checkpoint.hparams.chunk_size
    load_llm(checkpoint), load_flow(checkpoint), load_hift(checkpoint)  # strict: raises on any key mismatch


def test_random_tiny_model_round_trips(tiny_dir):
    ckpt = load_checkpoint(tiny_dir)
    lm = load_llm(ckpt)
    raw = torch.load(tiny_dir / "llm.pt", weights_only=True)
    torch.testing.assert_close(lm.text_embedding.weight, raw["llm.model.model.embed_tokens.weight"])
    assert raw["llm.model.lm_head.weight"].data_ptr() == raw["llm.model.model.embed_tokens.weight"].data_ptr()
    hift_raw = torch.load(tiny_dir / "hift.pt", weights_only=True)
    assert any(k.endswith("parametrizations.weight.original0") for k in hift_raw)
    load_flow(ckpt), load_hift(ckpt)


@pytest.mark.parametrize("name", ["cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx",
                                  "speech_tokenizer_v2.onnx", "CosyVoice-BlankEN/config.json",
                                  "CosyVoice-BlankEN/vocab.json"])
def test_missing_file_is_named(tiny_dir, tmp_path, name):
    d = _copy(tiny_dir, tmp_path)
    (d / name).unlink()
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_checkpoint(d)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "nope")


@pytest.mark.parametrize("name", ["llm.pt", "flow.pt", "hift.pt"])
def test_truncated_weights_are_named(tiny_dir, tmp_path, name):
    d = _copy(tiny_dir, tmp_path)
    data = (d / name).read_bytes()
    (d / name).write_bytes(data[: len(data) // 2])
    ckpt = load_checkpoint(d)
    loader = {"llm.pt": load_llm, "flow.pt": load_flow, "hift.pt": load_hift}[name]
    with pytest.raises(CheckpointError, match=rf"^{name.replace('.', '[.]')}: cannot be read"):
        loader(ckpt)


def test_wrong_file_reports_keys_by_name(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    shutil.copy(d / "hift.pt", d / "flow.pt")
    with pytest.raises(CheckpointError, match=r"flow\.pt: .*missing keys: .*unexpected keys: "):
        load_flow(load_checkpoint(d))


def test_llm_missing_unexpected_and_misshapen_keys(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    state = torch.load(d / "llm.pt", weights_only=True)
    del state["llm.model.model.layers.1.mlp.up_proj.weight"]
    state["llm.extra.weight"] = torch.zeros(3)
    torch.save(state, d / "llm.pt")
    with pytest.raises(CheckpointError) as err:
        load_llm(load_checkpoint(d))
    assert "llm.model.model.layers.1.mlp.up_proj.weight" in str(err.value)
    assert "llm.extra.weight" in str(err.value)
    state = torch.load(tiny_dir / "llm.pt", weights_only=True)
    state["llm_decoder.bias"] = torch.zeros(5)
    torch.save(state, d / "llm.pt")
    with pytest.raises(CheckpointError, match=r"llm\.pt: .*wrong shapes: llm_decoder\.bias"):
        load_llm(load_checkpoint(d))


def test_bad_yaml_and_config_are_named(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    (d / "cosyvoice2.yaml").write_text("llm: [unclosed")
    with pytest.raises(CheckpointError, match=r"cosyvoice2\.yaml: not valid YAML"):
        load_checkpoint(d)
    d2 = _copy(tiny_dir, tmp_path / "b")
    text = (d2 / "cosyvoice2.yaml").read_text().replace("    num_mid_blocks:", "    renamed_blocks:")
    (d2 / "cosyvoice2.yaml").write_text(text)
    with pytest.raises(CheckpointError, match=r"cosyvoice2\.yaml: missing key `flow\.decoder\.estimator\.num_mid"):
        load_checkpoint(d2)
    d3 = _copy(tiny_dir, tmp_path / "c")
    (d3 / "CosyVoice-BlankEN" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_checkpoint(d3)


def test_legacy_and_new_weight_norm_names_fold_alike():
    v = torch.randn(4, 3, 5)
    g = torch.rand(4, 1, 1) + 0.5
    new = fold_weight_norm({"c.parametrizations.weight.original0": g, "c.parametrizations.weight.original1": v})
    old = fold_weight_norm({"c.weight_g": g, "c.weight_v": v})
    expected = torch._weight_norm(v, g, 0)
    torch.testing.assert_close(new["c.weight"], expected)
    torch.testing.assert_close(old["c.weight"], expected)
    with pytest.raises(CheckpointError, match="only"):
        fold_weight_norm({"c.weight_g": g})


def test_real_size_parameter_counts_match_cosyvoice2_0_5b():
    """The 0.5b random model has exactly the published parameter counts (spec/checkpoints.md §3.7)."""
    from cosystream.checkpoint.hparams import load_hparams
    from cosystream.models.flow import Flow
    from cosystream.models.hift import HiFTGenerator
    from cosystream.models.qwen2 import SpeechLM
    from cosystream.testing.yaml_template import SIZES, qwen_config, render_yaml

    folder = Path(__import__("tempfile").mkdtemp())
    (folder / "cosyvoice2.yaml").write_text(render_yaml(SIZES["0.5b"]))
    (folder / "config.json").write_text(json.dumps(qwen_config(SIZES["0.5b"])))
    hp = load_hparams(folder / "cosyvoice2.yaml", folder / "config.json")
    with torch.device("meta"):
        lm, flow, hift = SpeechLM(hp.llm), Flow(hp.flow), HiFTGenerator(hp.hift)
    # the official file stores each weight-normalised conv as g [d0, 1, 1] and v: d0 more values than ours
    from cosystream.models.hift import is_weight_norm_key

    hift_official = sum(p.numel() for p in hift.parameters()) + sum(
        p.shape[0] for k, p in hift.state_dict().items() if is_weight_norm_key(k))
    counts = [sum(p.numel() for p in m.parameters()) for m in (lm, flow)] + [hift_official]
    assert counts == [505_803_812, 112_549_360, 20_821_295]
