"""The Triton decode kernels compute what their torch statements in kernels/reference.py compute."""

from __future__ import annotations

import pytest
import torch

from cosystream.kernels import decode, reference

H, KV, D = 14, 2, 64  # the 0.5B model's attention heads


@pytest.fixture
def dtype(device: str) -> torch.dtype:
    # Triton's CPU interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest), so on the CPU
    # the kernels are checked in float32, where the interpreter is exact.
    return torch.bfloat16 if device == "cuda" else torch.float32


def _tol(dtype: torch.dtype) -> float:
    return 4e-3 if dtype == torch.bfloat16 else 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(device: str, dtype: torch.dtype, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 896, generator=g).to(device, dtype)
    r = torch.randn(5, 896, generator=g).to(device, dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(896, generator=g)).to(device, dtype)
    out, res = decode.add_rms_norm(x, r, w, 1e-6)
    want_out, want_res = reference.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(res, want_res)  # the residual add is rounded exactly like torch's bf16 add
    assert _rel(out, want_out) < _tol(dtype)  # one rounding of a float32 sum taken in another order


def test_silu_mul(device: str, dtype: torch.dtype) -> None:
    x = torch.randn(3, 2 * 4864, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    assert _rel(decode.silu_mul(x), reference.silu_mul(x)) < _tol(dtype)


def _cache(device: str, dtype: torch.dtype, slots: int = 4, max_len: int = 300, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, KV, max_len, D, generator=g).to(device, dtype)
    v = torch.randn(slots, KV, max_len, D, generator=g).to(device, dtype)
    return k, v


def _rope_tables(max_len: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(max_len).float().unsqueeze(1) * 1e4 ** (-torch.arange(D // 2) / (D // 2))
    return angles.cos().to(device), angles.sin().to(device)


def test_rope_write_kv(device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    batch, max_len = 3, 300
    qkv = torch.randn(batch, (H + 2 * KV) * D, generator=g).to(device, dtype)
    positions = torch.tensor([0, 17, 299], device=device)
    cos, sin = _rope_tables(max_len, device)
    k1, v1 = _cache(device, dtype, max_len=max_len)
    k2, v2 = k1.clone(), v1.clone()
    q = decode.rope_write_kv(qkv, positions, cos, sin, k1, v1, H, KV)
    want_q = reference.rope_write_kv(qkv, positions, cos, sin, k2, v2, H, KV)
    assert _rel(q, want_q) < _tol(dtype)
    assert _rel(k1, k2) < _tol(dtype) and torch.equal(v1, v2)  # k rotated, v copied, nothing else touched
    rows = torch.arange(batch, device=device)
    assert _rel(k1[rows, :, positions], k2[rows, :, positions]) < _tol(dtype)


def test_rope_write_kv_hands_back_every_head_as_written(device: str, dtype: torch.dtype) -> None:
    """all_heads (the prefill's attention reads its own keys from it): q and k rotated and v, exactly what
    the queries alone are and what went into the cache rows, and the same cache writes."""
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(4, (H + 2 * KV) * D, generator=g).to(device, dtype)
    positions = torch.tensor([0, 1, 2, 3], device=device)
    slots = torch.tensor([2, 2, 2, 2], device=device)
    cos, sin = _rope_tables(16, device)
    for ops in (decode, reference):
        k1, v1 = _cache(device, dtype, max_len=16)
        k2, v2 = k1.clone(), v1.clone()
        heads = ops.rope_write_kv(qkv, positions, cos, sin, k1, v1, H, KV, slots=slots, all_heads=True)
        q = ops.rope_write_kv(qkv, positions, cos, sin, k2, v2, H, KV, slots=slots)
        assert heads.shape == (4, H + 2 * KV, D)
        assert torch.equal(heads[:, :H], q) and torch.equal(k1, k2) and torch.equal(v1, v2)
        assert torch.equal(heads[:, H:H + KV], k1[2, :, :4].transpose(0, 1))
        assert torch.equal(heads[:, H + KV:], v1[2, :, :4].transpose(0, 1))


@pytest.mark.parametrize("attn_len", [64, 256, 1024])
def test_decode_attention(device: str, dtype: torch.dtype, attn_len: int) -> None:
    g = torch.Generator().manual_seed(attn_len)
    batch = 3
    k, v = _cache(device, dtype, max_len=attn_len + 64, seed=attn_len)
    q = torch.randn(batch, H, D, generator=g).to(device, dtype)
    positions = torch.tensor([0, attn_len // 3, attn_len - 1], device=device)
    out = decode.decode_attention(q, k, v, positions, attn_len)
    want = reference.decode_attention(q.double(), k.double(), v.double(), positions, attn_len)
    assert out.shape == (batch, H * D)
    assert _rel(out, want) < (1e-2 if dtype == torch.bfloat16 else 1e-5)  # bf16: probabilities rounded


def test_decode_attention_ignores_keys_past_each_row(device: str, dtype: torch.dtype) -> None:
    # keys beyond a row's position must not matter: poison them and expect the same answer
    k, v = _cache(device, dtype, max_len=256)
    q = torch.randn(2, H, D, generator=torch.Generator().manual_seed(9)).to(device, dtype)
    positions = torch.tensor([10, 100], device=device)
    first = decode.decode_attention(q, k, v, positions, 256)
    k[0, :, 11:], v[0, :, 11:], k[1, :, 101:], v[1, :, 101:] = 1e4, 1e4, -1e4, 1e4
    assert torch.equal(decode.decode_attention(q, k, v, positions, 256), first)


@pytest.mark.parametrize(("batch", "attn_len", "parts"), [(4, 300, 0), (4, 300, 3), (33, 128, 2)])
def test_rope_attention_linear(device: str, dtype: torch.dtype, batch: int, attn_len: int, parts: int) -> None:
    """The attention block (RoPE and the cache write inside the attention kernel) equals its unfused
    statement: output and the whole cache. 33 rows: past the weight-streaming linear. parts: the q/k/v
    projection handed over as split-K partial sums."""
    g = torch.Generator().manual_seed(batch + parts)
    x, w, b = _linear_case(device, dtype, batch, (H + 2 * KV) * D, 256, seed=parts)
    qkv = decode.linear(x, w, b, tile=decode.LinearTile(64, 64, parts, 4, 2)) if parts else reference.linear(x, w, b)
    # rows at position 0, at split edges (64 keys a split) and at the last attended position
    edges = torch.tensor([0, 63, 64, attn_len - 1])
    positions = edges[torch.arange(batch) % 4].to(device)
    cos, sin = _rope_tables(attn_len + 8, device)
    k1, v1 = _cache(device, dtype, slots=batch, max_len=attn_len + 8, seed=batch)
    rows = torch.arange(batch, device=device)
    k1[rows, :, positions], v1[rows, :, positions] = 1e4, -1e4  # stale: the new key/value must replace them
    k2, v2 = k1.clone(), v1.clone()
    o_w = (torch.randn(H * D, H * D, generator=g) * (H * D) ** -0.5).to(device, dtype)
    out = _whole(decode.rope_attention_linear(qkv, positions, cos, sin, k1, v1, H, KV, attn_len, o_w))
    want = reference.rope_attention_linear(reference.linear(x, w, b), positions, cos, sin, k2, v2, H, KV, attn_len,
                                           o_w)
    assert out.shape == (batch, H * D)
    assert _rel(out, want) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert _rel(k1, k2) < _tol(dtype) and _rel(v1, v2) < _tol(dtype)
    assert _rel(k1[rows, :, positions], k2[rows, :, positions]) < _tol(dtype)


def test_rope_attention_linear_refuses_mismatched_heads(device: str, dtype: torch.dtype) -> None:
    qkv = torch.zeros(2, (H + 2 * KV) * D, device=device, dtype=dtype)
    k, v = _cache(device, dtype, slots=2, max_len=64)
    cos, sin = _rope_tables(64, device)
    with pytest.raises(ValueError, match="does not hold 12 query and 2 × 2 key/value heads"):
        decode.rope_attention_linear(qkv, torch.zeros(2, dtype=torch.long, device=device), cos, sin, k, v, 12, KV,
                                     64, torch.zeros(H * D, H * D, device=device, dtype=dtype))


def _linear_case(device: str, dtype: torch.dtype, rows: int, n_out: int, n_in: int, seed: int, silu: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * n_in if silu else n_in, generator=g).to(device, dtype)
    w = (torch.randn(n_out, n_in, generator=g) * n_in ** -0.5).to(device, dtype)
    b = (0.1 * torch.randn(n_out, generator=g)).to(device, dtype)
    return x, w, b


def _whole(y: torch.Tensor) -> torch.Tensor:
    return y.float().sum(0) if y.dim() == 3 else y.float()


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("tile", [decode.LinearTile(32, 64, 1, 4, 2), decode.LinearTile(16, 64, 3, 4, 2)])
def test_linear(device: str, dtype: torch.dtype, rows: int, with_bias: bool, tile: decode.LinearTile) -> None:
    # 200 outputs, 320 inputs: off the tiles (masked lanes), and 3 splits of 128 leave the last one short
    x, w, b = _linear_case(device, dtype, rows, 200, 320, seed=rows)
    bias = b if with_bias else None
    y = decode.linear(x, w, bias, tile=tile)
    if tile.splits > 1:  # float32 partial sums, the bias counted once
        assert y.shape == (3, rows, 200) and y.dtype == torch.float32
    else:
        assert y.shape == (rows, 200) and y.dtype == dtype
    assert _rel(_whole(y), reference.linear(x, w, bias)) < _tol(dtype)
    plain = decode.linear(x, w, bias, tile=tile, partials=False)
    assert plain.shape == (rows, 200) and _rel(plain, reference.linear(x, w, bias)) < _tol(dtype)


def test_silu_linear(device: str, dtype: torch.dtype) -> None:
    x, w, _ = _linear_case(device, dtype, 4, 96, 300, seed=7, silu=True)
    y = decode.silu_linear(x, w, tile=decode.LinearTile(32, 64, 2, 4, 2))
    assert y.shape == (2, 4, 96)
    assert _rel(_whole(y), reference.silu_linear(x, w)) < _tol(dtype)


def test_linear_refuses_partial_sums_as_input(device: str, dtype: torch.dtype) -> None:
    x, w, _ = _linear_case(device, dtype, 2, 64, 128, seed=9)
    partial = decode.linear(x, w, tile=decode.LinearTile(32, 32, 2, 4, 2))
    with pytest.raises(ValueError, match="whole"):
        decode.silu_linear(partial, w[:, :64])
    with pytest.raises(ValueError, match="contiguous"):
        decode.linear(x.t().contiguous().t(), w)


def test_linear_past_max_rows_is_torchs(device: str, dtype: torch.dtype) -> None:
    x, w, b = _linear_case(device, dtype, decode.MAX_LINEAR_ROWS + 1, 64, 96, seed=8)
    assert torch.equal(decode.linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_norm_and_rope_add_up_partials(device: str, dtype: torch.dtype) -> None:
    """Consumers of a split linear: add_rms_norm and rope_write_kv sum the partials, then round once."""
    g = torch.Generator().manual_seed(11)
    x, w, _ = _linear_case(device, dtype, 3, 896, 256, seed=12)
    partial = decode.linear(x, w, tile=decode.LinearTile(64, 64, 4, 4, 2))
    r = torch.randn(3, 896, generator=g).to(device, dtype)
    nw = (1 + 0.1 * torch.randn(896, generator=g)).to(device, dtype)
    out, res = decode.add_rms_norm(partial, r, nw, 1e-6)
    want_out, want_res = reference.add_rms_norm(reference.linear(x, w), r, nw, 1e-6)
    assert _rel(res, want_res) < _tol(dtype) and _rel(out, want_out) < _tol(dtype)

    x, w, b = _linear_case(device, dtype, 3, (H + 2 * KV) * D, 256, seed=13)
    qkv = decode.linear(x, w, b, tile=decode.LinearTile(64, 64, 2, 4, 2))
    positions = torch.tensor([0, 17, 299], device=device)
    cos, sin = _rope_tables(300, device)
    k1, v1 = _cache(device, dtype, max_len=300)
    k2, v2 = k1.clone(), v1.clone()
    q = decode.rope_write_kv(qkv, positions, cos, sin, k1, v1, H, KV)
    want_q = reference.rope_write_kv(reference.linear(x, w, b), positions, cos, sin, k2, v2, H, KV)
    assert _rel(q, want_q) < _tol(dtype) and _rel(k1, k2) < _tol(dtype) and _rel(v1, v2) < _tol(dtype)


@pytest.mark.parametrize("split_all", [False, True])
def test_triton_decode_step_matches_fixture_logp(checkpoint, load_fixture, device: str, split_all: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole fused decode step on the Triton kernels (on the CPU in the interpreter, float32)
    reproduces the official teacher-forced log-probs of the fixture; split_all: every linear of the
    step hands float32 partials to its consumer (the tiny model's own tiles split only the down one)."""
    from cosystream.engine.loader import load_llm
    from cosystream.models.qwen2 import KVCache

    if split_all:
        monkeypatch.setattr(decode, "_default_tile", lambda n_out, n_in: decode.LinearTile(32, 32, 2, 4, 2))

    lm = load_llm(checkpoint, device)
    f = load_fixture("llm")
    forced = f["forced_tokens"].tolist()[:6]
    n0 = f["lm_input"].shape[1]
    cache = KVCache(lm.dims, 1, n0 + len(forced) + 8, device, torch.float32)
    lm(f["lm_input"].to(device), torch.tensor([0], device=device), cache, attn_len=n0,
       slots=torch.tensor([0], device=device))
    for step, token in enumerate(forced[:-1]):
        emb = lm.speech_embedding.weight[token][None]
        h = lm.decode(emb, torch.tensor([n0 + step], device=device), cache, cache.max_len, decode)
        torch.testing.assert_close(lm.logp(h)[0].cpu(), f["step_logp"][step + 1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("n", [12, 20])  # 24 rows: the Triton linears; 40 rows: torch's GEMMs
def test_triton_prefill_computes_forwards_numbers(checkpoint, device: str, n: int) -> None:
    """The fused prefill on the Triton kernels matches the unfused forward: hidden states and the
    keys/values written into the prompts' cache rows."""
    from cosystream.engine.loader import load_llm
    from cosystream.models.qwen2 import KVCache

    lm = load_llm(checkpoint, device)
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(2, n, lm.dims.hidden_size, generator=g) * 0.5).to(device)
    slots = torch.tensor([2, 0], device=device)
    caches = [KVCache(lm.dims, max_slots=3, max_len=32, device=device, dtype=torch.float32) for _ in range(2)]
    fused = lm.prefill(x, slots, caches[0], decode)
    plain = lm(x, torch.zeros(2, dtype=torch.long, device=device), caches[1], attn_len=n, slots=slots)
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[0].k, caches[1].k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[0].v, caches[1].v, atol=1e-4, rtol=1e-4)
