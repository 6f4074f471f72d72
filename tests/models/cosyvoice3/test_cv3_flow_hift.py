"""The DiT flow and the causal HiFT against flow.safetensors / hift.safetensors of the CosyVoice3 set."""

from __future__ import annotations

import hashlib

import pytest
import torch

from cosystream.models.cfm import cosine_schedule
from cosystream.models.cosyvoice3.hift import noise_rng_state, sine_noise_table

MEL_ATOL = 1e-4  # README §C3: flow mel (streaming or not, finalize or not)
HIFT_DECODE_ATOL = 1e-5  # HiFT decode with the recorded source
HIFT_ATOL = 2e-4  # HiFT source / speech from mel (float32 vs float64 phase accumulation)

pytestmark = pytest.mark.parity

MEL_CASES = [("mel", False, True), ("mel_streaming_finalize", True, True),
             ("mel_streaming_nofinalize", True, False), ("mel_nostreaming_nofinalize", False, False)]


@pytest.mark.parametrize("key,streaming,finalize", MEL_CASES)
def test_flow_mel(cv3_flow, cv3_load, key, streaming, finalize):
    f = cv3_load("flow")
    with torch.no_grad():
        mel = cv3_flow.inference(f["token"], f["prompt_token"], f["prompt_feat"], f["embedding"], streaming, finalize)
    lookahead = 0 if finalize else cv3_flow.dims.pre_lookahead_len
    assert mel.shape == f[key].shape == (1, 80, cv3_flow.ratio * (f["token"].shape[1] - lookahead))
    torch.testing.assert_close(mel, f[key], rtol=0, atol=MEL_ATOL)


def test_streaming_mask_changes_the_mel(cv3_load):
    """Sanity of the fixture pair used above: the chunk mask must matter, or the mask tests prove nothing."""
    f = cv3_load("flow")
    assert (f["mel"] - f["mel_streaming_finalize"]).abs().max() > 10 * MEL_ATOL


def test_flow_debug_tensors(cv3_flow, cv3_load):
    f = cv3_load("flow")
    est = cv3_flow.decoder.estimator
    calls: list[tuple[torch.Tensor, ...]] = []
    handle = est.register_forward_hook(lambda mod, args, out: calls.append((*args[:5], out[0])))
    try:
        with torch.no_grad():
            cv3_flow.inference(f["token"], f["prompt_token"], f["prompt_feat"], f["embedding"], False, True)
            tokens = torch.cat([f["prompt_token"], f["token"]], dim=1).long()
            pre = cv3_flow.pre_lookahead_layer(cv3_flow.input_embedding(tokens), True)
            spks = cv3_flow.project_speaker(f["embedding"])
    finally:
        handle.remove()
    exact = {"rtol": 0, "atol": 1e-6}
    torch.testing.assert_close(pre, f["dbg_pre_lookahead_out"], **exact)
    torch.testing.assert_close(spks, f["dbg_spks_projected"], **exact)
    assert len(calls) == cv3_flow.dims.n_timesteps == f["dbg_est_t_all"].numel()
    x, mu, spks_in, cond, t, out = calls[0]
    torch.testing.assert_close(mu[:1], f["dbg_est0_mu"], **exact)
    torch.testing.assert_close(cond[:1], f["dbg_est0_cond"], **exact)
    assert not mu[1:].any() and not cond[1:].any() and not spks_in[1:].any()  # unconditional row
    torch.testing.assert_close(x[0], x[1])
    torch.testing.assert_close(t, f["dbg_est0_t"], **exact)
    torch.testing.assert_close(torch.tensor(cosine_schedule(cv3_flow.dims.n_timesteps)[0]), f["dbg_est_t_all"],
                               **exact)
    torch.testing.assert_close(torch.stack([c[4][0] for c in calls]), f["dbg_est_t_all"], **exact)
    with torch.no_grad():
        torch.testing.assert_close(est.time_embed(t), f["dbg_est0_time_embed"], rtol=0, atol=1e-5)
        h, _, _ = est.embed_inputs(x, mu, spks_in, cond, None)
        torch.testing.assert_close(h[:1], f["dbg_est0_input_embed_row0"], rtol=0, atol=1e-5)
        freqs = est.rotary_embed.freqs(torch.arange(h.shape[1]))
        block0, _ = est.transformer_blocks[0](h, est.time_embed(t), freqs, None, None)
        torch.testing.assert_close(block0[:1], f["dbg_est0_block0_out_row0"], rtol=0, atol=MEL_ATOL)
    torch.testing.assert_close(out, f["dbg_est0_out"], rtol=0, atol=MEL_ATOL)
    torch.testing.assert_close(calls[-1][5], f["dbg_est_last_out"], rtol=0, atol=MEL_ATOL)


def test_rotary_reaches_only_the_first_head(cv3_flow):
    est = cv3_flow.decoder.estimator
    dims = est.dims
    q = torch.randn(1, 7, dims.heads * dims.dim_head)
    from cosystream.models.cosyvoice3.dit import apply_partial_rotary

    turned = apply_partial_rotary(q, est.rotary_embed.freqs(torch.arange(3, 10)))
    assert torch.equal(turned[..., dims.dim_head:], q[..., dims.dim_head:])
    assert not torch.allclose(turned[..., :dims.dim_head], q[..., :dims.dim_head])


def test_noise_recipe_reproduces_the_official_state_and_buffers(cv3_hift, cv3_load, cv3_manifest):
    h = cv3_load("hift")
    state = noise_rng_state(cv3_hift.dims)
    assert torch.equal(state, h["rng_state_before_sinegen"])
    first = h["sine_waves_first_480"]
    table = sine_noise_table(state, cv3_hift.dims.sampling_rate, first.shape[2])
    assert torch.equal(table[:, :first.shape[1]], first)
    assert hashlib.sha256(table.numpy().tobytes()).hexdigest() == \
        cv3_manifest["vocoder_buffers"]["sine_waves_sha256_first_1s"]
    assert torch.equal(cv3_hift.m_source.noise_table[:, :first.shape[1]], first)


@pytest.mark.parametrize("finalize", [True, False])
def test_hift_f0_source_speech(cv3_hift, cv3_load, finalize):
    h = cv3_load("hift")
    suffix = "" if finalize else "_nofinalize"
    frames = h["mel"].shape[2]
    with torch.no_grad():
        f0 = cv3_hift.predict_f0(h["mel"], finalize)
        wav, source = cv3_hift.inference(h["mel"], finalize)
    u = cv3_hift.upsample_scale
    withheld = 0 if finalize else cv3_hift.f0_predictor.look_right + cv3_hift.look_right + 1
    assert wav.shape == h["speech" + suffix].shape == (1, u * (frames - withheld))
    torch.testing.assert_close(f0, h["f0" + suffix], rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(source, h["source" + suffix], rtol=0, atol=HIFT_ATOL)
    torch.testing.assert_close(wav, h["speech" + suffix], rtol=0, atol=HIFT_ATOL)


@pytest.mark.parametrize("finalize", [True, False])
def test_hift_decode_with_recorded_source(cv3_hift, cv3_load, finalize):
    h = cv3_load("hift")
    suffix = "" if finalize else "_nofinalize"
    body = h["mel"] if finalize else h["mel"][:, :, :-cv3_hift.f0_predictor.look_right]
    with torch.no_grad():
        wav = cv3_hift.decode(body, h["source" + suffix], finalize)
    torch.testing.assert_close(wav, h["speech" + suffix], rtol=0, atol=HIFT_DECODE_ATOL)
