"""Static-shape, batched form of the incremental CosyVoice3 flow: a pool of stream slots.

`FlowStream` (flow.py) keeps each stream's keys/values in growing lists; that is the reference, exact and
simple, but its shapes change every chunk, so it cannot be captured as a CUDA graph and cannot run several
streams in one pass. `FlowSlotPool` keeps the same state in preallocated buffers:

* keys/values `[steps, layers, K/V, pool rows, frames, heads·dim_head]`, pool row 2·slot + CFG row (the
  layout of `cosystream.kernels`' pooled attention), and the conv position-embedding tails
  `[steps, slots, 2 rows, dim, pad]`, one slot per stream (and a scratch slot);
* `chunk(...)`: all Euler steps of the DiT over the new frames of B streams at once, each padded to N
  frames. A call writes its new keys/values into its slot at their absolute frames, then attends over
  the slot's frames in place (no gather of the batch's keys): block-causal, and no key at or past the
  stream's last real frame (padding and stale frames are never seen by a real query). So the outputs of
  real frames equal the eager `FlowStream`'s within float rounding, whatever the padding and the batch.

The ops (conv position embedding, rotary + pool write, pooled attention, gated residual + adaLN norm, output
projection + CFG + Euler update) are the Triton kernels of `cosystream.kernels.flow` on a GPU and their torch
statements in `cosystream.kernels.reference` elsewhere.

Every tensor shape in `chunk` depends only on (B, N, Lk, streaming), so the engine captures one CUDA graph
per bucket and replays it (engine/cv3_token2wav.py). The committed lengths live on the host. The same call
with start 0 and full attention is the official final pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from cosystream.models.cosyvoice3.dit import _LN_EPS, DiT, DiTCache
from cosystream.models.cosyvoice3.flow import CV3Flow, PromptBlocks
from cosystream.transfers import ints_to_device, to_device

KEY_FRAMES_STEP = 192  # key-length buckets of the torch statements' pooled chunks (a multiple of 16: an aligned mask)


class FlowSlotPool:
    """Keys/values and conv tails of `num_slots` streams, up to `max_frames` frames each (prompt
    included), for every Euler step; plus a scratch slot (index `scratch`) that the rows padding a batch
    and graph warm-ups write to."""

    def __init__(self, flow: CV3Flow, num_slots: int, max_frames: int, ops: ModuleType,
                 keys_in_place: bool = False) -> None:
        """`ops`: the fused ops (the engine hands in `cosystream.kernels.flow` on a GPU, its torch statements
        `cosystream.kernels.reference` elsewhere); `keys_in_place`: whether their attention bounds each row's
        keys by its own limit (the Triton kernel's does), so one key length serves every chunk."""
        if num_slots < 1 or max_frames < 1:
            raise ValueError(f"flow slot pool: slots and frames must be >= 1, got {num_slots}, {max_frames}")
        self.flow = flow
        dit: DiT = flow.decoder.estimator
        d = dit.dims
        self.dims = d
        self.num_slots, self.max_frames = num_slots, max_frames
        self.steps = len(flow.decoder.t_steps)
        self.pad = d.conv_pos_kernel - 1
        dev, dtype = flow.input_embedding.weight.device, dit.proj_out.weight.dtype
        self.device, self.dtype = dev, dtype
        self.scratch = num_slots
        # frame max_frames takes the padding's writes (never read by a real frame's query); the frame count
        # is a multiple of 16 so that every key length the runner uses keeps the attention mask aligned
        # (the fused kernels otherwise pad the mask at every call)
        self.buffer_frames = -(-(max_frames + 1) // 16) * 16
        # [steps, layers, K/V, pool rows, frames, heads·dim_head]: a frame's keys of every head are one
        # contiguous vector (one store per frame, and the attention reads each row's keys in place);
        # `keys`/`values` are views of it
        self.inner = d.heads * d.dim_head
        shape = (self.steps, d.depth, 2, 2 * (num_slots + 1), self.buffer_frames, self.inner)
        self.kv = torch.zeros(shape, device=dev, dtype=dtype)
        self.keys, self.values = self.kv[:, :, 0], self.kv[:, :, 1]
        self.ops, self.keys_in_place = ops, keys_in_place
        self.tail1 = torch.zeros(self.steps, num_slots + 1, 2, d.dim, self.pad, device=dev, dtype=dtype)
        self.tail2 = torch.zeros_like(self.tail1)
        # `chunk` writes the moved tails here and `finish_chunks` copies them back: so running a chunk
        # twice on the same inputs (a CUDA graph's warm-up, then its replay) leaves the same state
        self.tail1_out = torch.zeros_like(self.tail1)
        self.tail2_out = torch.zeros_like(self.tail1)
        self.lengths = [0] * (num_slots + 1)  # committed frames per slot (host)
        self.free = list(range(num_slots))
        self._modulations = self._time_modulations()
        self._qkv = self._fused_qkv()
        # the input projection split: x's columns [mel, dim] (per step), the conditioning's (once per chunk)
        proj = dit.input_embed.proj.weight.detach()
        self._proj_x = proj[:, :d.mel_dim].t().contiguous()
        self._proj_cond = proj[:, d.mel_dim:].contiguous()
        self._proj_out = dit.proj_out.weight.detach().unsqueeze(-1)  # [mel, dim, 1]: a 1x1 conv's weight
        # built here, not in `chunk`: a host-to-device copy cannot be captured in a CUDA graph
        inv_freq = dit.rotary_embed.inv_freq
        self._rotary_sign = torch.tensor([-1.0, 1.0], device=dev, dtype=inv_freq.dtype).repeat(inv_freq.shape[0])

    @staticmethod
    def bytes_per_frame(flow: CV3Flow) -> int:
        """Bytes one slot holds per frame (keys and values of every step, layer and CFG row)."""
        d = flow.decoder.estimator.dims
        itemsize = flow.decoder.estimator.proj_out.weight.element_size()
        return len(flow.decoder.t_steps) * d.depth * 2 * 2 * d.heads * d.dim_head * itemsize

    def key_frames(self, longest: int) -> int:
        """The key length Lk of a chunk whose rows end at most at frame `longest` (a graph's static shape).

        The Triton attention reads each row's keys only up to its own limit, so one Lk, the buffer's, serves
        every chunk: one graph per (batch, frames, kind), and no capture mid-traffic for a new prompt length.
        The torch statements gather [0, Lk) of every row, so there Lk is `longest` rounded up to
        KEY_FRAMES_STEP."""
        if self.keys_in_place:
            return self.buffer_frames
        return min(-(-longest // KEY_FRAMES_STEP) * KEY_FRAMES_STEP, self.buffer_frames)

    # ------------------------------------------------------------------ slots
    def acquire(self, blocks: PromptBlocks | None) -> int:
        """A free slot, holding a voice's prompt blocks (or nothing)."""
        if not self.free:
            raise RuntimeError("flow slot pool: no free slot")
        slot = self.free.pop(0)
        self.tail1[:, slot].zero_()
        self.tail2[:, slot].zero_()
        self.lengths[slot] = 0
        if blocks is not None and blocks.frames > 0:
            self.load(slot, blocks.caches)
        return slot

    def release(self, slot: int) -> None:
        if slot in self.free:
            raise RuntimeError(f"flow slot pool: slot {slot} released twice")
        self.lengths[slot] = 0
        self.free.append(slot)

    def load(self, slot: int, caches: list[DiTCache]) -> None:
        """Copy eager caches (one per step, batch of the 2 CFG rows) into a slot."""
        length = caches[0].length
        if length > self.max_frames:
            raise ValueError(f"flow slot pool: {length} cached frames exceed the slot's {self.max_frames}")
        rows = slice(2 * slot, 2 * slot + 2)
        for k, cache in enumerate(caches):
            if length > 0:
                # [layers, 2, H, L, dh] -> [layers, 2, L, H·dh]
                self.keys[k, :, rows, :length] = torch.stack(cache.keys).transpose(2, 3).flatten(3)
                self.values[k, :, rows, :length] = torch.stack(cache.values).transpose(2, 3).flatten(3)
                self.tail1[k, slot] = cache.tail1
                self.tail2[k, slot] = cache.tail2
        self.lengths[slot] = length

    def export(self, slot: int) -> list[DiTCache]:
        """A slot's state as eager caches (a stream that leaves the pool continues with `FlowStream`)."""
        length = self.lengths[slot]
        d = self.dims
        rows = slice(2 * slot, 2 * slot + 2)

        def heads(t: torch.Tensor) -> torch.Tensor:  # [2, L, H·dh] -> [2, H, L, dh], a copy
            return t.unflatten(-1, (d.heads, d.dim_head)).transpose(1, 2).clone(memory_format=torch.contiguous_format)

        caches = []
        for k in range(self.steps):
            keys = [heads(self.keys[k, i, rows, :length]) for i in range(d.depth)]
            values = [heads(self.values[k, i, rows, :length]) for i in range(d.depth)]
            tails = (self.tail1[k, slot].clone(), self.tail2[k, slot].clone()) if length else (None, None)
            caches.append(DiTCache(keys if length else [], values if length else [], *tails, length=length))
        return caches

    # ------------------------------------------------------------------ the batched chunk
    @torch.no_grad()
    def _time_modulations(self) -> list[StepNorms]:
        """Per Euler step, the adaLN vectors [dim] of every norm, as the affine weight and bias of a
        LayerNorm: layer_norm(h)·(1 + scale) + shift is layer_norm(h) with weight 1 + scale, bias shift.

        They depend on t alone, which every row of a step shares, so they are computed once here.
        """
        dit = self.flow.decoder.estimator
        out = []
        for t in self.flow.decoder.t_steps:
            t_emb = F.silu(dit.time_embed(torch.full((1,), t, device=self.device, dtype=torch.float32)))
            mods = [[v[0].contiguous() for v in blk.attn_norm.linear(t_emb).chunk(6, dim=1)]
                    for blk in dit.transformer_blocks]
            scale, shift = (v[0].contiguous() for v in dit.norm_out.linear(t_emb).chunk(2, dim=1))
            # norm i: (weight, bias) of the i-th LayerNorm of the step: attention, feed-forward per block, final
            norms = []
            for shift1, scale1, _, shift2, scale2, _ in mods:
                norms += [(1 + scale1, shift1), (1 + scale2, shift2)]
            norms.append((1 + scale, shift))
            gates = [g for m in mods for g in (m[2], m[5])]
            out.append(StepNorms(norms=norms, gates=gates))
        return out

    @torch.no_grad()
    def _fused_qkv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each block's q, k, v projections as one [3·inner, dim] matrix (one GEMM instead of three)."""
        return [(torch.cat([b.attn.to_q.weight, b.attn.to_k.weight, b.attn.to_v.weight]),
                 torch.cat([b.attn.to_q.bias, b.attn.to_k.bias, b.attn.to_v.bias]))
                for b in self.flow.decoder.estimator.transformer_blocks]

    def chunk(self, x0: torch.Tensor, mu: torch.Tensor, cond: torch.Tensor, spks: torch.Tensor,
              slots: torch.Tensor, start: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor,
              key_frames: int, streaming: bool = True) -> torch.Tensor:
        """Integrate B streams' new frames at once -> x1 [B, 80, N] float32.

        x0 [B, 80, N] float32: each stream's noise for frames [start, start + N); mu, cond [B, 80, N];
        spks [B, 80]; slots, start, valid, keep [B] long: the slot, its first uncommitted frame, the real
        new frames (the rest is padding) and how many new frames this call commits (their keys/values
        stay in the slot and the conv tails move past them). key_frames: Lk >= every start + valid.
        streaming: block-causal attention; else the official final pass, full attention over the rows' own
        frames (start 0, nothing kept: the slots' keys are neither read nor written). A row with start 0
        starts from zero conv tails.
        The slots change only when `finish_chunks` commits (keys/values past the committed length are
        scratch; the moved tails wait in `tail*_out`), so the call is idempotent.
        """
        d = self.dims
        batch, _, n = x0.shape
        if key_frames > self.buffer_frames:
            raise ValueError(f"flow slot pool: {key_frames} key frames exceed the slots' {self.max_frames}")
        positions = start[:, None] + torch.arange(n, device=x0.device)  # [B, N]
        rotary = self._rotary(positions)
        frame = torch.arange(n, device=x0.device)
        writes = torch.where(frame[None] < valid[:, None], positions, self.max_frames)
        # per estimator row (stream-major, CFG rows side by side): its pool row, query frames, key limit
        q_pos, limit = positions.repeat_interleave(2, dim=0), (start + valid).repeat_interleave(2)
        if streaming:
            attention = PoolRows(rows=(2 * slots[:, None] + torch.arange(2, device=x0.device)).flatten(),
                                 q_pos=q_pos, limit=limit, chunk=d.static_chunk_size, key_frames=key_frames,
                                 writes=writes.repeat_interleave(2, dim=0))
        else:
            # PERF: a full pass starts at frame 0 and commits nothing (`pack_chunks` checks), so its keys are
            # all its own: read where the projection leaves them (row r of the batch), never stored in the slot
            attention = PoolRows(rows=torch.arange(2 * batch, device=x0.device), q_pos=q_pos, limit=limit, chunk=0,
                                 key_frames=n, writes=None)
        tail_index = (keep[:, None] + torch.arange(self.pad, device=x0.device)).repeat_interleave(2, dim=0)
        tail_index = tail_index[:, None, :].expand(-1, d.dim, -1)
        continued = (start > 0).to(self.dtype)[:, None, None, None]  # 0: the official zero left padding
        rows = [torch.stack((a, torch.zeros_like(a)), dim=1).flatten(0, 1).to(self.dtype) for a in (mu, cond, spks)]
        # the conditioning part of the input projection is the same at every step: computed once
        fixed = self._fixed_inputs(*rows)
        cfg = self.flow.decoder.cfg_rate
        bias = self.flow.decoder.estimator.proj_out.bias
        x, xr = x0, x0.repeat_interleave(2, dim=0).to(self.dtype)
        for k, dt in enumerate(self.flow.decoder.dt_steps):
            h = self._estimate(k, xr, fixed, slots, attention, rotary, tail_index, continued)
            # PARITY: v = proj_out(h), then (1 + λ)·v_c − λ·v_u and x += dt·v in float32 (CV3CFM.euler); the
            # next step's rows are x twice in the model's dtype. One launch on CUDA (proj_out as a 1x1 conv).
            x, xr = self.ops.project_cfg_euler(h.transpose(1, 2), self._proj_out, bias, x, dt, cfg)
        return x

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [2B, N, rot] of the rotary angles, in the dtype `apply_partial_rotary` uses;
        the sign pattern (−, +) folds `_rotate_pairs`'s negation into the sine."""
        batch, n = positions.shape
        freqs = self.flow.decoder.estimator.rotary_embed.freqs(positions.flatten()).view(batch, n, -1)
        freqs = freqs.repeat_interleave(2, dim=0)
        return freqs.cos(), freqs.sin() * self._rotary_sign

    def _fixed_inputs(self, mu: torch.Tensor, cond: torch.Tensor, spks: torch.Tensor) -> torch.Tensor:
        """The input projection's cond/mu/spks columns applied once: [2B, N, dim], bias included."""
        n = mu.shape[2]
        packed = torch.cat([cond.transpose(1, 2), mu.transpose(1, 2), spks.unsqueeze(1).expand(-1, n, -1)], dim=-1)
        return F.linear(packed, self._proj_cond, self.flow.decoder.estimator.input_embed.proj.bias)

    def _estimate(self, k: int, x: torch.Tensor, fixed: torch.Tensor, slots: torch.Tensor, attention: PoolRows,
                  rotary: tuple[torch.Tensor, torch.Tensor], tail_index: torch.Tensor,
                  continued: torch.Tensor) -> torch.Tensor:
        """One Euler step's estimator over 2B rows (stream-major, conditional then unconditional), up to
        the final adaLN norm: [2B, N, dim] (`proj_out` is applied with the Euler update).

        Each gated residual add rides in the LayerNorm after it (`add_layer_norm`): h += gate·y, then
        the adaLN-modulated norm of h, one pass over h instead of an addcmul, a norm and a modulate.
        """
        dit = self.flow.decoder.estimator
        ops = self.ops
        h = torch.addmm(fixed.flatten(0, 1), x.transpose(1, 2).flatten(0, 1), self._proj_x)
        h = h.view(fixed.shape)
        h = self._with_conv_position(k, h, slots, tail_index, continued)
        mods = self._modulations[k]
        normed, h = ops.add_layer_norm(h, None, *mods.norms[0], _LN_EPS)
        for layer, block in enumerate(dit.transformer_blocks):
            y = self._attention(k, layer, block, normed, attention, rotary)
            normed, h = ops.add_layer_norm(y, h, *mods.norms[2 * layer + 1], _LN_EPS, gate=mods.gates[2 * layer])
            y = block.ff.ff(normed)
            normed, h = ops.add_layer_norm(y, h, *mods.norms[2 * layer + 2], _LN_EPS, gate=mods.gates[2 * layer + 1])
        return normed

    def _with_conv_position(self, k: int, h: torch.Tensor, slots: torch.Tensor, tail_index: torch.Tensor,
                            continued: torch.Tensor) -> torch.Tensor:
        """h [2B, N, dim] plus its causal conv position embedding (two grouped convs + Mish, each over the
        slot's tail and the N new frames only); the tails move past the kept frames."""
        conv = self.flow.decoder.estimator.input_embed.conv_pos_embed
        conv1, conv2 = conv.conv1[0], conv.conv2[0]
        in1 = torch.cat([(self.tail1[k, slots] * continued).flatten(0, 1), h.transpose(1, 2)], dim=2)
        out1 = self.ops.grouped_conv_mish(in1, conv1.weight, conv1.bias)
        in2 = torch.cat([(self.tail2[k, slots] * continued).flatten(0, 1), out1], dim=2)
        out = self.ops.grouped_conv_mish(in2, conv2.weight, conv2.bias, residual=h)
        self.tail1_out[k, slots] = in1.gather(2, tail_index).unflatten(0, (-1, 2))
        self.tail2_out[k, slots] = in2.gather(2, tail_index).unflatten(0, (-1, 2))
        return out

    def _attention(self, k: int, layer: int, block: torch.nn.Module, x: torch.Tensor, rows: PoolRows,
                   rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The block's attention over x [2B, N, dim]: the new keys/values go into the pool at their frames
        (the padding's into the spare frame), then every row attends over its pool row in place; a full
        pass attends over the projection's own keys/values."""
        a = block.attn
        qkv = F.linear(x, *self._qkv[layer])  # [2B, N, 3·inner]
        # PARITY: apply_partial_rotary on q and k: x·cos + rotate_pairs(x)·sin in float32, rounded back
        if rows.writes is None:
            keys, values = qkv[:, :, self.inner:2 * self.inner], qkv[:, :, 2 * self.inner:]
            self.ops.partial_rotary(qkv, *rotary)
        else:
            keys, values = self.kv[k, layer, 0], self.kv[k, layer, 1]
            self.ops.partial_rotary(qkv, *rotary, (keys, values, rows.rows, rows.writes))
        out = self.ops.pooled_attention(qkv[:, :, :self.inner], keys, values, rows.rows, rows.q_pos, rows.limit,
                                        rows.chunk, rows.key_frames, a.heads)
        return a.to_out[0](out)


@dataclass
class StepNorms:
    """One Euler step's adaLN terms: norms[i] the (weight, bias) [dim] of the step's i-th LayerNorm (each
    block's attention and feed-forward norms, then the final one), gates[i] the gate [dim] of the i-th
    residual add (each block's attention, then feed-forward)."""

    norms: list[tuple[torch.Tensor, torch.Tensor]]
    gates: list[torch.Tensor]


@dataclass
class PoolRows:
    """What the attention of a batched chunk needs per estimator row (2B rows: each stream's CFG pair):
    the row its keys are read from, each query's frame, and the key limit (start + valid); chunk: the
    block-causal block (0: full attention); key_frames: every limit's bound; writes: the frame each new
    key/value is stored at in the pool (rows: pool rows), or None where the keys are read from the call's
    own projection (rows: the batch's rows; a full pass)."""

    rows: torch.Tensor  # [2B]
    q_pos: torch.Tensor  # [2B, N]
    limit: torch.Tensor  # [2B]
    chunk: int
    key_frames: int
    writes: torch.Tensor | None  # [2B, N]


@dataclass
class SlotChunk:
    """One stream's chunk, prepared for `FlowSlotPool.chunk`: frames [start, start + valid) are computed,
    the first `keep` of them committed, and the mel from `first_new` returned."""

    slot: int
    start: int
    valid: int
    keep: int
    first_new: int
    mu: torch.Tensor  # [1, 80, valid]
    cond: torch.Tensor
    spks: torch.Tensor  # [1, 80]
    streaming: bool = True  # False: the official final pass (full attention over the whole utterance)


class PooledFlowStream:
    """`FlowStream`'s request state with its keys/values in a `FlowSlotPool` slot."""

    def __init__(self, pool: FlowSlotPool, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                 embedding: torch.Tensor, prompt_blocks: PromptBlocks | None = None) -> None:
        flow = pool.flow
        dev = flow.input_embedding.weight.device
        self.pool, self.flow = pool, flow
        self.prompt_token = prompt_token.to(dev)
        self.prompt_feat = prompt_feat.to(dev, flow.spk_embed_affine_layer.weight.dtype)
        self.prompt_frames = prompt_feat.shape[1]
        self.spks = flow.project_speaker(embedding.to(dev))
        self.slot = pool.acquire(prompt_blocks)

    @property
    def length(self) -> int:
        return self.pool.lengths[self.slot]

    def frames_after(self, num_tokens: int, finalize: bool) -> int:
        """Frames the slot holds while a call over `num_tokens` generated tokens runs."""
        lookahead = 0 if finalize else self.flow.dims.pre_lookahead_len
        return self.flow.ratio * (self.prompt_token.shape[1] + num_tokens - lookahead)

    def prepare(self, tokens: torch.Tensor, token_offset: int, finalize: bool) -> SlotChunk:
        """tokens [1, N] (all generated so far) -> this call's inputs (as `FlowStream.push` computes them)."""
        flow = self.flow
        mu = flow.token_features(torch.cat([self.prompt_token, tokens.to(self.prompt_token.device)], dim=1),
                                 finalize)
        total = mu.shape[2]
        first_new = self.prompt_frames + flow.ratio * token_offset
        start = self.length
        if first_new < start:
            raise ValueError(f"pooled flow stream: frames from {first_new} requested, but frames before {start} "
                             "are committed (token_offset went backwards)")
        if total > self.pool.max_frames:
            raise ValueError(f"pooled flow stream: {total} frames exceed the slot's {self.pool.max_frames}")
        block = flow.decoder.estimator.dims.static_chunk_size
        complete = (total // block) * block if not finalize else total
        return SlotChunk(slot=self.slot, start=start, valid=total - start, keep=complete - start,
                         first_new=first_new, mu=mu[:, :, start:], cond=flow.conditions(self.prompt_feat,
                                                                                          total - start, start),
                         spks=self.spks)

    def prepare_full(self, tokens: torch.Tensor, token_offset: int) -> SlotChunk:
        """The official final pass (full attention, finalize) over every frame, in this stream's slot: its
        keys/values overwrite the slot's (nothing is committed; the stream ends with it)."""
        flow = self.flow
        mu = flow.token_features(torch.cat([self.prompt_token, tokens.to(self.prompt_token.device)], dim=1), True)
        total = mu.shape[2]
        if total > self.pool.max_frames:
            raise ValueError(f"pooled flow stream: {total} frames exceed the slot's {self.pool.max_frames}")
        return SlotChunk(slot=self.slot, start=0, valid=total, keep=0,
                         first_new=self.prompt_frames + flow.ratio * token_offset, mu=mu,
                         cond=flow.conditions(self.prompt_feat, total, 0), spks=self.spks, streaming=False)

    def close(self) -> None:
        """Give the slot back (once)."""
        if self.slot >= 0:
            self.pool.release(self.slot)
            self.slot = -1


def pack_chunks(pool: FlowSlotPool, chunks: list[SlotChunk], frames: int
                ) -> tuple[torch.Tensor, ...]:
    """The `chunk` inputs of several streams, each padded to `frames` new frames."""
    dev = pool.device
    noise = pool.flow.decoder.rand_noise
    x0 = torch.zeros(len(chunks), noise.shape[1], frames, device=dev, dtype=torch.float32)
    mu = torch.zeros(len(chunks), noise.shape[1], frames, device=dev, dtype=pool.dtype)
    cond = torch.zeros_like(mu)
    for i, c in enumerate(chunks):
        if not c.streaming and (c.start or c.keep):
            raise ValueError(f"pack_chunks: a full pass starts at frame 0 and keeps nothing, got start {c.start}, "
                             f"keep {c.keep}")
        x0[i, :, :c.valid] = pool.flow.decoder.noise(c.start, c.valid)[0]
        mu[i, :, :c.valid] = c.mu[0]
        cond[i, :, :c.valid] = c.cond[0]
    spks = torch.cat([c.spks for c in chunks]).to(pool.dtype)
    meta = to_device(torch.tensor([[c.slot, c.start, c.valid, c.keep] for c in chunks], dtype=torch.long).T, dev)
    return x0, mu, cond, spks, meta[0], meta[1], meta[2], meta[3]


def finish_chunks(pool: FlowSlotPool, chunks: list[SlotChunk], x1: torch.Tensor) -> list[torch.Tensor]:
    """Advance the slots' committed lengths; each stream's new mel [1, 80, m] float32 from `first_new`."""
    slots = ints_to_device([c.slot for c in chunks], pool.device)
    pool.tail1[:, slots] = pool.tail1_out[:, slots]
    pool.tail2[:, slots] = pool.tail2_out[:, slots]
    out = []
    for i, c in enumerate(chunks):
        pool.lengths[c.slot] = c.start + c.keep
        # a copy: x1 may be a CUDA graph's static output, overwritten by its next replay
        out.append(x1[i:i + 1, :, c.first_new - c.start:c.valid].float().clone())
    return out


def run_chunks(pool: FlowSlotPool, chunks: list[SlotChunk], frames: int | None = None,
               key_frames: int | None = None) -> list[torch.Tensor]:
    """Eager batched chunks, all block-causal or all full passes (the same computation the engine captures
    in a CUDA graph)."""
    frames = frames or max(c.valid for c in chunks)
    key_frames = key_frames or max(c.start + c.valid for c in chunks)
    streaming = {c.streaming for c in chunks}
    if len(streaming) != 1:
        raise ValueError("run_chunks: block-causal chunks and full passes run in separate calls")
    x1 = pool.chunk(*pack_chunks(pool, chunks, frames), key_frames=key_frames, streaming=streaming.pop())
    return finish_chunks(pool, chunks, x1)
