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
from cosystream.kernels import prefetch

CONV_CONTEXT = 2  # left frames a kernel-3 causal conv needs (spec/flow.md §5.3)
# PERF: up to this many rows (CFG rows × new frames) the Triton GEMMs with the LayerNorm in their prologue
# beat cuBLAS + a separate norm kernel on the H100 (4.4 vs 6.5 µs at 200 rows); at 1,600 rows they lose
# (12.0 vs 11.0 µs), so bigger batches keep the cuBLAS path (benchmarks/kernel_tiles.py).
PROLOGUE_GEMM_MAX_ROWS = 512


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
    attn_len frames are read (static for a graph). `ops` computes the attention: the Triton kernel
    (`cosystream.kernels.flow`) or its torch statement (`cosystream.kernels.reference`).
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
    # The fused ops' path writes q/k/v into the pool: these calls never take it.
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
    time term mlp(t_emb) [1, C] (in `Estimator.resnets` order). PERF: t is one of the ODE's ten fixed
    times, so these are made once per t (`Estimator.step_times`) instead of by ~15 launches a step."""

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

    kernels: ModuleType | None = None  # fused ops (Estimator.set_kernels); None: plain torch

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor,  # type: ignore[override]
                tail_out: torch.Tensor | None = None) -> torch.Tensor:
        """tail_out (fused ops only): where the new tail goes instead of conv_state (see Estimator.step)."""
        if self.kernels is not None:
            return self.kernels.causal_conv(x, conv_state, self.state_offset, self.weight, self.bias,
                                            tail_out=tail_out)
        assert tail_out is None, "tail_out needs the fused ops"
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

    kernels: ModuleType | None = None  # fused ops (Estimator.set_kernels); None: plain torch

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, add: torch.Tensor | None = None,
                res: torch.Tensor | None = None, tail_out: torch.Tensor | None = None) -> torch.Tensor:
        """add [R, C]: a per-channel term added after the Mish (the ResNet's time embedding).
        res [R, C, T] (added last) and tail_out (see Estimator.step): fused ops only."""
        conv, norm = self.block[0], self.block[2]
        if self.kernels is not None:
            # PERF: conv, bias, norm, Mish, time add and the ResNet's residual add in one kernel
            return self.kernels.causal_conv(x, conv_state, conv.state_offset, conv.weight, conv.bias, norm.weight,
                                            norm.bias, norm.eps, mish=True, add=add, res=res, tail_out=tail_out)
        assert res is None and tail_out is None, "res and tail_out need the fused ops"
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
                time: torch.Tensor | None = None, tail_out: torch.Tensor | None = None) -> torch.Tensor:
        """time [R, C]: this block's mlp(t_emb) when precomputed (Estimator.step batches them, or takes
        them from StepTimes); tail_out (fused ops only) as CausalConv."""
        if self.block1.kernels is None:
            h = self.block1(x, conv_state, add=self.mlp(t_emb) if time is None else time)
            h = self.block2(h, conv_state)
            return h + self.res_conv(x)
        prefetch.before(self.block1.block[0].weight)
        res, branch = self._residual_beside(x)
        h = self.block1(x, conv_state, add=self.mlp(t_emb) if time is None else time, tail_out=tail_out)
        if branch is not None:
            torch.cuda.current_stream(x.device).wait_stream(branch)
        return self.block2(h, conv_state, res=res, tail_out=tail_out)

    def _residual_beside(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Stream | None]:
        """(res_conv(x), the branch computing it or None). PERF: on the chunk path (a Triton GEMM) on a
        branch stream while the first conv runs: it needs only x, and only the second conv's epilogue reads
        it, so it leaves the step's critical path (14 of its ≈ 365 kernels)."""
        branch = prefetch.branch(x.device) if self._residual_is_triton(x) else None
        if branch is None:
            return self._residual(x), None
        out = torch.empty(x.shape[0], x.shape[2], self.res_conv.out_channels, device=x.device, dtype=x.dtype)
        with torch.cuda.stream(branch):
            self._residual(x, out=out)
        return out.transpose(1, 2), branch

    def _residual_is_triton(self, x: torch.Tensor) -> bool:
        return self.block1.kernels is not None and x.shape[0] * x.shape[2] <= PROLOGUE_GEMM_MAX_ROWS

    def _residual(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """res_conv(x) [R, C, T], possibly as a strided view (the fused conv reads any strides); out [R, T, C]
        (the chunk path only): where it goes.
        PERF: a channel-contiguous x (the transformers' [R, T, C] output, transposed) goes through the 1×1
        conv as one GEMM in that layout; the conv would first copy it to [R, C, T] (strided copy kernels of
        ≈ 35 µs each at a final pass of 16 streams)."""
        weight = self.res_conv.weight[:, :, 0]
        if self._residual_is_triton(x):
            # the chunk path: a Triton GEMM that reads either layout (its launch overlaps the conv before)
            return self.block1.kernels.linear_residual(x.transpose(1, 2), weight, self.res_conv.bias,
                                                       out=out).transpose(1, 2)
        assert out is None, "out: the chunk path's GEMM only"
        if not x.transpose(1, 2).is_contiguous():
            return self.res_conv(x)
        return F.linear(x.transpose(1, 2), weight, self.res_conv.bias).transpose(1, 2)


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
        self.kernels: ModuleType | None = None  # fused ops (Estimator.set_kernels)

    def forward(self, x: torch.Tensor, kv: Sequence[torch.Tensor], write_idx: torch.Tensor,
                attn_bias: Sequence[torch.Tensor]) -> torch.Tensor:
        """x [R, C, dim]; kv[g] [2, rows_g, cap_g, inner] (rows of group g are consecutive in x);
        write_idx [G, C] frame slots of the new keys; attn_bias[g] [C, L_g] (L_g keys are read)."""
        q, k, v = self._project(x)
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

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
            # "pool", row r its own. (torch SDPA on the same views, cuDNN's flash kernel with a key-length
            # bias, measured slower on the H100: 123 vs 109 ms of attention in a final pass of 16 streams.)
            # The pass's `rows` (0 .. R-1, made once a step) serve every block: no launch of its own here.
            return p.ops.pooled_attention(q, k, v, p.rows, p.write_pos, p.key_limit, p.chunk, p.attn_len,
                                          self.num_heads)
        pool_k, pool_v = p.pool[view.block, 0], p.pool[view.block, 1]
        if self.kernels is not None:
            self.kernels.pool_write(k, v, pool_k, pool_v, p.rows, p.write_pos)
        else:
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

    kernels: ModuleType | None = None  # fused ops (Estimator.set_kernels)

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


def _version(t: torch.Tensor) -> int:
    """t's in-place modification count (0 for inference tensors, which keep none: nothing modifies them)."""
    try:
        return t._version
    except RuntimeError:
        return 0


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
        self.kernels: ModuleType | None = None
        # every ResNet's time Linear stacked (fuse_projections; not state-dict keys)
        self.time_weight: torch.Tensor | None = None
        self.time_bias: torch.Tensor | None = None
        self._step_times: dict[tuple, StepTimes] = {}
        # L2 prefetch window of a step's weights on CUDA (cosystream.kernels.prefetch; 0: off): the next
        # ResNets' and transformer blocks' weights pulled into L2 on a side stream while the step runs.
        self.l2_prefetch_mb = 0.0

    def resnets(self) -> list[ResNet]:
        """The ResNets in the order `step` runs them."""
        return [self.down_blocks[0][0], *(m[0] for m in self.mid_blocks), self.up_blocks[0][0]]

    def set_kernels(self, ops: ModuleType | None) -> None:
        """Use fused ops (`cosystream.kernels.flow`, or `.reference` for their torch statements) for the
        causal convs with their norms and adds, the LayerNorms, the pool writes and the residual adds;
        None: the plain modules."""
        self.kernels = ops
        for module in self.modules():
            if isinstance(module, (CausalConv, CausalBlock, TransformerBlock, Attention)):
                module.kernels = ops

    def fuse_projections(self) -> None:
        """Fuse every attention's q/k/v weights (see Attention.fuse_projections) and stack the ResNets' time
        Linears (used with fused ops), after loading and casting."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.fuse_projections()
        linears = [r.mlp[1] for r in self.resnets()]
        self.time_weight = torch.cat([lin.weight for lin in linears])
        self.time_bias = torch.cat([lin.bias for lin in linears])

    def unfuse_projections(self) -> None:
        """Drop what fuse_projections built (back to the separate weights)."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.qkv_weight = None
        self.time_weight = self.time_bias = None

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
        wanted = self.l2_prefetch_mb > 0 and self.final_proj.weight.is_cuda
        with prefetch.prefetching(self.step_weights() if wanted else [], self.l2_prefetch_mb):
            return self._step(x, mu, spks, cond, t, kv, conv_state, write_idx, attn_bias, times, project)

    def step_weights(self) -> list[torch.Tensor]:
        """The big weights of a step in the order the fused path reads them (ResNet convs and res conv, each
        transformer block's q/k/v, output and feed-forward weights, the sampling convs, the final block)."""
        def resnet(r: ResNet) -> list[torch.Tensor]:
            return [r.block1.block[0].weight, r.block2.block[0].weight, r.res_conv.weight]

        def transformers(blocks: nn.ModuleList) -> list[torch.Tensor]:
            return [w for b in blocks for w in (b.attn1.qkv_weight if b.attn1.qkv_weight is not None
                                                else b.attn1.to_q.weight, b.attn1.to_out[0].weight,
                                                b.ff.net[0].proj.weight, b.ff.net[2].weight)]

        (down, down_blocks, down_conv), (up, up_blocks, up_conv) = self.down_blocks[0], self.up_blocks[0]
        weights = [*resnet(down), *transformers(down_blocks), down_conv.weight]
        for r, blocks in self.mid_blocks:
            weights += [*resnet(r), *transformers(blocks)]
        weights += [*resnet(up), *transformers(up_blocks), up_conv.weight, self.final_block.block[0].weight]
        return weights

    def _step(self, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, t: torch.Tensor,
              kv: Sequence[torch.Tensor], conv_state: torch.Tensor, write_idx: torch.Tensor,
              attn_bias: Sequence[torch.Tensor], times: StepTimes | None, project: bool) -> torch.Tensor:
        dtype = self.final_proj.weight.dtype
        if times is None:
            t_emb, resnet_times = self._time_terms(t)
        else:
            rows = x.shape[0]
            t_emb = times.t_emb.expand(rows, -1)
            resnet_times = [term.expand(rows, -1) for term in times.resnet]
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]), cond], dim=1).to(dtype)
        time_terms = iter(resnet_times)
        # Fused ops: every conv reads its old tail from conv_state and writes the new one into `tail`,
        # copied back once at the end (a conv's kernel cannot update its tail in place without a race,
        # and one copy per step beats one per conv). Every state channel belongs to one conv.
        tail = None if self.kernels is None else torch.empty_like(conv_state)
        resnet, blocks, conv = self.down_blocks[0]
        h = self._transformers(blocks, resnet(h, t_emb, conv_state, next(time_terms), tail), kv, write_idx, attn_bias)
        skip = h
        h = conv(h, conv_state, tail)
        for resnet, blocks in self.mid_blocks:
            h = self._transformers(blocks, resnet(h, t_emb, conv_state, next(time_terms), tail), kv, write_idx,
                                   attn_bias)
        resnet, blocks, conv = self.up_blocks[0]
        h = resnet(torch.cat([h, skip], dim=1), t_emb, conv_state, next(time_terms), tail)
        h = conv(self._transformers(blocks, h, kv, write_idx, attn_bias), conv_state, tail)
        h = self.final_block(h, conv_state, tail_out=tail)
        if tail is not None:
            conv_state.copy_(tail)
        return self.final_proj(h) if project else h

    def step_times(self, t: float) -> StepTimes:
        """StepTimes of the time t, made once per t and weights (a cache keyed by t and the time weights'
        storage and version, so reloaded or cast weights make new ones). Inside a CUDA-graph capture an
        uncached t is computed into the graph and not kept (its memory belongs to the graph's pool)."""
        params = [*self.time_mlp.parameters(), *(p for r in self.resnets() for p in r.mlp.parameters())]
        params += [p for p in (self.time_weight, self.time_bias) if p is not None]
        key = (t, self.kernels is None, tuple((p.data_ptr(), _version(p), p.dtype) for p in params))
        cached = self._step_times.get(key)
        if cached is not None:
            return cached
        p = self.final_proj.weight
        t_emb, terms = self._time_terms(torch.tensor([t], device=p.device))
        made = StepTimes(t_emb, tuple(terms))
        # never dropped: captured graphs read these tensors (a few KB per t and weights version)
        if not (p.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._step_times[key] = made
        return made

    def _time_terms(self, t: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(t_emb [R, 4C], each ResNet's mlp(t_emb) [R, C]) for times t [R]. PERF: on the fused path one
        Mish and one GEMM for all 14 ResNets instead of 14 of each."""
        t_emb = self.time_mlp(timestep_sinusoid(t, self.in_channels).to(self.final_proj.weight.dtype))
        if self.kernels is None or self.time_weight is None:
            return t_emb, [r.mlp(t_emb) for r in self.resnets()]
        times = F.linear(F.mish(t_emb), self.time_weight, self.time_bias)
        return t_emb, list(times.split(self.dims.channels, dim=1))

    @staticmethod
    def _transformers(blocks: nn.ModuleList, h: torch.Tensor, kv: Sequence[torch.Tensor],
                      write_idx: torch.Tensor, attn_bias: Sequence[torch.Tensor]) -> torch.Tensor:
        ops = blocks[0].kernels
        if (ops is not None and isinstance(kv[0], PooledKV) and blocks[0].attn1.qkv_weight is not None
                and h.shape[0] * h.shape[2] <= PROLOGUE_GEMM_MAX_ROWS and not kv[0].own_keys):
            return Estimator._pooled_transformers(blocks, h, kv[0], ops)
        h = h.transpose(1, 2)
        if ops is None:
            for block in blocks:
                h = block(h, kv, write_idx, attn_bias)
            return h.transpose(1, 2)
        # PERF: each residual add rides in the next LayerNorm's kernel (one kernel instead of add + norm,
        # and no copy of the transposed input)
        pending = None
        for block in blocks:
            n1, n3 = block.norm1, block.norm3
            a, h = ops.add_layer_norm(h if pending is None else pending, None if pending is None else h,
                                      n1.weight, n1.bias, n1.eps)
            attn = block.attn1(a, [c[block.cache_index] for c in kv], write_idx, attn_bias)
            m, h = ops.add_layer_norm(attn, h, n3.weight, n3.bias, n3.eps)
            pending = block.ff.net[2](block.ff.net[0](m))
        return (h + pending).transpose(1, 2)

    @staticmethod
    def _pooled_transformers(blocks: nn.ModuleList, h: torch.Tensor, pooled: PooledKV, ops: ModuleType
                             ) -> torch.Tensor:
        """The engine's path: 5 kernels per block instead of 9. The residual add and LayerNorm ride in the
        prologue of the GEMM that consumes them (their row of 256 fits one tile), the q/k/v GEMM writes k/v
        straight into the pool and GELU rides in the first feed-forward GEMM; the output and second
        feed-forward projections are plain GEMMs (Triton ones carrying a whole-row LayerNorm epilogue
        measured slower), the last block's with the group's final residual add in its epilogue. Every
        intermediate is rounded where the module path rounds it."""
        x, res = h.transpose(1, 2), None
        for i, block in enumerate(blocks):
            attn, n1, n3 = block.attn1, block.norm1, block.norm3
            pool_k, pool_v = pooled.pool[block.cache_index, 0], pooled.pool[block.cache_index, 1]
            prefetch.before(attn.qkv_weight)
            # (One kernel for the projection and the attention, each program projecting its head's keys and
            # values of the row's new frames itself, measured slower on the H100 at 2be48f4: 14.8 against 10.4
            # µs for a first chunk's 72 rows, its ODE 28.3 against 19.8 ms; removed after that commit.)
            q, res = ops.norm_qkv_pool_write(x, res, (n1.weight, n1.bias, n1.eps), attn.qkv_weight, pool_k, pool_v,
                                             pooled.rows, pooled.write_pos)
            o = pooled.ops.pooled_attention(q, pool_k, pool_v, pooled.rows, pooled.write_pos, pooled.key_limit,
                                            pooled.chunk, pooled.attn_len, attn.num_heads)
            ff1, ff2, out = block.ff.net[0].proj, block.ff.net[2], attn.to_out[0]
            f, res = ops.norm_linear(ops.linear_residual(o, out.weight, out.bias), res,
                                     (n3.weight, n3.bias, n3.eps), ff1.weight, ff1.bias, gelu=True)
            x = ops.linear_residual(f, ff2.weight, ff2.bias, res if i == len(blocks) - 1 else None)
        return x.transpose(1, 2)

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
