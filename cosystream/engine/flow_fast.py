"""The flow estimator's step as the engine runs it: fused ops, L2 prefetch and a branch stream.

`models.estimator.Estimator` is plain PyTorch. `accelerate(estimator, ops, prefetch_mb)` applies the
speed-ups from outside, in gpt-fast's manner: it replaces the estimator's `step` and `step_times` on that
instance, so every caller (the pool's graphs, the per-request eager flow, `Flow.inference`) runs this path;
`restore` puts the plain methods back. `ops` is `cosystream.kernels.flow` (Triton, CUDA) or
`cosystream.kernels.reference` (the same ops as torch statements, which the CPU's tests run); either way
the step computes the plain modules' numbers, every intermediate rounded where the modules round it.

What this path changes, all of it scheduling or fusion:
- each causal conv with its bias, LayerNorm over channels, Mish, time term and ResNet residual is one
  `ops.causal_conv`; the convs write their new tails aside and one copy per step puts them back;
- each residual add rides in the next LayerNorm (`ops.add_layer_norm`), the pool write is `ops.pool_write`;
- on the chunk path of one or two streams (at most PROLOGUE_GEMM_MAX_ROWS rows) every GEMM of a
  transformer block is a Triton kernel with the norm in its prologue (`_pooled_transformers`), and the
  ResNet's 1×1 residual projection runs on a branch stream beside its first conv (a parallel node of the
  CUDA graph);
- the 14 ResNets' time MLPs are one GEMM over their stacked weights, and each Euler step's time terms
  are made once per t (`step_times`);
- on CUDA with `prefetch_mb` > 0 the weights of the next ResNets and transformer blocks are pulled into
  L2 on a side stream while the step runs (`cosystream.kernels.prefetch`).
The streams belong to this thread (`kernels.prefetch` keeps one side and one branch stream per thread),
so the token-to-wave worker's graphs never share them with the LM's.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from cosystream.kernels import prefetch
from cosystream.models.estimator import (
    Attention,
    CausalBlock,
    CausalConv,
    Estimator,
    PooledBlock,
    PooledKV,
    ResNet,
    StepTimes,
)

# Up to this many rows (CFG rows × new frames) the Triton GEMMs with the LayerNorm in their prologue beat
# cuBLAS + a separate norm kernel on the H100 (4.4 vs 6.5 µs at 200 rows); at 1,600 rows they lose (12.0 vs
# 11.0 µs), so bigger batches keep the cuBLAS path (benchmarks/kernel_tiles.py, retired in f313fec:
# `git show f313fec^:benchmarks/kernel_tiles.py`).
PROLOGUE_GEMM_MAX_ROWS = 512


def accelerate(est: Estimator, ops: ModuleType, prefetch_mb: float = 0.0) -> FastEstimator:
    """Run `est`'s steps through `ops` from now on (see the module docstring); call after the weights are
    loaded, cast and their projections fused (they are not modified after). Returns the transform."""
    fast = FastEstimator(est, ops, prefetch_mb)
    est.step = fast.step  # type: ignore[method-assign]
    est.step_times = fast.step_times  # type: ignore[method-assign]
    return fast


def restore(est: Estimator) -> None:
    """The plain modules' `step` and `step_times` again (a no-op on a plain estimator)."""
    for name in ("step", "step_times"):
        est.__dict__.pop(name, None)


def accelerated(est: Estimator) -> bool:
    """Whether `accelerate` replaced the estimator's step."""
    return "step" in est.__dict__


class FastEstimator:
    """An estimator's step through fused ops (`accelerate`); same contract as `Estimator.step`."""

    def __init__(self, est: Estimator, ops: ModuleType, prefetch_mb: float = 0.0) -> None:
        self.est = est
        self.ops = ops
        self.prefetch_mb = prefetch_mb  # the L2 prefetch window on CUDA (0: off)
        linears = [r.mlp[1] for r in est.resnets()]
        self.time_weight = torch.cat([lin.weight for lin in linears])  # every ResNet's time Linear stacked
        self.time_bias = torch.cat([lin.bias for lin in linears])
        self._step_times: dict[float, StepTimes] = {}

    # ------------------------------------------------------------------ the step
    def step(self, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, t: torch.Tensor,
             kv: Sequence[torch.Tensor], conv_state: torch.Tensor, write_idx: torch.Tensor,
             attn_bias: Sequence[torch.Tensor], times: StepTimes | None = None, project: bool = True
             ) -> torch.Tensor:
        """`Estimator.step` through the fused ops (no host syncs: CUDA-graph friendly)."""
        wanted = self.prefetch_mb > 0 and self.est.final_proj.weight.is_cuda
        with prefetch.prefetching(self.step_weights() if wanted else [], self.prefetch_mb):
            return self._step(x, mu, spks, cond, t, kv, conv_state, write_idx, attn_bias, times, project)

    def _step(self, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, t: torch.Tensor,
              kv: Sequence[torch.Tensor], conv_state: torch.Tensor, write_idx: torch.Tensor,
              attn_bias: Sequence[torch.Tensor], times: StepTimes | None, project: bool) -> torch.Tensor:
        est = self.est
        if times is None:
            resnet_times = self.time_terms(t)[1]
        else:
            resnet_times = [term.expand(x.shape[0], -1) for term in times.resnet]
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]), cond], dim=1)
        h = h.to(est.final_proj.weight.dtype)
        time_terms = iter(resnet_times)
        # Every conv reads its old tail from conv_state and writes the new one into `tail`, copied back once
        # at the end: a conv's kernel cannot update its tail in place without a race, and one copy per step
        # beats one per conv. Every state channel belongs to one conv.
        tail = torch.empty_like(conv_state)
        resnet, blocks, conv = est.down_blocks[0]
        h = self._transformers(blocks, self._resnet(resnet, h, conv_state, next(time_terms), tail), kv, write_idx,
                               attn_bias)
        skip = h
        h = self._conv(conv, h, conv_state, tail)
        for resnet, blocks in est.mid_blocks:
            h = self._transformers(blocks, self._resnet(resnet, h, conv_state, next(time_terms), tail), kv,
                                   write_idx, attn_bias)
        resnet, blocks, conv = est.up_blocks[0]
        h = self._resnet(resnet, torch.cat([h, skip], dim=1), conv_state, next(time_terms), tail)
        h = self._conv(conv, self._transformers(blocks, h, kv, write_idx, attn_bias), conv_state, tail)
        h = self._block(est.final_block, h, conv_state, tail=tail)
        conv_state.copy_(tail)
        return est.final_proj(h) if project else h

    def step_weights(self) -> list[torch.Tensor]:
        """The big weights of a step in the order this path reads them (ResNet convs and res conv, each
        transformer block's q/k/v, output and feed-forward weights, the sampling convs, the final block)."""
        def resnet(r: ResNet) -> list[torch.Tensor]:
            return [r.block1.block[0].weight, r.block2.block[0].weight, r.res_conv.weight]

        def transformers(blocks: nn.ModuleList) -> list[torch.Tensor]:
            return [w for b in blocks for w in (b.attn1.qkv_weight if b.attn1.qkv_weight is not None
                                                else b.attn1.to_q.weight, b.attn1.to_out[0].weight,
                                                b.ff.net[0].proj.weight, b.ff.net[2].weight)]

        est = self.est
        (down, down_blocks, down_conv), (up, up_blocks, up_conv) = est.down_blocks[0], est.up_blocks[0]
        weights = [*resnet(down), *transformers(down_blocks), down_conv.weight]
        for r, blocks in est.mid_blocks:
            weights += [*resnet(r), *transformers(blocks)]
        weights += [*resnet(up), *transformers(up_blocks), up_conv.weight, est.final_block.block[0].weight]
        return weights

    # ------------------------------------------------------------------ time terms
    def step_times(self, t: float) -> StepTimes:
        """StepTimes of the time t, made once per t (t is one of the ODE's fixed times, so this saves ~15
        launches a step). Inside a CUDA-graph capture an uncached t is computed into the graph and not kept
        (its memory belongs to the graph's pool); kept ones are never dropped, as graphs read them."""
        cached = self._step_times.get(t)
        if cached is not None:
            return cached
        weight = self.est.final_proj.weight
        t_emb, terms = self.time_terms(torch.tensor([t], device=weight.device))
        made = StepTimes(t_emb, tuple(terms))
        if not (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._step_times[t] = made
        return made

    def time_terms(self, t: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`Estimator.time_terms` with one Mish and one GEMM for all the ResNets instead of one of each."""
        t_emb = self.est.time_embedding(t)
        times = F.linear(F.mish(t_emb), self.time_weight, self.time_bias)
        return t_emb, list(times.split(self.est.dims.channels, dim=1))

    # ------------------------------------------------------------------ convs and ResNets
    def _conv(self, conv: CausalConv, x: torch.Tensor, conv_state: torch.Tensor, tail: torch.Tensor
              ) -> torch.Tensor:
        return self.ops.causal_conv(x, conv_state, conv.state_offset, conv.weight, conv.bias, tail_out=tail)

    def _block(self, block: CausalBlock, x: torch.Tensor, conv_state: torch.Tensor, add: torch.Tensor | None = None,
               res: torch.Tensor | None = None, tail: torch.Tensor | None = None) -> torch.Tensor:
        """`CausalBlock` with the time term `add` and the ResNet's residual `res` in one kernel."""
        conv, norm = block.block[0], block.block[2]
        return self.ops.causal_conv(x, conv_state, conv.state_offset, conv.weight, conv.bias, norm.weight,
                                    norm.bias, norm.eps, mish=True, add=add, res=res, tail_out=tail)

    def _resnet(self, r: ResNet, x: torch.Tensor, conv_state: torch.Tensor, time: torch.Tensor,
                tail: torch.Tensor) -> torch.Tensor:
        """`ResNet` given its time term; its residual projection is added in the second conv's epilogue."""
        prefetch.before(r.block1.block[0].weight)
        res, branch = self._residual_beside(r, x)
        h = self._block(r.block1, x, conv_state, add=time, tail=tail)
        if branch is not None:
            torch.cuda.current_stream(x.device).wait_stream(branch)
        return self._block(r.block2, h, conv_state, res=res, tail=tail)

    def _residual_beside(self, r: ResNet, x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Stream | None]:
        """(res_conv(x), the branch computing it or None). On the chunk path (a Triton GEMM) it runs on a
        branch stream while the first conv runs: it needs only x, and only the second conv's epilogue reads
        it, so it leaves the step's critical path (14 of its ≈ 365 kernels)."""
        branch = prefetch.branch(x.device) if self._residual_is_triton(x) else None
        if branch is None:
            return self._residual(r, x), None
        out = torch.empty(x.shape[0], x.shape[2], r.res_conv.out_channels, device=x.device, dtype=x.dtype)
        with torch.cuda.stream(branch):
            self._residual(r, x, out=out)
        return out.transpose(1, 2), branch

    @staticmethod
    def _residual_is_triton(x: torch.Tensor) -> bool:
        return x.shape[0] * x.shape[2] <= PROLOGUE_GEMM_MAX_ROWS

    def _residual(self, r: ResNet, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """res_conv(x) [R, C, T], possibly as a strided view (the fused conv reads any strides); out [R, T, C]
        (the chunk path only): where it goes. On the chunk path a GEMM kernel that reads either layout (its
        launch overlaps the conv before it), else `ResNet.residual`."""
        if self._residual_is_triton(x):
            return self.ops.linear_residual(x.transpose(1, 2), r.res_conv.weight[:, :, 0], r.res_conv.bias,
                                            out=out).transpose(1, 2)
        assert out is None, "out: the chunk path's GEMM only"
        return r.residual(x)

    # ------------------------------------------------------------------ transformer blocks
    def _transformers(self, blocks: nn.ModuleList, h: torch.Tensor, kv: Sequence[torch.Tensor],
                      write_idx: torch.Tensor, attn_bias: Sequence[torch.Tensor]) -> torch.Tensor:
        ops = self.ops
        if (isinstance(kv[0], PooledKV) and blocks[0].attn1.qkv_weight is not None
                and h.shape[0] * h.shape[2] <= PROLOGUE_GEMM_MAX_ROWS and not kv[0].own_keys):
            return self._pooled_transformers(blocks, h, kv[0])
        h = h.transpose(1, 2)
        # each residual add rides in the next LayerNorm's kernel (one kernel instead of add + norm, and no
        # copy of the transposed input)
        pending = None
        for block in blocks:
            n1, n3 = block.norm1, block.norm3
            a, h = ops.add_layer_norm(h if pending is None else pending, None if pending is None else h,
                                      n1.weight, n1.bias, n1.eps)
            attn = self._attention(block.attn1, a, [c[block.cache_index] for c in kv], write_idx, attn_bias)
            m, h = ops.add_layer_norm(attn, h, n3.weight, n3.bias, n3.eps)
            pending = block.ff.net[2](block.ff.net[0](m))
        return (h + pending).transpose(1, 2)

    def _attention(self, attn: Attention, x: torch.Tensor, kv: Sequence[torch.Tensor], write_idx: torch.Tensor,
                   attn_bias: Sequence[torch.Tensor]) -> torch.Tensor:
        """`Attention` with the pool write as one op (rows that attend to their own keys write none)."""
        view = kv[0]
        if not isinstance(view, PooledBlock) or view.parent.own_keys:
            return attn(x, kv, write_idx, attn_bias)
        p = view.parent
        q, k, v = attn.project(x)
        pool_k, pool_v = p.pool[view.block, 0], p.pool[view.block, 1]
        self.ops.pool_write(k, v, pool_k, pool_v, p.rows, p.write_pos)
        out = p.ops.pooled_attention(q, pool_k, pool_v, p.rows, p.write_pos, p.key_limit, p.chunk, p.attn_len,
                                     attn.num_heads)
        return attn.to_out[0](out)

    def _pooled_transformers(self, blocks: nn.ModuleList, h: torch.Tensor, pooled: PooledKV) -> torch.Tensor:
        """The chunk path: 5 kernels per block instead of 9. The residual add and LayerNorm ride in the
        prologue of the GEMM that consumes them (their row of 256 fits one tile), the q/k/v GEMM writes k/v
        straight into the pool and GELU rides in the first feed-forward GEMM; the output and second
        feed-forward projections are plain GEMMs (`linear_residual`), the last block's with the group's final
        residual add in its epilogue. Every intermediate is rounded where the module path rounds it."""
        ops = self.ops
        x, res = h.transpose(1, 2), None
        for i, block in enumerate(blocks):
            attn, n1, n3 = block.attn1, block.norm1, block.norm3
            pool_k, pool_v = pooled.pool[block.cache_index, 0], pooled.pool[block.cache_index, 1]
            prefetch.before(attn.qkv_weight)
            q, res = ops.norm_qkv_pool_write(x, res, (n1.weight, n1.bias, n1.eps), attn.qkv_weight, pool_k, pool_v,
                                             pooled.rows, pooled.write_pos)
            o = pooled.ops.pooled_attention(q, pool_k, pool_v, pooled.rows, pooled.write_pos, pooled.key_limit,
                                            pooled.chunk, pooled.attn_len, attn.num_heads)
            ff1, ff2, out = block.ff.net[0].proj, block.ff.net[2], attn.to_out[0]
            f, res = ops.norm_linear(ops.linear_residual(o, out.weight, out.bias), res,
                                     (n3.weight, n3.bias, n3.eps), ff1.weight, ff1.bias, gelu=True)
            x = ops.linear_residual(f, ff2.weight, ff2.bias, res if i == len(blocks) - 1 else None)
        return x.transpose(1, 2)
