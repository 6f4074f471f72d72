"""HiFT vocoder and its streaming state against the golden fixtures (hift.safetensors, stream.safetensors).

Shapes and lengths are always read from the fixture set, so another set passes unchanged.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from cosystream.checkpoint import check_and_load
from cosystream.engine import vocoder_fast
from cosystream.models.hift import HiFTGenerator, Snake, VocoderStream, is_weight_norm_key, istft, stft

DECODE_ATOL = 1e-5  # fixtures README §3: HiFT decode with the recorded source
SOURCE_ATOL = 1e-3  # fixtures README §3: source from the recorded draws (fp32 phase precision)


@pytest.fixture(scope="module")
def hift(checkpoint) -> HiFTGenerator:
    model = HiFTGenerator(checkpoint.hparams.hift)
    check_and_load(model, checkpoint.hift_state(), "hift.pt")
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def ref(load_fixture) -> dict[str, torch.Tensor]:
    return load_fixture("hift")


@pytest.fixture(scope="module")
def stream(load_fixture) -> dict[str, torch.Tensor]:
    return load_fixture("stream")


def _num_calls(stream: dict[str, torch.Tensor]) -> int:
    calls = [int(m.group(1)) for k in stream if (m := re.fullmatch(r"call(\d+)_yield", k))]
    assert calls and sorted(calls) == list(range(len(calls)))
    return len(calls)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float = 0.0) -> None:
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


# ---- weights and keys ---------------------------------------------------------------------------


@pytest.mark.parity
def test_weight_norm_predicate_matches_official_file(hift, checkpoint, model_dir):
    raw = torch.load(model_dir / "hift.pt", map_location="cpu", weights_only=True)
    raw = {k.removeprefix("generator."): v for k, v in raw.items()}
    official = {k.rsplit(".parametrizations.", 1)[0] for k in raw if ".parametrizations.weight." in k}
    official |= {k[: -len(".weight_g")] for k in raw if k.endswith(".weight_g")}
    ours = {k[: -len(".weight")] for k in hift.state_dict() if is_weight_norm_key(k)}
    assert official and ours == official
    assert set(hift.state_dict()) == set(checkpoint.hift_state())


# ---- parity -------------------------------------------------------------------------------------


@pytest.mark.parity
@pytest.mark.parametrize("prefix", ["", "short_"])
def test_f0_predictor_matches_official(hift, ref, prefix):
    expected = ref[f"{prefix}f0"]
    f0 = hift.predict_f0(ref[f"{prefix}mel"])
    # fixtures README §3 suggests rtol 1e-5; the small atol (relative to the range) covers f0 ≈ 0 frames
    _assert_close(f0, expected, atol=1e-5 * float(expected.abs().max()), rtol=1e-5)


@pytest.mark.parity
def test_source_from_recorded_draws_matches_official(hift, ref):
    source = hift.make_source(ref["short_f0"], noise=ref["short_noise"])
    _assert_close(source, ref["short_source"], atol=SOURCE_ATOL)


@pytest.mark.parity
@pytest.mark.parametrize("mel_key, source_key, speech_key", [
    ("mel", "source", "speech"),
    ("short_mel", "short_source", "short_speech"),
])
def test_decode_matches_official(hift, ref, mel_key, source_key, speech_key):
    _assert_close(hift.decode(ref[mel_key], ref[source_key]), ref[speech_key], atol=DECODE_ATOL)


@pytest.mark.parity
@pytest.mark.parametrize("ops", ["reference", "vocoder"])
def test_decode_with_fused_snakes_matches_official(hift, ref, ops):
    """Every Snake through the fused op (`vocoder`: the Triton kernel, in the CPU interpreter here) or its
    torch statement: the official waveform still; the module's own statement back after."""
    import importlib

    if ops == "vocoder":
        pytest.importorskip("triton")
        import os

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
    kernels = importlib.import_module(f"cosystream.kernels.{ops}")
    device = "cuda" if ops == "vocoder" and torch.cuda.is_available() else "cpu"
    model = copy.deepcopy(hift).to(device)  # float32 on either device
    vocoder_fast.accelerate(model, kernels)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # float32 convolutions on a GPU too
    try:
        wav = model.decode(ref["short_mel"].to(device), ref["short_source"].to(device)).cpu()
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    _assert_close(wav, ref["short_speech"], atol=DECODE_ATOL if device == "cpu" else 1e-4)
    vocoder_fast.restore(model)
    snakes = [m for m in model.modules() if isinstance(m, Snake)]
    assert snakes and all(m.forward.__func__ is Snake.forward for m in snakes)


@pytest.mark.parity
def test_streaming_decode_matches_official(hift, stream):
    for i in range(_num_calls(stream)):
        wav = hift.decode(stream[f"call{i}_hift_in_mel"], stream[f"call{i}_hift_source"])
        _assert_close(wav, stream[f"call{i}_hift_speech_raw"], atol=DECODE_ATOL)


@pytest.mark.parity
def test_non_streaming_decode_matches_official(hift, stream):
    wav = hift.decode(stream["nonstream_flow_mel_full"], stream["nonstream_hift_source"])
    _assert_close(wav, stream["nonstream_yield"], atol=DECODE_ATOL)


@pytest.mark.parity
def test_vocoder_stream_matches_official_yields(hift, stream):
    vocoder, chunks = VocoderStream(hift), []
    num_calls = _num_calls(stream)
    for i in range(num_calls):
        chunk = vocoder.push(stream[f"call{i}_flow_mel_sliced"], final=i == num_calls - 1,
                             source=stream[f"call{i}_hift_source"])
        _assert_close(chunk, stream[f"call{i}_yield"][0], atol=DECODE_ATOL)
        chunks.append(chunk)
    _assert_close(torch.cat(chunks)[None], stream["stream_concat"], atol=DECODE_ATOL)


# ---- streaming behaviour ------------------------------------------------------------------------


def test_stream_emits_480_samples_per_mel_frame(hift, stream):
    vocoder, generator = VocoderStream(hift), torch.Generator().manual_seed(0)
    num_calls, total_frames, total_samples = _num_calls(stream), 0, 0
    withheld = vocoder.num_overlap_samples
    for i in range(num_calls):
        mel = stream[f"call{i}_flow_mel_sliced"]
        is_final = i == num_calls - 1
        chunk = vocoder.push(mel, final=is_final, generator=generator)
        expected_len = 480 * mel.shape[2] - (withheld if i == 0 else 0) + (withheld if is_final else 0)
        assert chunk.shape == (expected_len,) and chunk.dtype == torch.float32
        total_frames, total_samples = total_frames + mel.shape[2], total_samples + chunk.numel()
    assert total_samples == 480 * total_frames
    with pytest.raises(RuntimeError):
        vocoder.push(stream["call0_flow_mel_sliced"], final=True)


def test_inference_overwrites_source_prefix_with_cache(hift, ref):
    mel, cache = ref["short_mel"], ref["short_source"][:, :, :3840]
    wav, source = hift.inference(mel, cache, generator=torch.Generator().manual_seed(7))
    _, fresh = hift.inference(mel, None, generator=torch.Generator().manual_seed(7))
    assert torch.equal(source[:, :, :3840], cache)
    assert torch.equal(source[:, :, 3840:], fresh[:, :, 3840:])
    assert not torch.equal(source[:, :, :3840], fresh[:, :, :3840])
    assert torch.equal(wav, hift.decode(mel, source))


def test_make_source_is_reproducible_with_a_generator(hift, ref):
    f0 = ref["short_f0"]
    a = hift.make_source(f0, generator=torch.Generator().manual_seed(3))
    b = hift.make_source(f0, generator=torch.Generator().manual_seed(3))
    c = hift.make_source(f0, generator=torch.Generator().manual_seed(4))
    assert a.shape == (1, 1, 480 * f0.shape[1]) and torch.equal(a, b) and not torch.equal(a, c)


# ---- fast-path properties -----------------------------------------------------------------------


def test_batched_rows_match_single_rows(hift, ref):
    num_frames = ref["short_mel"].shape[2]
    mels = torch.cat([ref["short_mel"], ref["mel"][:, :, -num_frames:]])  # [2, 80, T]
    noise = torch.cat([ref["short_noise"], ref["short_noise"].flip(1)])
    f0 = hift.predict_f0(mels)
    source = hift.make_source(f0, noise=noise)
    wav = hift.decode(mels, source)
    for row in range(2):
        # each stage is compared on the same input, so only batching itself can make a difference
        one_f0 = hift.predict_f0(mels[row:row + 1])
        _assert_close(f0[row:row + 1], one_f0, atol=1e-5 * float(one_f0.abs().max()), rtol=1e-5)
        one_source = hift.make_source(f0[row:row + 1], noise=noise[row:row + 1])
        _assert_close(source[row:row + 1], one_source, atol=1e-6)
        _assert_close(wav[row:row + 1], hift.decode(mels[row:row + 1], source[row:row + 1]), atol=DECODE_ATOL)


@pytest.mark.parametrize("dtype, max_rel_rms", [(torch.bfloat16, 0.1), (torch.float16, 0.02)])
def test_half_precision_keeps_source_and_head_in_float32(hift, ref, dtype, max_rel_rms):
    low = copy.deepcopy(hift).to(dtype)
    wav, source = low.inference(ref["short_mel"], generator=torch.Generator().manual_seed(0))
    assert wav.dtype == torch.float32 and source.dtype == torch.float32
    reference = hift.decode(ref["short_mel"], ref["short_source"])
    low_wav = low.decode(ref["short_mel"], ref["short_source"])
    rel_rms = (low_wav - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()
    assert rel_rms < max_rel_rms


def test_own_stft_and_istft_match_torch():
    generator = torch.Generator().manual_seed(0)
    wav = torch.randn(2, 4 * 50, generator=generator)
    window = torch.hann_window(16, periodic=True)
    spec = stft(wav, 16, 4)  # [2, 18, 51]
    expected = torch.stft(wav, 16, 4, 16, window=window, return_complex=True)
    _assert_close(spec, torch.cat([expected.real, expected.imag], dim=1), atol=1e-5)
    magnitude, phase = torch.rand(2, 9, 51, generator=generator), torch.randn(2, 9, 51, generator=generator)
    expected_wav = torch.istft(torch.polar(magnitude, phase), 16, 4, 16, window=window)
    _assert_close(istft(magnitude, phase, 16, 4), expected_wav, atol=1e-6)
    real, imag = spec[:, :9], spec[:, 9:]
    _assert_close(istft(real.hypot(imag), imag.atan2(real), 16, 4), wav, atol=1e-5)
