"""Parity of the flow (encoder, estimator, CFM) with the official CausalMaskedDiffWithXvec.

Fixtures: flow.safetensors, stream.safetensors (schedule from manifest.json), the CFM noise prefix.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from cosystream.checkpoint import check_and_load
from cosystream.models.cfm import NOISE_FRAMES, build_noise_table
from cosystream.models.flow import Flow

pytestmark = pytest.mark.parity
ATOL_MEL = 1e-4  # fixtures README §3
ATOL_INTERNAL = 1e-4


@pytest.fixture(scope="module")
def flow(checkpoint, cfm_noise) -> Flow:
    model = Flow(checkpoint.hparams.flow)
    check_and_load(model, checkpoint.flow_state(), "flow.pt")
    model.decoder.set_noise_table(cfm_noise)
    return model.eval()


@pytest.fixture(scope="module")
def fx(load_fixture) -> dict[str, torch.Tensor]:
    return load_fixture("flow")


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL_MEL) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def test_state_dict_keys_and_shapes_equal_flow_pt(checkpoint):
    ours = Flow(checkpoint.hparams.flow).state_dict()
    official = checkpoint.flow_state()
    assert set(ours) == set(official)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in official.items()}
    assert not any("rand_noise" in k for k in ours)


def test_noise_table_recipe_matches_stored_prefix(manifest, cfm_noise):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        official = torch.randn(1, 80, NOISE_FRAMES)
    table = build_noise_table()
    assert torch.equal(table, official)  # local generator == the global-seed recipe, bit for bit
    prefix = table[:, :, :cfm_noise.shape[2]]
    here = hashlib.sha256(official.numpy().tobytes()).hexdigest()
    if here == manifest.get("cfm_rand_noise", {}).get("sha256_of_official_table_here"):
        assert torch.equal(prefix, cfm_noise)
    else:  # another CPU kernel: the recipe is not bit-portable (fixtures README)
        assert (prefix - cfm_noise).abs().max().item() < 1e-5


def test_speaker_projection_matches_official(flow, fx):
    with torch.no_grad():
        _close(flow.project_speaker(fx["embedding"]), fx["dbg_spks_projected"], 1e-6)


def test_encoder_and_projection_match_official(flow, fx):
    tokens = torch.cat([fx["prompt_token"], fx["token"]], dim=1)
    with torch.no_grad():
        h = flow.encode(tokens, streaming=False, finalize=True)
        _close(h, fx["dbg_encoder_out"], ATOL_INTERNAL)
        _close(flow.encoder_proj(h), fx["dbg_mu_btc"], ATOL_INTERNAL)


def test_first_estimator_call_matches_official(flow, fx):
    assert torch.all(fx["dbg_est0_mask"] == 1)  # the mask is all ones: our estimator takes none
    with torch.no_grad():
        inputs = [fx[f"dbg_est0_{k}"] for k in ("x", "mu", "spks", "cond", "t")]
        v = flow.decoder.estimator(*inputs, streaming=False)
    _close(v, fx["dbg_est0_out"], ATOL_INTERNAL)


def test_time_grid_matches_official(flow, fx):
    assert torch.equal(torch.tensor(flow.decoder.t_steps, dtype=torch.float32), fx["dbg_est_t_all"])


@pytest.mark.parametrize(("key", "streaming", "finalize"), [
    ("mel", False, True), ("mel_streaming_finalize", True, True), ("mel_streaming_nofinalize", True, False)])
def test_flow_matches_official(flow, fx, key, streaming, finalize):
    mel = flow.inference(fx["token"], fx["prompt_token"], fx["prompt_feat"], fx["embedding"], streaming,
                         finalize)
    assert mel.dtype == torch.float32
    _close(mel, fx[key])


def test_streaming_schedule_calls_match_official(flow, load_fixture, manifest):
    s = load_fixture("stream")
    schedule = manifest["stream"]["schedule"]
    assert len(schedule) >= 2
    for i, call in enumerate(schedule):
        tokens = s["token"][:, :call["n_tokens"]]
        mel = flow.inference(tokens, s["prompt_token"], s["prompt_feat"], s["embedding"],
                             streaming=call["flow_streaming"], finalize=call["flow_finalize"])
        _close(mel, s[f"call{i}_flow_mel_full"])


def test_resnet_residual_of_a_transposed_input_is_its_conv(flow):
    """A channel-contiguous input (the transformers' output, transposed) takes the 1×1 residual conv as a
    GEMM in its own layout: the same numbers as the conv of a contiguous copy, and no copy of the input."""
    resnet = flow.decoder.estimator.mid_blocks[0][0]
    c = resnet.res_conv.in_channels
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 17, c, generator=g).transpose(1, 2)  # [R, C, T] view of [R, T, C]
    with torch.no_grad():
        got = resnet.residual(x)
        want = resnet.res_conv(x.contiguous())
    _close(got, want, 1e-5)
    assert got.transpose(1, 2).is_contiguous()  # written in the input's layout: nothing was transposed
    with torch.no_grad():
        _close(resnet.residual(x.contiguous()), want, 0)


def test_the_encoders_shared_rel_position_table_gives_each_calls_rows(checkpoint):
    """UpsampleConformerEncoder.rel_table: slices of one table of every distance (grown on demand) hold the
    very numbers rel_position_table makes for each call's distances."""
    from cosystream.engine.loader import load_flow
    from cosystream.models.flow import rel_position_table

    enc = load_flow(checkpoint).encoder
    for start, n in [(0, 25), (150, 28), (10, 3), (4500, 200), (300, 50)]:  # the fourth grows the table
        distances = torch.arange(start + n - 1, -n, -1, dtype=torch.float32)
        want = rel_position_table(distances, enc.dims.output_size)
        assert torch.equal(enc.rel_table(start, n, torch.device("cpu"), torch.float32), want), (start, n)
    assert len(enc._rel_tables) == 1 and enc._rel_tables[("cpu", torch.float32)][0] >= 4699
    assert len(enc._outgrown) == 1  # the first table stays alive: a graph captured before may read it


def test_the_encoders_fused_qkv_projection_changes_no_number(checkpoint):
    """The loader fuses each conformer layer's q/k/v weights (one GEMM and one cache write); the encoder
    computes what the three separate projections compute."""
    from cosystream.engine.loader import load_flow

    enc = load_flow(checkpoint).encoder
    assert all(layer.self_attn.qkv is not None for layer in [*enc.encoders, *enc.up_encoders])
    emb = torch.randn(2, 20, enc.embed.out[0].in_features, generator=torch.Generator().manual_seed(0))

    def encode() -> torch.Tensor:
        state = enc.new_state(40).batch_rows(2)
        return enc.step_batch(emb, None, *state, 0, streaming=True)[0]

    fused = encode()
    for layer in [*enc.encoders, *enc.up_encoders]:
        layer.self_attn.qkv = None
    torch.testing.assert_close(fused, encode(), atol=1e-6, rtol=0)
