"""The CosyVoice3 flow estimator: a DiT with adaLN-zero, a causal conv position embedding and rotary
position on the first head's channels only (spec/cosyvoice3.md §5.3).

Module and parameter names mirror `flow.pt` (`decoder.estimator.*`). `DiT.forward` runs `n` new frames
whose absolute positions start at `start`; with a `DiTCache` holding the keys/values of frames
[0, start) and the tails of the conv position embedding, a stream only computes its new frames.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from cosystream.checkpoint.hparams import DiTDims

_LN_EPS = 1e-6


def _layer_norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), eps=_LN_EPS)


class TimestepEmbedding(nn.Module):
    """t [B] -> [B, dim]: 256-d sinusoid (scale 1000, sin first) -> Linear -> SiLU -> Linear."""

    def __init__(self, dim: int, freq_dim: int = 256) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        scale = math.log(10000) / (half - 1)
        freqs = torch.exp(torch.arange(half, device=t.device).float() * -scale)
        # PARITY: (1000 · t) · freq, in this order, then [sin, cos]
        angles = 1000 * t.float().unsqueeze(1) * freqs.unsqueeze(0)
        hidden = torch.cat((angles.sin(), angles.cos()), dim=-1).to(t.dtype)
        return self.time_mlp(hidden.to(self.time_mlp[0].weight.dtype))


class CausalConvPositionEmbedding(nn.Module):
    """Two grouped Conv1d(dim, dim, 31) + Mish, each after a left pad of 30 (the pad is a carried tail)."""

    def __init__(self, dim: int, kernel_size: int, groups: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())

    def forward(self, x: torch.Tensor, tail1: torch.Tensor | None = None, tail2: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, n, dim] -> (out [B, n, dim], conv1 input [B, dim, pad + n], conv2 input [B, dim, pad + n]).

        tail1/tail2 [B, dim, pad]: the inputs of conv1/conv2 for the `pad` frames before x (None: zeros,
        the official left padding at frame 0).
        """
        pad = self.kernel_size - 1
        h = x.transpose(1, 2)
        in1 = torch.cat([tail1, h], dim=2) if tail1 is not None else F.pad(h, (pad, 0))
        out1 = self.conv1(in1)
        in2 = torch.cat([tail2, out1], dim=2) if tail2 is not None else F.pad(out1, (pad, 0))
        return self.conv2(in2).transpose(1, 2), in1, in2


class InputEmbedding(nn.Module):
    def __init__(self, dims: DiTDims) -> None:
        super().__init__()
        self.proj = nn.Linear(dims.mel_dim * 2 + dims.mu_dim + dims.spk_dim, dims.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(dims.dim, dims.conv_pos_kernel, dims.conv_pos_groups)


class RotaryEmbedding(nn.Module):
    """x-transformers rotary: interleaved pairs, `inv_freq` a persistent buffer (stored in flow.pt)."""

    def __init__(self, dim_head: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim_head, 2).float() / dim_head)))

    def freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [n] -> angles [n, dim_head], each frequency repeated twice (f0, f0, f1, f1, ...)."""
        angles = positions.to(self.inv_freq.dtype).unsqueeze(1) * self.inv_freq.unsqueeze(0)
        return torch.stack((angles, angles), dim=-1).flatten(-2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention whose float32 is IEEE float32 on a GPU too.

    PARITY: for float32 on sm80+ the memory-efficient SDPA kernel multiplies on tensor cores (CUTLASS
    `OpMultiplyAddFastF32`, a 3xTF32 split) whatever `torch.backends.cuda.matmul.allow_tf32` says, so a
    float32 model would round its attention unlike the CPU and unlike what its flags ask. The math
    backend's products are cuBLAS matmuls, which follow the float32 precision setting. bf16/fp16 keep the
    fused kernels.
    """
    if q.dtype == torch.float32 and q.is_cuda:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def apply_partial_rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate the first `freqs.shape[-1]` channels of x [B, n, H·dh] (head 0 only), keep the rest."""
    rot = freqs.shape[-1]
    head, rest = x[..., :rot], x[..., rot:]
    # PARITY: computed in float32 as x-transformers' apply_rotary_pos_emb (scale 1)
    turned = (head.float() * freqs.cos()) + (_rotate_pairs(head.float()) * freqs.sin())
    return torch.cat((turned.to(x.dtype), rest), dim=-1)


class AdaLayerNormZero(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * 6)


class AdaLayerNormZeroFinal(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * 2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        inner = heads * dim_head
        self.heads, self.dim_head = heads, dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        inner = int(dim * mult)
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")), nn.Identity(),
                                nn.Linear(inner, dim))


class DiTBlock(nn.Module):
    def __init__(self, dims: DiTDims) -> None:
        super().__init__()
        self.attn_norm = AdaLayerNormZero(dims.dim)
        self.attn = Attention(dims.dim, dims.heads, dims.dim_head)
        self.ff = FeedForward(dims.dim, dims.ff_mult)

    def forward(self, h: torch.Tensor, t_emb: torch.Tensor, freqs: torch.Tensor, mask: torch.Tensor | None,
                past: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """h [B, n, dim]; mask [n, past + n] bool (True = attend) or None (all); past: cached (k, v)
        [B, H, P, dh]. Returns the new h and this call's (k, v) [B, H, n, dh]."""
        shift1, scale1, gate1, shift2, scale2, gate2 = self.attn_norm.linear(F.silu(t_emb)).chunk(6, dim=1)
        normed = _layer_norm(h) * (1 + scale1[:, None]) + shift1[:, None]
        attn, kv = self._attention(normed, freqs, mask, past)
        h = h + gate1.unsqueeze(1) * attn
        normed = _layer_norm(h) * (1 + scale2[:, None]) + shift2[:, None]
        return h + gate2.unsqueeze(1) * self.ff.ff(normed), kv

    def _attention(self, x: torch.Tensor, freqs: torch.Tensor, mask: torch.Tensor | None,
                   past: tuple[torch.Tensor, torch.Tensor] | None
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        a = self.attn
        batch, n, _ = x.shape
        q = apply_partial_rotary(a.to_q(x), freqs)
        k = apply_partial_rotary(a.to_k(x), freqs)
        v = a.to_v(x)
        q, k, v = (y.view(batch, n, a.heads, a.dim_head).transpose(1, 2) for y in (q, k, v))
        new_kv = (k, v)
        if past is not None and past[0].shape[2] > 0:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        out = attend(q, k, v, mask)
        out = out.transpose(1, 2).reshape(batch, n, a.heads * a.dim_head)
        return a.to_out[0](out), new_kv


def block_causal_mask(start: int, n: int, block: int, device: torch.device | str) -> torch.Tensor:
    """[n, start + n] bool: query frame i (absolute start..start+n−1) attends key j iff
    j < (⌊i / block⌋ + 1)·block (official `subsequent_chunk_mask`, from absolute frame 0)."""
    queries = torch.arange(start, start + n, device=device)
    keys = torch.arange(start + n, device=device)
    return keys.unsqueeze(0) < ((queries // block + 1) * block).unsqueeze(1)


@dataclass
class DiTCache:
    """Keys/values of frames [0, length) for every layer and the conv position-embedding tails.

    Only frames whose hidden states can no longer change are committed: with the block-causal mask,
    the frames of complete attention blocks.
    """

    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [B, H, length, dh]
    values: list[torch.Tensor] = field(default_factory=list)
    tail1: torch.Tensor | None = None  # [B, dim, pad] conv1 input before frame `length`
    tail2: torch.Tensor | None = None
    length: int = 0


@dataclass
class DiTPending:
    """What one incremental call computed, for `DiTCache` to commit a prefix of."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    in1: torch.Tensor  # conv1 input incl. the previous tail [B, dim, pad + n]
    in2: torch.Tensor


def commit(cache: DiTCache, pending: DiTPending, frames: int) -> None:
    """Append the first `frames` new frames of `pending` to `cache`."""
    if frames <= 0:
        return
    pad = pending.in1.shape[2] - pending.kv[0][0].shape[2]
    if cache.keys:
        cache.keys = [torch.cat([old, k[:, :, :frames]], dim=2) for old, (k, _) in zip(cache.keys, pending.kv,
                                                                                           strict=True)]
        cache.values = [torch.cat([old, v[:, :, :frames]], dim=2) for old, (_, v) in zip(cache.values, pending.kv,
                                                                                             strict=True)]
    else:
        cache.keys = [k[:, :, :frames] for k, _ in pending.kv]
        cache.values = [v[:, :, :frames] for _, v in pending.kv]
    cache.tail1 = pending.in1[:, :, frames:frames + pad]
    cache.tail2 = pending.in2[:, :, frames:frames + pad]
    cache.length += frames


class DiT(nn.Module):
    """Estimator: (x, mu, spks, cond, t) -> velocity, layout [B, 80, n] in and out."""

    def __init__(self, dims: DiTDims) -> None:
        super().__init__()
        self.dims = dims
        self.time_embed = TimestepEmbedding(dims.dim, dims.time_freq_dim)
        self.input_embed = InputEmbedding(dims)
        self.rotary_embed = RotaryEmbedding(dims.dim_head)
        self.transformer_blocks = nn.ModuleList(DiTBlock(dims) for _ in range(dims.depth))
        self.norm_out = AdaLayerNormZeroFinal(dims.dim)
        self.proj_out = nn.Linear(dims.dim, dims.mel_dim)

    def embed_inputs(self, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                     cache: DiTCache | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (h [B, n, dim] after the conv position embedding, conv1 input, conv2 input)."""
        n = x.shape[2]
        # PARITY: the input order is x, cond, mu, spks (the CosyVoice2 U-Net packs x, mu, spks, cond)
        packed = torch.cat([x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2),
                            spks.unsqueeze(1).expand(-1, n, -1)], dim=-1)
        h = self.input_embed.proj(packed)
        tails = (cache.tail1, cache.tail2) if cache is not None and cache.length > 0 else (None, None)
        pos, in1, in2 = self.input_embed.conv_pos_embed(h, *tails)
        return pos + h, in1, in2

    def forward(self, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, t: torch.Tensor,
                streaming: bool, cache: DiTCache | None = None) -> tuple[torch.Tensor, DiTPending]:
        """Velocity [B, 80, n] for frames [start, start + n), start = cache.length (0 without a cache).

        x, mu, cond [B, 80, n]; spks [B, 80]; t [B]. streaming: block-causal attention (else full attention
        over the cached and new frames).
        """
        start = cache.length if cache is not None else 0
        n = x.shape[2]
        t_emb = self.time_embed(t)
        h, in1, in2 = self.embed_inputs(x, mu, spks, cond, cache)
        freqs = self.rotary_embed.freqs(torch.arange(start, start + n, device=x.device))
        mask = block_causal_mask(start, n, self.dims.static_chunk_size, x.device) if streaming else None
        kv = []
        for i, block in enumerate(self.transformer_blocks):
            past = (cache.keys[i], cache.values[i]) if cache is not None and cache.keys else None
            h, new_kv = block(h, t_emb, freqs, mask, past)
            kv.append(new_kv)
        scale, shift = self.norm_out.linear(F.silu(t_emb)).chunk(2, dim=1)
        h = _layer_norm(h) * (1 + scale)[:, None, :] + shift[:, None, :]
        return self.proj_out(h).transpose(1, 2), DiTPending(kv=kv, in1=in1, in2=in2)
