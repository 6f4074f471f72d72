"""Plain-torch statements of the fused decode ops: the CPU path and the Triton kernels' test oracle.

Shapes (decode: one new token per row; row b owns cache row b):
    qkv [B, (H + 2·KV)·D]   positions [B] int64 (where the new token is written)
    cache_k / cache_v [slots, KV, max_len, D] (one layer)   cos / sin tables [max_len, D/2] float32
Rounding follows the unfused model step by step (bf16 after every op the model rounds after), so the
fused step computes the same numbers as `SpeechLM.forward` up to summation order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight · rmsnorm(x + residual), x + residual); residual None means x alone is the stream."""
    h = x if residual is None else x + residual
    normed = F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype)
    return weight * normed, h


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache_k: torch.Tensor, cache_v: torch.Tensor, num_heads: int, num_kv_heads: int,
                  slots: torch.Tensor | None = None, all_heads: bool = False) -> torch.Tensor:
    """Rotate q and k (rotate-half RoPE at each row's position), store k and v in cache rows slots[b]
    (rows [0, B) without slots) at `positions`, and return the rotated queries [B, H, D]; all_heads: every
    head as stored, [B, H + 2·KV, D] (q and k rotated, then v: a prefill attends to them without
    reading the cache back)."""
    batch = qkv.shape[0]
    head_dim = cache_k.shape[-1]
    heads = qkv.view(batch, num_heads + 2 * num_kv_heads, head_dim)
    c = torch.cat([cos[positions], cos[positions]], dim=-1).unsqueeze(1)
    s = torch.cat([sin[positions], sin[positions]], dim=-1).unsqueeze(1)
    qk = heads[:, :num_heads + num_kv_heads]
    half = head_dim // 2
    rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
    qk = (qk.float() * c + rotated.float() * s).to(qkv.dtype)
    rows = torch.arange(batch, device=qkv.device) if slots is None else slots
    cache_k[rows, :, positions] = qk[:, num_heads:]
    cache_v[rows, :, positions] = heads[:, num_heads + num_kv_heads:]
    if all_heads:
        return torch.cat([qk, heads[:, num_heads + num_kv_heads:].to(qk.dtype)], dim=1)
    return qk[:, :num_heads].contiguous()


def decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, positions: torch.Tensor,
                     attn_len: int) -> torch.Tensor:
    """Causal attention of each row's one query over its cache positions [0, position]: [B, H·D]."""
    batch, num_heads, head_dim = q.shape
    kv_heads = cache_k.shape[1]
    groups = num_heads // kv_heads
    keys, values = cache_k[:batch, :, :attn_len], cache_v[:batch, :, :attn_len]
    allowed = torch.arange(attn_len, device=q.device).view(1, 1, 1, attn_len) <= positions.view(batch, 1, 1, 1)
    bias = torch.zeros(allowed.shape, device=q.device, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
    out = F.scaled_dot_product_attention(q.view(batch, kv_heads, groups, head_dim), keys, values, attn_mask=bias)
    return out.reshape(batch, num_heads * head_dim)


def rope_attention_linear(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          cache_k: torch.Tensor, cache_v: torch.Tensor, num_heads: int, num_kv_heads: int,
                          attn_len: int, weight: torch.Tensor) -> torch.Tensor:
    """The decode step's attention block for rows [0, B): RoPE and the cache write, attention, and the
    output projection (no bias)."""
    q = rope_write_kv(qkv, positions, cos, sin, cache_k, cache_v, num_heads, num_kv_heads)
    return linear(decode_attention(q, cache_k, cache_v, positions, attn_len), weight)


def prefetching(weights: Sequence[torch.Tensor], window_mb: float | None = None) -> contextlib.AbstractContextManager:
    """L2 prefetch of the step's weights (`cosystream.kernels.prefetch`): a hint with no numbers of its
    own, so here nothing."""
    return contextlib.nullcontext()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for gate_up = [gate | up] along the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, partials: bool = True
           ) -> torch.Tensor:
    """x @ weight^T (+ bias), rounded to x's dtype (nn.Linear's numbers); always the whole output (the
    Triton version may return split-K partial sums unless partials=False)."""
    return F.linear(x, weight, bias)


def silu_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear(silu(gate) · up, weight) for gate_up = [gate | up] (the MLP's down projection)."""
    return F.linear(silu_mul(gate_up), weight)


def pooled_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, rows: torch.Tensor,
                     q_pos: torch.Tensor, key_limit: torch.Tensor, chunk: int, attn_len: int,
                     num_heads: int) -> torch.Tensor:
    """Attention of the flow estimator's new frames over a static K/V pool (keys already written).

    q [R, C, inner] (any strides with a unit last stride); pool_k / pool_v [pool_rows, L_max, inner];
    batch row r reads pool row rows[r]. Query c of row r sits at frame q_pos[r, c] and sees key j iff
    j < key_limit[r] and, when chunk > 0, j < (q_pos[r, c] // chunk + 1) · chunk. Returns [R, C, inner].
    """
    batch, num_q, inner = q.shape
    head_dim = inner // num_heads
    k_pos = torch.arange(attn_len, device=q.device)
    visible = k_pos.view(1, 1, -1) < key_limit.view(-1, 1, 1)
    if chunk > 0:
        chunk_end = (torch.div(q_pos, chunk, rounding_mode="floor") + 1) * chunk
        visible = visible & (k_pos.view(1, 1, -1) < chunk_end.unsqueeze(-1))
    bias = torch.zeros(visible.shape, device=q.device, dtype=q.dtype).masked_fill(~visible, float("-inf"))

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(batch, -1, num_heads, head_dim).transpose(1, 2)

    keys, values = pool_k[rows, :attn_len], pool_v[rows, :attn_len]
    out = F.scaled_dot_product_attention(heads(q), heads(keys), heads(values), attn_mask=bias.unsqueeze(1))
    return out.transpose(1, 2).reshape(batch, num_q, inner)


def partial_rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """Rotate the first `rot` channels of q and k in place (x-transformers' interleaved pairs; the rest of
    each vector keeps its position), then, given pool = (pool_k, pool_v, rows, write_pos), write k and v
    into the pool as `pool_write` does.

    qkv [R, C, 3·inner] = [q | k | v]; cos / sin [R, C, rot] float32 with each pair's angle twice and the
    sine signed (−, +), so that rotated = x·cos + swap_pairs(x)·sin, computed in float32 and rounded once.
    """
    rot = cos.shape[-1]
    parts = qkv.unflatten(-1, (3, -1))
    head = parts[:, :, :2, :rot].float()
    swapped = head.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    parts[:, :, :2, :rot].copy_(torch.addcmul(head * cos[:, :, None], swapped, sin[:, :, None]))
    if pool is not None:
        pool_write(parts[:, :, 1], parts[:, :, 2], *pool)


def grouped_conv_mish(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
    """mish(grouped conv1d of x [R, C, T_in] without padding), weight [C, C / groups, K]: [R, C, T_in − K + 1];
    with residual [R, T, C]: residual + that, transposed to [R, T, C] (the DiT's conv position embedding)."""
    y = F.mish(F.conv1d(x, weight, bias, groups=x.shape[1] // weight.shape[1]))
    return y if residual is None else residual + y.transpose(1, 2)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float, gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(s), s) over the last dimension with s = x + residual, or residual + gate · x with a gate
    [C] (adaLN-zero's gated residual, one rounded addcmul), or x alone without a residual; x may be a
    strided view. Both outputs are contiguous [..., C]."""
    if gate is not None:
        if residual is None:
            raise ValueError("add_layer_norm: a gate needs a residual")
        h = torch.addcmul(residual, gate, x).contiguous()
    else:
        h = (x if residual is None else x + residual).contiguous()
    return F.layer_norm(h, (h.shape[-1],), weight, bias, eps), h


def channel_norm_mish(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                      add: torch.Tensor | None = None) -> torch.Tensor:
    """mish(layer_norm over the channels of x [R, C, T]) (+ add [R, C] per channel): [R, C, T]."""
    h = F.layer_norm(x.transpose(1, 2), (x.shape[1],), weight, bias, eps).transpose(1, 2)
    h = F.mish(h)
    return h if add is None else h + add.unsqueeze(-1)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, offset: int, weight: torch.Tensor, bias: torch.Tensor,
                norm_weight: torch.Tensor | None = None, norm_bias: torch.Tensor | None = None, eps: float = 1e-5,
                mish: bool = False, add: torch.Tensor | None = None, res: torch.Tensor | None = None,
                tail_out: torch.Tensor | None = None) -> torch.Tensor:
    """Kernel-3 causal conv of the new frames x [R, Cin, T] (any strides), left context from the state.

    The 2 frames before x are conv_state[:, offset:offset + Cin] ([R, total, 2]); the last 2 frames of
    [those, x] become the new tail, written there, or into tail_out[:, offset:offset + Cin] (same shape
    as conv_state) when given, conv_state then left untouched. Then, in this order, each rounded to the
    dtype: conv (weight [Cout, Cin, 3]) + bias, LayerNorm over the Cout channels of each frame (when
    norm_weight / norm_bias are given), Mish (when mish), + add [R, Cout] per channel, + res [R, Cout, T].
    Returns [R, Cout, T].
    """
    tail = conv_state[:, offset:offset + x.shape[1]]
    xx = torch.cat([tail, x], dim=2)
    (tail if tail_out is None else tail_out[:, offset:offset + x.shape[1]]).copy_(xx[:, :, -tail.shape[2]:])
    h = F.conv1d(xx, weight, bias)  # on cuDNN: the conv rounded, then + bias rounded (torch adds it after)
    if norm_weight is not None:
        h = F.layer_norm(h.transpose(1, 2), (h.shape[1],), norm_weight, norm_bias, eps).transpose(1, 2)
    if mish:
        h = F.mish(h)
    if add is not None:
        h = h + add.unsqueeze(-1)
    return h if res is None else h + res


def pool_write(k: torch.Tensor, v: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, rows: torch.Tensor,
               write_pos: torch.Tensor) -> None:
    """pool_k[rows[r], write_pos[r, c]] = k[r, c] (and v): new frames' keys/values into the static pool."""
    pool_k[rows.unsqueeze(1), write_pos] = k
    pool_v[rows.unsqueeze(1), write_pos] = v



def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: tuple[torch.Tensor, torch.Tensor, float],
                weight: torch.Tensor, bias: torch.Tensor | None, *, gelu: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, s) with s = x + residual (x alone without one), y = linear(layer_norm(s)) then exact GELU when
    asked; every intermediate rounded as separate torch ops round it. x [R, T, dim] may be strided."""
    normed, total = add_layer_norm(x, residual, *norm)
    y = F.linear(normed, weight, bias)
    return (F.gelu(y) if gelu else y), total


def norm_qkv_pool_write(x: torch.Tensor, residual: torch.Tensor | None, norm: tuple[torch.Tensor, torch.Tensor, float],
                        qkv_weight: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, rows: torch.Tensor,
                        write_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s): the fused q/k/v projection of layer_norm(x + residual); k and v go into the pool (as
    `pool_write`), q [R, T, inner] is returned with the residual stream s."""
    qkv, total = norm_linear(x, residual, norm, qkv_weight, None)
    q, k, v = qkv.chunk(3, dim=-1)
    pool_write(k, v, pool_k, pool_v, rows, write_pos)
    return q.contiguous(), total


def linear_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """linear(x) [R, T, N] for x [R, T, K] (any strides), then + residual [R, T, N] when given: the linear
    rounded, the sum rounded again, as the two torch statements round them. out: where it goes (a
    contiguous [R, T, N] tensor), else a new tensor."""
    y = F.linear(x, weight, bias)
    y = y if residual is None else y + residual
    return y if out is None else out.copy_(y)


def project_cfg_euler(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor,
                      dt: float | torch.Tensor, cfg_rate: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One Euler step of the CFM from the estimator's hidden state: v = 1x1 conv (weight [Cout, Cin, 1],
    bias) of h [2B, Cin, T] (rows: each request's conditional, then unconditional), the CFG mix
    (1 + λ)·v_c − λ·v_u and x + dt · that in float32 (x [B, Cout, T] float32; dt a float or a one-element
    float32 tensor). Returns (the new x, its rows for the next estimator call: each request's x twice, in
    h's dtype) — the statements of `CausalConditionalCFM.euler_step` and `cfg_rows`."""
    v = F.conv1d(h, weight, bias).float()
    x_new = x + dt * ((1.0 + cfg_rate) * v[0::2] - cfg_rate * v[1::2])
    return x_new, x_new.repeat_interleave(2, dim=0).to(h.dtype)


def snake(x: torch.Tensor, alpha: torch.Tensor, eps: float) -> torch.Tensor:
    """HiFT's Snake activation x + sin²(αx)/(α + ε), α [C] per channel of x [B, C, T] (the official
    statement and operation order)."""
    a = alpha[None, :, None]
    return x + (1.0 / (a + eps)) * torch.sin(x * a).pow(2)
