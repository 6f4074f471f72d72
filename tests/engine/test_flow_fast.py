"""The engine's transform of the flow estimator (engine/flow_fast.py): the fused-op step, through the kernels'
torch statements and through the Triton kernels (the CPU interpreter here), computes the plain modules'
numbers and the official mel; the plain methods come back after `restore`.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from cosystream.checkpoint import check_and_load
from cosystream.engine import flow_fast
from cosystream.models.estimator import Estimator, PooledKV
from cosystream.models.flow import Flow

pytestmark = pytest.mark.parity
if not torch.cuda.is_available():
    # the Triton estimator test runs in the CPU interpreter (read when triton is first imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
ATOL_MEL = 1e-4  # fixtures README §3


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


@pytest.mark.parametrize(("key", "streaming", "finalize"), [
    ("mel", False, True), ("mel_streaming_nofinalize", True, False)])
def test_flow_with_fused_op_statements_matches_official(flow, fx, key, streaming, finalize):
    """The fused-op structure of the estimator (what the GPU runs with Triton kernels), through the
    kernels' torch statements, still gives the official mel; the plain modules come back after."""
    from cosystream.kernels import reference

    with _fused(flow.decoder.estimator, reference):
        mel = flow.inference(fx["token"], fx["prompt_token"], fx["prompt_feat"], fx["embedding"], streaming,
                             finalize)
    _close(mel, fx[key])


@contextlib.contextmanager
def _fused(est: Estimator, ops: ModuleType) -> Iterator[None]:
    """The estimator on its fused-op path (as the engine on CUDA), the plain modules back after."""
    est.fuse_projections()
    flow_fast.accelerate(est, ops)
    try:
        yield
    finally:
        flow_fast.restore(est)
        est.unfuse_projections()


def _step_case(est: Estimator, seed: int, rows: int = 2, start: int = 30, num_new: int = 20):
    """A mid-stream step: random cached keys, random conv tails (each row its own), new frames."""
    g = torch.Generator().manual_seed(seed)
    bins = est.dims.out_channels
    x, mu, cond = (torch.randn(rows, bins, num_new, generator=g) for _ in range(3))
    spks, t = torch.randn(rows, bins, generator=g), torch.rand(rows, generator=g)
    conv = torch.randn(rows, est.conv_state_channels, 2, generator=g)
    pool = torch.randn(est.num_attention_blocks, 2, rows + 1, start + num_new + 8, est.inner_dim, generator=g)
    pos = torch.arange(start, start + num_new).expand(rows, -1)
    return (x, mu, spks, cond, t), conv, pool, pos


def _run_step(est: Estimator, case, ops: ModuleType, pool_ops: ModuleType) -> tuple[torch.Tensor, ...]:
    """One step on the engine's pooled path (rows in reverse pool order); returns (v, conv_state, pool)."""
    inputs, conv, pool, pos = case
    conv, pool = conv.clone(), pool.clone()
    rows = torch.arange(pos.shape[0], device=pos.device).flip(0)
    limit = pos[:, -1] + 1
    chunk = est.dims.static_chunk_size
    pooled = PooledKV(pool, rows, pos, limit, chunk, pool.shape[3], pool_ops)
    with torch.no_grad(), _fused(est, ops) if ops is not None else contextlib.nullcontext():
        v = est.step(*inputs, [pooled], conv, pos, [])
    return v, conv, pool


def test_fused_op_statements_step_matches_plain_step(flow):
    """The fused-op structure through the torch statements: the velocity, the new conv tails (every
    channel, as the fused path writes them aside and copies them back) and the new keys."""
    from cosystream.kernels import reference

    est = flow.decoder.estimator
    case = _step_case(est, seed=3)
    v, conv, pool = _run_step(est, case, reference, reference)
    want_v, want_conv, want_pool = _run_step(est, case, None, reference)
    assert not torch.equal(want_conv, case[1])  # the step moved the tails
    _close(v, want_v, 1e-5)
    _close(conv, want_conv, 1e-5)
    _close(pool, want_pool, 1e-5)


def test_triton_estimator_step_matches_plain_step(flow):
    """The estimator step with the Triton ops (CPU interpreter here; tiny model, 20 frames: two frame
    tiles of the conv kernel) against the plain modules."""
    pytest.importorskip("triton")
    from cosystream.kernels import flow as flow_ops
    from cosystream.kernels import reference

    est = flow.decoder.estimator
    case = _step_case(est, seed=4)
    if torch.cuda.is_available():
        est = copy.deepcopy(est).cuda()
        inputs, conv, pool, pos = case
        case = ([a.cuda() for a in inputs], conv.cuda(), pool.cuda(), pos.cuda())
    v, conv, pool = _run_step(est, case, flow_ops, flow_ops)
    want_v, want_conv, want_pool = _run_step(est, case, None, reference)
    atol = 1e-2 if torch.cuda.is_available() else 1e-4  # TF32 dots on a GPU
    _close(v.cpu(), want_v.cpu(), atol)
    _close(conv.cpu(), want_conv.cpu(), atol)
    _close(pool.cpu(), want_pool.cpu(), atol)


@pytest.mark.parametrize("ops", ["plain", "fused"])
def test_step_with_precomputed_step_times_equals_the_step_that_embeds_t(flow, ops):
    """An Euler step given `step_times(t)` (the same for every row; the fused path makes them once per t)
    computes what the step that embeds t row by row computes, on the plain and on the fused-op path; the
    projection can be left to the caller (project=False returns the hidden state the final 1x1 conv reads)."""
    from cosystream.kernels import reference

    est = flow.decoder.estimator
    (x, mu, spks, cond, _), conv, pool, pos = _step_case(est, seed=5)
    t = flow.decoder.t_steps[3]
    t_rows = torch.full((x.shape[0],), t)
    with torch.no_grad(), _fused(est, reference) if ops == "fused" else contextlib.nullcontext():
        kv, bias = [pool[:, :, :x.shape[0]]], [torch.zeros(x.shape[-1], pool.shape[3])]
        want = est.step(x, mu, spks, cond, t_rows, kv, conv.clone(), pos[:1], bias)
        times = est.step_times(t)
        got = est.step(x, mu, spks, cond, torch.full_like(t_rows, float("nan")), kv, conv.clone(), pos[:1], bias,
                       times=times)
        hidden = est.step(x, mu, spks, cond, t_rows, kv, conv.clone(), pos[:1], bias, times=times, project=False)
        assert (est.step_times(t) is times) == (ops == "fused")  # the engine's transform makes them once
        projected = est.final_proj(hidden)
    assert times.t_emb.shape[0] == 1 and len(times.resnet) == len(est.resnets())
    _close(got, want, 1e-5)  # the NaN times were never read (1e-5: one-row vs two-row GEMM sums)
    _close(projected, want, 1e-5)


def test_accelerate_replaces_the_step_of_that_estimator_only_until_restore(flow):
    """The transform swaps the instance's methods (every caller of this estimator runs the fused path) and
    `restore` gives the plain ones back; the model's class is untouched."""
    from cosystream.kernels import reference

    est = flow.decoder.estimator
    plain_step = est.step
    fast = flow_fast.accelerate(est, reference)
    try:
        assert flow_fast.accelerated(est) and est.step == fast.step and est.step_times == fast.step_times
        assert not flow_fast.accelerated(Estimator(est.dims))  # other estimators keep the plain step
    finally:
        flow_fast.restore(est)
    assert not flow_fast.accelerated(est) and est.step == plain_step
    flow_fast.restore(est)  # again: a no-op
