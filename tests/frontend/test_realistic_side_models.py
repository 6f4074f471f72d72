"""The torch prompt analysis on graphs with the released side models' architectures (cosystream/testing/
realistic_side_models.py), against onnxruntime on the same files.

The fixture sets' ONNX files are tiny stand-ins with only the official interfaces; these graphs are exported
from the real architectures (speech tokenizer v2/v3, CAM++) with random weights, so the torch runner meets a
real export's operators and shape arithmetic. The default run uses a reduced width of each architecture (every
layer type, fewer channels); the full sizes run under the `slow` mark.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from cosystream.checkpoint.hparams import _mel_dims, _Reader, read_hyperpyyaml
from cosystream.frontend.audio import PromptAudio, prepare_prompt_audio, speaker_features, whisper_log_mel
from cosystream.frontend.onnx_torch import TorchOnnxGraph
from cosystream.frontend.speaker import SpeakerEncoder
from cosystream.frontend.speech_tokenizer import SpeechTokenizer
from cosystream.frontend.torch_prompt import TorchPromptAnalyzer
from cosystream.testing.realistic_side_models import write_campplus, write_speech_tokenizer

XVECTOR_ATOL = 1e-4  # the fixtures README's x-vector tolerance (as tests/frontend/test_torch_prompt.py)
PROMPT_SECONDS = (1.3, 1.3, 2.07, 0.61)  # two of one length (batched together in every mode), two others


def _graphs(root: Path, size: str) -> dict[str, Path]:
    return {"v2": write_speech_tokenizer(root / "speech_tokenizer_v2.onnx", "v2", size, seed=11),
            "v3": write_speech_tokenizer(root / "speech_tokenizer_v3.onnx", "v3", size, seed=12),
            "campplus": write_campplus(root / "campplus.onnx", size, seed=13)}


@pytest.fixture(scope="module")
def small_graphs(tmp_path_factory) -> dict[str, Path]:
    return _graphs(tmp_path_factory.mktemp("realistic_small"), "small")


@pytest.fixture(scope="module")
def mel_dims(fixture_dir: Path):
    model = fixture_dir / "model"
    yaml_path = next(model.glob("cosyvoice*.yaml"))
    hparams = read_hyperpyyaml(yaml_path, overrides={"qwen_pretrain_path": str(model / "CosyVoice-BlankEN")})
    return _mel_dims(_Reader(yaml_path.name, hparams))


@pytest.fixture(scope="module")
def prompts(fixture_dir: Path, mel_dims, speech_like) -> list[PromptAudio]:
    """The fixture set's prompt, cut short (CPU time), and synthetic speech-like prompts of other lengths."""
    rate = mel_dims.sampling_rate
    full = prepare_prompt_audio(fixture_dir / "prompt_24k.wav", rate)
    cut = (full.wav_24k[: int(1.7 * rate)].numpy(), rate)
    return [prepare_prompt_audio(cut, rate)] + [prepare_prompt_audio((speech_like(s, 16000, seed=i), 16000), rate)
                                                for i, s in enumerate(PROMPT_SECONDS)]


def test_the_graphs_have_the_official_interfaces(small_graphs):
    def io(path: Path) -> list[tuple[str, int, list]]:
        graph = onnx.load(str(path)).graph
        return [(v.name, v.type.tensor_type.elem_type,
                 [d.dim_value if d.HasField("dim_value") else "dyn" for d in v.type.tensor_type.shape.dim])
                for v in list(graph.input) + list(graph.output)]

    tokenizer = [("feats", onnx.TensorProto.FLOAT, [1, 128, "dyn"]), ("feats_length", onnx.TensorProto.INT32, [1]),
                 ("indices", onnx.TensorProto.INT64, [1, "dyn"])]
    assert io(small_graphs["v2"]) == tokenizer and io(small_graphs["v3"]) == tokenizer
    assert io(small_graphs["campplus"]) == [("input", onnx.TensorProto.FLOAT, [1, "dyn", 80]),
                                            ("output", onnx.TensorProto.FLOAT, [1, 192])]


def test_the_exports_use_the_operators_of_a_real_export(small_graphs):
    """What the torch runner must cover beyond the stand-ins: masks from the length input, FSMN padding, erf
    GELU, layer norms (fused in v2, decomposed in v3), 2D convolutions, batch norms, segment pooling."""
    ops = {name: {node.op_type for node in onnx.load(str(path)).graph.node} for name, path in small_graphs.items()}
    assert {"Range", "Less", "Pad", "Erf", "LayerNormalization", "Softmax", "Tanh", "Round"} <= ops["v2"]
    assert "LayerNormalization" not in ops["v3"] and {"ReduceMean", "Sqrt", "Pow"} <= ops["v3"]
    assert {"Conv", "BatchNormalization", "AveragePool", "Expand", "Sigmoid", "Sqrt"} <= ops["campplus"]


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_tokens_equal_onnxruntime(small_graphs, prompts, version):
    path = small_graphs[version]
    session, graph = ort.InferenceSession(str(path)), TorchOnnxGraph(path)
    for prompt in prompts:
        feats = whisper_log_mel(prompt.wav_16k)[None]
        length = np.array([feats.shape[-1]], np.int32)
        want = session.run(None, {"feats": feats.numpy(), "feats_length": length})[0]
        got = graph({"feats": feats, "feats_length": torch.from_numpy(length)})["indices"]
        assert got.dtype == torch.int64 and want.shape == (1, -(-feats.shape[-1] // 4))
        np.testing.assert_array_equal(got.numpy(), want)
        assert len(np.unique(want)) > want.size // 4  # the random weights give varied tokens, not one code


def test_embedding_matches_onnxruntime(small_graphs, prompts):
    path = small_graphs["campplus"]
    session, graph = ort.InferenceSession(str(path)), TorchOnnxGraph(path)
    for prompt in prompts:
        feats = speaker_features(prompt.wav_16k)[None]
        want = session.run(None, {"input": feats.numpy()})[0]
        got = graph({"input": feats})["output"]
        np.testing.assert_allclose(got.numpy(), want, atol=XVECTOR_ATOL, rtol=XVECTOR_ATOL)


def _check_analyzer(graphs: dict[str, Path], version: str, mel_dims, prompts: list[PromptAudio],
                    fast_campplus: bool = True) -> None:
    analyzer = TorchPromptAnalyzer(graphs[version], graphs["campplus"], mel_dims, fast_campplus=fast_campplus)
    # the tokenizer masks its padding from `feats_length`: the probe must find that prompts of any lengths
    # share a call; the CAM++ graph has no length input: through the interpreter, prompts of one length share a
    # call, and its batched module (the released architecture, recognised) takes all of them at once
    assert analyzer.tokenizer.mode == "padded" and analyzer.tokenizer.frames_per_output == 4
    assert analyzer.speaker_mode == ("campplus_module" if fast_campplus else "same_length")
    assert (analyzer.speaker_fallback is None) == fast_campplus
    tokenizer, speaker = SpeechTokenizer(graphs[version]), SpeakerEncoder(graphs["campplus"])
    for prompt, result in zip(prompts, analyzer.analyse(prompts), strict=True):
        assert torch.equal(result.tokens, tokenizer.tokenize(prompt.wav_16k))
        torch.testing.assert_close(result.xvector, speaker.embed(prompt.wav_16k), atol=XVECTOR_ATOL,
                                   rtol=XVECTOR_ATOL)


@pytest.mark.parity
@pytest.mark.parametrize("version", ["v2", "v3"])
def test_batched_analysis_equals_onnxruntime_per_prompt(small_graphs, mel_dims, prompts, version):
    _check_analyzer(small_graphs, version, mel_dims, prompts)


@pytest.mark.parity
def test_batched_analysis_through_the_campplus_interpreter_equals_onnxruntime(small_graphs, mel_dims, prompts):
    _check_analyzer(small_graphs, "v2", mel_dims, prompts, fast_campplus=False)


@pytest.mark.slow
@pytest.mark.parametrize("version", ["v2", "v3"])
def test_full_size_graphs_equal_onnxruntime(tmp_path_factory, mel_dims, prompts, version):
    """The released sizes (≈ 0.5 / 1 GB tokenizers): the same checks, batched."""
    root = tmp_path_factory.mktemp(f"realistic_full_{version}")
    graphs = {version: write_speech_tokenizer(root / f"speech_tokenizer_{version}.onnx", version, "full", seed=21),
              "campplus": write_campplus(root / "campplus.onnx", "full", seed=22)}
    _check_analyzer(graphs, version, mel_dims, prompts[:3])


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_replace_side_models_keeps_the_tokenizer_version(tmp_path, fixture_dir, family):
    from cosystream.testing.realistic_side_models import replace_side_models

    source = fixture_dir if family == "cosyvoice2" else Path(__file__).resolve().parents[1] / "fixtures" / \
        "cosyvoice3-tiny"
    tokenizer = next((source / "model").glob("speech_tokenizer_v*.onnx"))
    (tmp_path / tokenizer.name).write_bytes(tokenizer.read_bytes())
    # CAM++ a link to another directory's file (a model directory linked to a stand-in model's files)
    elsewhere = tmp_path.parent / f"{tmp_path.name}_other"
    elsewhere.mkdir()
    original = (source / "model" / "campplus.onnx").read_bytes()
    (elsewhere / "campplus.onnx").write_bytes(original)
    (tmp_path / "campplus.onnx").symlink_to(elsewhere / "campplus.onnx")
    written = replace_side_models(tmp_path, "small", seed=3)
    assert written == [tmp_path / tokenizer.name, tmp_path / "campplus.onnx"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([tokenizer.name, "campplus.onnx"])
    assert not written[1].is_symlink() and (elsewhere / "campplus.onnx").read_bytes() == original
    layer_norms = {node.op_type for node in onnx.load(str(written[0])).graph.node} & {"LayerNormalization"}
    assert bool(layer_norms) == (tokenizer.stem.endswith("v2"))  # the v2 export fuses its layer norms, v3 not
    (tmp_path / "speech_tokenizer_v9.onnx").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="expected one"):
        replace_side_models(tmp_path, "small")


@pytest.mark.slow
def test_make_random_model_writes_realistic_side_models(tmp_path, capsys):
    from cosystream.cli import main

    assert main(["make-random-model", str(tmp_path / "m"), "--size", "tiny", "--side-models", "realistic"]) == 0
    assert "realistic side models" in capsys.readouterr().out
    assert (tmp_path / "m" / "speech_tokenizer_v2.onnx").stat().st_size > 400e6  # the released size: ≈ 0.5 GB
    assert {node.op_type for node in onnx.load(str(tmp_path / "m" / "campplus.onnx")).graph.node} >= {"Conv",
                                                                                                     "AveragePool"}
