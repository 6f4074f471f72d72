"""CosyVoice2 flow estimator: the causal 1-D U-Net that predicts the CFM velocity (spec/flow.md §5).

One code path serves the whole-sequence call and the incremental streaming step: `step` computes only
the frames it is given, reading the left context of every causal conv from a per-row state and the
keys/values of earlier frames from a cache that it also appends to. The whole-sequence `forward` is
`step` over every frame with an empty state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from cosystream.checkpoint.hparams import EstimatorDims

CONV_CONTEXT = 2  # left frames a kernel-3 causal conv needs (spec/flow.md §5.3)


def masked_value(dtype: torch.dtype) -> float:
    """The additive bias of a masked attention entry: -1e10 as the official mask_to_bias, finite in fp16."""
    return max(-1.0e10, torch.finfo(dtype).min / 2)


def chunk_attention_bias(q_pos: torch.Tensor, num_keys: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention bias [C, num_keys] for queries at absolute positions `q_pos` [C] (ascending).

    Key j is visible to query i iff j <= q_pos[-1] (the key exists) and, when chunk > 0,
    j < (i // chunk + 1) * chunk (static chunk mask, unlimited left context, spec/flow.md §2.6).
    Computed on the device from integers: no host sync, so it works for padded cache views too.
    """
    k_pos = torch.arange(num_keys, device=q_pos.device)
    visible = k_pos[None, :] <= q_pos[-1:, None]
    if chunk > 0:
        chunk_end = (torch.div(q_pos, chunk, rounding_mode="floor") + 1) * chunk
        visible = visible & (k_pos[None, :] < chunk_end[:, None])
    zero = torch.zeros((), device=q_pos.device, dtype=dtype)
    return torch.where(visible, zero, torch.full((), masked_value(dtype), device=q_pos.device, dtype=dtype))


@dataclass
class PooledKV:
    """Keys/values of many streams in one static pool (the engine's batched, CUDA-graphed path).

    pool [blocks, 2, pool_rows, L_max, inner] for one Euler step; batch row r lives in pool row
    rows[r] and writes its new frames at write_pos[r] [C]. Query c of row r sees key j iff
    j < key_limit[r] and, when chunk > 0, j < (write_pos[r, c] // chunk + 1) · chunk; at most the first
    attn_len frames are read (static for a graph). `ops` computes the attention, handed in by the engine:
    the Triton kernel (`cosystream.kernels.flow`) or its torch statement (`cosystream.kernels.reference`).
    """

    pool: torch.Tensor
    rows: torch.Tensor
    write_pos: torch.Tensor
    key_limit: torch.Tensor
    chunk: int
    attn_len: int
    ops: ModuleType
    # The keys of every query are this call's own frames (a whole-utterance pass from frame 0: each row's
    # write_pos = 0, 1, ..., attn_len - 1): attention reads them where the q/k/v projection put them and
    # the pool is neither written nor read (nothing reads it later: each Euler step recomputes every
    # frame), so such a pass needs no slot and may outlive the stream's hold on one (FlowRunner.FinalPass).
    # `rows` is then 0, 1, ..., R - 1: row r's keys are row r of the projection.
    # The engine's fused path (engine/flow_fast.py) writes q/k/v into the pool: these calls never take it.
    own_keys: bool = False

    def __getitem__(self, block: int) -> PooledBlock:
        return PooledBlock(self, block)


@dataclass
class PooledBlock:
    parent: PooledKV
    block: int


@dataclass(frozen=True)
class StepTimes:
    """What an Euler step's time t gives every row alike: the time embedding [1, 4C] and each ResNet's
    time term mlp(t_emb) [1, C] (in `Estimator.resnets` order), from `Estimator.step_times`. PERF: t is one
    of the ODE's ten fixed times, so a caller can make these once per t and hand them to every step
    (the engine's graphs do: FlowRunner.use_constant_step_times) instead of ~15 launches a step."""

    t_emb: torch.Tensor
    resnet: tuple[torch.Tensor, ...]


class CausalConv(nn.Conv1d):
    """Kernel-3 conv whose 2 left frames come from `conv_state` (zeros = the official left padding).

    `conv_state` [R, total_channels, 2] holds the tails of every causal conv of the estimator; this
    conv owns channels [state_offset, state_offset + in_channels) and overwrites them with its new tail.
    """

    def __init__(self, in_channels: int, out_channels: int, layout: list[int]) -> None:
        super().__init__(in_channels, out_channels, CONV_CONTEXT + 1)
        self.state_offset = layout[0]
        layout[0] += in_channels

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        tail = conv_state[:, self.state_offset:self.state_offset + self.in_channels]
        xx = torch.cat([tail, x], dim=2)
        tail.copy_(xx[:, :, -CONV_CONTEXT:])
        return super().forward(xx)


class CausalBlock(nn.Module):
    """Mish(LayerNorm_channels(CausalConv(x))); keys block.0 (conv) and block.2 (norm)."""

    def __init__(self, in_channels: int, out_channels: int, layout: list[int]) -> None:
        super().__init__()
        self.block = nn.ModuleList([CausalConv(in_channels, out_channels, layout), nn.Identity(),
                                    nn.LayerNorm(out_channels), nn.Identity(), nn.Mish()])

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """add [R, C]: a per-channel term added after the Mish (the ResNet's time embedding)."""
        conv, norm = self.block[0], self.block[2]
        h = conv(x, conv_state)
        h = self.block[4](norm(h.transpose(1, 2)).transpose(1, 2))
        return h if add is None else h + add.unsqueeze(-1)


class ResNet(nn.Module):
    """Causal ResNet block with an additive time embedding (spec/flow.md §5.3)."""

    def __init__(self, in_channels: int, out_channels: int, time_dim: int, layout: list[int]) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, out_channels))
        self.block1 = CausalBlock(in_channels, out_channels, layout)
        self.block2 = CausalBlock(out_channels, out_channels, layout)
        self.res_conv = nn.Conv1d(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor, conv_state: torch.Tensor,
                time: torch.Tensor | None = None) -> torch.Tensor:
        """time [R, C]: this block's mlp(t_emb) when precomputed (from StepTimes)."""
        h = self.block1(x, conv_state, add=self.mlp(t_emb) if time is None else time)
        h = self.block2(h, conv_state)
        return h + self.res_conv(x)

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        """res_conv(x) [R, C, T], possibly as a strided view. A channel-contiguous x (the transformers'
        [R, T, C] output, transposed) goes through the 1×1 conv as one GEMM in that layout, with no copy
        to [R, C, T] (a strided copy kernel of ≈ 35 µs at a final pass of 16 streams on the H100)."""
        if not x.transpose(1, 2).is_contiguous():
            return self.res_conv(x)
        return F.linear(x.transpose(1, 2), self.res_conv.weight[:, :, 0], self.res_conv.bias).transpose(1, 2)


class Attention(nn.Module):
    """Bias-free q/k/v self-attention over cached + new frames, one cache per group of rows."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        inner = num_heads * head_dim
        self.num_heads, self.head_dim = num_heads, head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Identity()])
        self.qkv_weight: torch.Tensor | None = None  # set by fuse_projections (not a state-dict key)

    def forward(self, x: torch.Tensor, kv: Sequence[torch.Tensor], write_idx: torch.Tensor,
                attn_bias: Sequence[torch.Tensor]) -> torch.Tensor:
        """x [R, C, dim]; kv[g] [2, rows_g, cap_g, inner] (rows of group g are consecutive in x);
        write_idx [G, C] frame slots of the new keys; attn_bias[g] [C, L_g] (L_g keys are read)."""
        q, k, v = self.project(x)
        if isinstance(kv[0], PooledBlock):
            return self.to_out[0](self._pooled(q, k, v, kv[0]))
        outs, row = [], 0
        # PERF: one SDPA per group reads that request's own cache in place (no gather copy); the
        # dense projections around it stay batched over all rows.
        for g, cache in enumerate(kv):
            rows = slice(row, row + cache.shape[1])
            row += cache.shape[1]
            cache[0].index_copy_(1, write_idx[g], k[rows])
            cache[1].index_copy_(1, write_idx[g], v[rows])
            num_keys = attn_bias[g].shape[-1]
            outs.append(self._attend(q[rows], cache[0, :, :num_keys], cache[1, :, :num_keys], attn_bias[g]))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.to_out[0](out)

    def fuse_projections(self) -> None:
        """PERF: one q/k/v GEMM instead of three (call after the weights are loaded and cast)."""
        self.qkv_weight = torch.cat([self.to_q.weight, self.to_k.weight, self.to_v.weight])

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_weight is None:
            return self.to_q(x), self.to_k(x), self.to_v(x)
        inner = self.num_heads * self.head_dim
        qkv = F.linear(x, self.qkv_weight)
        return qkv[..., :inner], qkv[..., inner:2 * inner], qkv[..., 2 * inner:]

    def _pooled(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, view: PooledBlock) -> torch.Tensor:
        """All rows at once: write the new keys into the pool, then attend over each row's pool row."""
        p = view.parent
        if p.own_keys:
            # PERF: no pool write (2 × rows × frames × inner): the k/v views of the projection are the
            # "pool", row r its own. `ops.pooled_attention` rather than torch SDPA on the same views: cuDNN's
            # flash kernel with a key-length bias takes 123 against 109 ms of attention in a final pass of
            # 16 streams on the H100. The pass's `rows` (0 .. R-1, made once a step) serve every block: no
            # launch of its own here.
            return p.ops.pooled_attention(q, k, v, p.rows, p.write_pos, p.key_limit, p.chunk, p.attn_len,
                                          self.num_heads)
        pool_k, pool_v = p.pool[view.block, 0], p.pool[view.block, 1]
        pool_k[p.rows.unsqueeze(1), p.write_pos] = k
        pool_v[p.rows.unsqueeze(1), p.write_pos] = v
        return p.ops.pooled_attention(q, pool_k, pool_v, p.rows, p.write_pos, p.key_limit, p.chunk, p.attn_len,
                                      self.num_heads)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        rows, num_q, inner = q.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(rows, -1, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=bias.to(q.dtype))
        return out.transpose(1, 2).reshape(rows, num_q, inner)


class GELUProj(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class TransformerBlock(nn.Module):
    """Pre-LN self-attention + GELU feed-forward (diffusers BasicTransformerBlock, spec/flow.md §5.3)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, cache_index: int) -> None:
        super().__init__()
        self.cache_index = cache_index
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, num_heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = nn.Module()
        self.ff.net = nn.ModuleList([GELUProj(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim)])

    def forward(self, x: torch.Tensor, kv: Sequence[torch.Tensor], write_idx: torch.Tensor,
                attn_bias: Sequence[torch.Tensor]) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), [c[self.cache_index] for c in kv], write_idx, attn_bias)
        return x + self.ff.net[2](self.ff.net[0](self.norm3(x)))


class TimeMLP(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim)
        self.linear_2 = nn.Linear(out_dim, out_dim)

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(s)))


def timestep_sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[R] float32 times -> [R, dim] float32 (spec/flow.md §5.1)."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    # PARITY: (1000 * t) first, then times the frequencies, as the official SinusoidalPosEmb.
    arg = 1000 * t.float().unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat([arg.sin(), arg.cos()], dim=-1)


class Estimator(nn.Module):
    """`CausalConditionalDecoder` with state-dict keys of `decoder.estimator.*` in flow.pt."""

    def __init__(self, dims: EstimatorDims) -> None:
        super().__init__()
        c, n = dims.channels, dims.n_blocks
        self.dims = dims
        self.in_channels = dims.in_channels
        self.inner_dim = dims.num_heads * dims.attention_head_dim
        self.time_mlp = TimeMLP(dims.in_channels, 4 * c)
        layout, num_blocks = [0], [0]  # running conv-state offset / attention-block count

        def transformers() -> nn.ModuleList:
            first = num_blocks[0]
            num_blocks[0] += n
            return nn.ModuleList([TransformerBlock(c, dims.num_heads, dims.attention_head_dim, first + i)
                                  for i in range(n)])

        # Built in forward order so conv-state offsets and cache indices follow the data.
        down = [ResNet(dims.in_channels, c, 4 * c, layout), transformers(), CausalConv(c, c, layout)]
        self.down_blocks = nn.ModuleList([nn.ModuleList(down)])
        self.mid_blocks = nn.ModuleList([nn.ModuleList([ResNet(c, c, 4 * c, layout), transformers()])
                                         for _ in range(dims.num_mid_blocks)])
        up = [ResNet(2 * c, c, 4 * c, layout), transformers(), CausalConv(c, c, layout)]
        self.up_blocks = nn.ModuleList([nn.ModuleList(up)])
        self.final_block = CausalBlock(c, c, layout)
        self.final_proj = nn.Conv1d(c, dims.out_channels, 1)
        self.conv_state_channels = layout[0]
        self.num_attention_blocks = num_blocks[0]

    def resnets(self) -> list[ResNet]:
        """The ResNets in the order `step` runs them."""
        return [self.down_blocks[0][0], *(m[0] for m in self.mid_blocks), self.up_blocks[0][0]]

    def fuse_projections(self) -> None:
        """Fuse every attention's q/k/v weights (see Attention.fuse_projections), after loading and casting."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.fuse_projections()

    def unfuse_projections(self) -> None:
        """Drop what fuse_projections built (back to the separate weights)."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.qkv_weight = None

    def new_cache(self, rows: int, num_frames: int, *, device: torch.device | None = None,
                  dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty (kv [blocks, 2, rows, num_frames, inner], conv_state [rows, conv_channels, 2]), one step."""
        p = self.final_proj.weight
        kw = {"device": device or p.device, "dtype": dtype or p.dtype}
        kv = torch.zeros(self.num_attention_blocks, 2, rows, num_frames, self.inner_dim, **kw)
        return kv, torch.zeros(rows, self.conv_state_channels, CONV_CONTEXT, **kw)

    def step(self, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, t: torch.Tensor,
             kv: Sequence[torch.Tensor], conv_state: torch.Tensor, write_idx: torch.Tensor,
             attn_bias: Sequence[torch.Tensor], times: StepTimes | None = None, project: bool = True
             ) -> torch.Tensor:
        """Velocity for C new frames of R rows, given everything before them.

        x, mu, cond: [R, 80, C]; spks: [R, 80]; t: [R] float32. Rows are split into groups (requests),
        group g owning the next kv[g].shape[2] rows. kv[g]: [blocks, 2, rows_g, cap_g, inner], the
        group's keys/values for earlier frames; the new ones are written at frames write_idx[g] [C].
        attn_bias[g]: [C, L_g] additive bias over the first L_g cached frames (chunk_attention_bias).
        conv_state: [R, conv_state_channels, 2], read and updated in place. times: `step_times` of the
        value every row of t holds (t is then not read). Returns v [R, 80, C], or with project=False the
        hidden state [R, C_hidden, C] the final 1x1 projection turns into v (a caller that fuses it).
        No host syncs and no data-dependent Python control flow (CUDA-graph friendly).
        """
        dtype = self.final_proj.weight.dtype
        if times is None:
            t_emb, resnet_times = self.time_terms(t)
        else:
            rows = x.shape[0]
            t_emb = times.t_emb.expand(rows, -1)
            resnet_times = [term.expand(rows, -1) for term in times.resnet]
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]), cond], dim=1).to(dtype)
        time_terms = iter(resnet_times)
        resnet, blocks, conv = self.down_blocks[0]
        h = self._transformers(blocks, resnet(h, t_emb, conv_state, next(time_terms)), kv, write_idx, attn_bias)
        skip = h
        h = conv(h, conv_state)
        for resnet, blocks in self.mid_blocks:
            h = self._transformers(blocks, resnet(h, t_emb, conv_state, next(time_terms)), kv, write_idx, attn_bias)
        resnet, blocks, conv = self.up_blocks[0]
        h = resnet(torch.cat([h, skip], dim=1), t_emb, conv_state, next(time_terms))
        h = conv(self._transformers(blocks, h, kv, write_idx, attn_bias), conv_state)
        h = self.final_block(h, conv_state)
        return self.final_proj(h) if project else h

    def step_times(self, t: float) -> StepTimes:
        """StepTimes of the time t: what every row of an Euler step at t shares."""
        t_emb, terms = self.time_terms(torch.tensor([t], device=self.final_proj.weight.device))
        return StepTimes(t_emb, tuple(terms))

    def time_embedding(self, t: torch.Tensor) -> torch.Tensor:
        """t_emb [R, 4C] for times t [R]."""
        return self.time_mlp(timestep_sinusoid(t, self.in_channels).to(self.final_proj.weight.dtype))

    def time_terms(self, t: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(t_emb [R, 4C], each ResNet's mlp(t_emb) [R, C]) for times t [R]."""
        t_emb = self.time_embedding(t)
        return t_emb, [r.mlp(t_emb) for r in self.resnets()]

    @staticmethod
    def _transformers(blocks: nn.ModuleList, h: torch.Tensor, kv: Sequence[torch.Tensor],
                      write_idx: torch.Tensor, attn_bias: Sequence[torch.Tensor]) -> torch.Tensor:
        h = h.transpose(1, 2)
        for block in blocks:
            h = block(h, kv, write_idx, attn_bias)
        return h.transpose(1, 2)

    def forward(self, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                t: torch.Tensor, streaming: bool) -> torch.Tensor:
        """Whole-sequence call as the official estimator: x, mu, cond [R, 80, F]; spks [R, 80]; t [R].

        Every row is independent; streaming selects the chunk mask (static_chunk_size frames).
        """
        num_frames = x.shape[-1]
        kv, conv_state = self.new_cache(x.shape[0], num_frames)
        pos = torch.arange(num_frames, device=x.device)
        chunk = self.dims.static_chunk_size if streaming else 0
        bias = chunk_attention_bias(pos, num_frames, chunk, kv.dtype)
        return self.step(x, mu, spks, cond, t, [kv], conv_state, pos.unsqueeze(0), [bias])
