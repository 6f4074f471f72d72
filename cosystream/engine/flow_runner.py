"""FlowRunner: the incremental flow of many streams batched through one CUDA-graphed ODE.

Each stream holds a slot of a static pool that keeps, for every Euler step, the estimator's keys/values
of its finished frames and its causal-conv tails (models/flow_stream.py explains why that is exact). A
batch of chunks that add the same number of frames runs the whole 10-step ODE as one graph replay,
keyed by (batch bucket, new frames, attended-length bucket); before it, one batched encoder step per
group of streams at the same token (the slot's encoder caches are pooled too). Official final chunks
(full attention, finalizing encoder) run as a `FinalPass`: one encoder graph, then one graph replay per
Euler step, so a batch of them can pause between steps (core._ChunkWorker) and needs no slot while it runs.
Pool memory: models.flow_stream.cache_bytes_per_frame × slots × frames (≈ 2.3 MB per frame for
CosyVoice2-0.5B in bf16), so the pool is sized by EngineConfig.flow_slots × flow_frames. A stream takes a
slot when its first chunk fits; its chunks past the slot recompute every frame as the official code does
(`recompute`: one graphed pass, no keys kept), and its official final pass runs at any length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from cosystream.engine import flow_fast
from cosystream.engine.graphs import REPLAY_ROWS, GraphCache, bucket, maybe_compile
from cosystream.engine.stopwatch import Stopwatch
from cosystream.kernels import flow as flow_kernels
from cosystream.kernels import reference as reference_kernels
from cosystream.kernels import triton_usable
from cosystream.models.estimator import PooledKV, StepTimes
from cosystream.models.flow import LOOKAHEAD_CONTEXT, UP_CONTEXT, UPSAMPLE, EncoderState, Flow
from cosystream.models.flow_stream import FlowStream, PromptCache

_LEN_BUCKET = 128  # attended frames are rounded up to a multiple of this (fewer graphs, little waste)
_ENCODER_ROWS = (1, 2, 4, 8, 16, 32)  # streams per batched encoder step (graph buckets)


@dataclass
class PooledStream:
    """A stream's place in the pool: its slot, encoder state and how many frames are final."""

    slot: int
    prompt: PromptCache
    encoder: EncoderState
    is_finished: bool = False
    closed: bool = False  # its slot was given back

    @property
    def num_tokens(self) -> int:
        return self.encoder.num_tokens

    @property
    def num_frames(self) -> int:
        return UPSAMPLE * self.encoder.num_tokens


@dataclass
class FinalPass:
    """Official final passes of a batch of streams (one padded length) in progress: the ODE state and the
    estimator's CFG inputs, owned here, so the pass can stop after any Euler step and go on later while
    other batches replay the same graphs. It reads no pool slot (own keys, conv tails from zero)."""

    key: tuple[int, int]  # (batch bucket, padded frames): the graphs it replays
    x: torch.Tensor  # [rows, 80, padded] float32
    mu: torch.Tensor  # [2·rows, 80, padded], CFG rows, model dtype
    spks: torch.Tensor  # [2·rows, 80]
    cond: torch.Tensor  # [2·rows, 80, padded]
    frames: torch.Tensor  # [rows] each row's frames (device)
    lengths: list[int]  # the same, on the host
    num_steps: int
    step: int = 0

    @property
    def done(self) -> bool:
        return self.step >= self.num_steps

    def mel(self, row: int) -> torch.Tensor:
        """Row's mel [80, frames] (prompt frames included); valid once done."""
        return self.x[row, :, :self.lengths[row]]


class FlowRunner:
    overflow = 0  # streams beyond the pool: none (engine/core.py's stats read it until the scheduler rewrite)

    def __init__(self, flow: Flow, num_slots: int, max_frames: int, use_graphs: bool = True,
                 compile: bool = False, fused_kernels: bool = True,
                 capture_stream: torch.cuda.Stream | None = None, watch: Stopwatch | None = None,
                 l2_prefetch_mb: float = 0.0) -> None:
        self.flow = flow
        self.cfm = flow.decoder
        est = flow.decoder.estimator
        w = est.final_proj.weight
        self.device, self.dtype = w.device, w.dtype
        rows = 2 * (num_slots + 1)  # two CFG rows per slot, plus a scratch slot for padding rows
        steps = self.cfm.num_steps
        self.kv = torch.zeros(steps, est.num_attention_blocks, 2, rows, max_frames, est.inner_dim,
                              device=self.device, dtype=self.dtype)
        self.conv = torch.zeros(steps, rows, est.conv_state_channels, 2, device=self.device, dtype=self.dtype)
        # every slot's encoder caches (pooled streams' EncoderState tensors are views of their slot's row),
        # so the encoder steps of many streams run as one batch that reads and writes the pool in place
        empty = flow.encoder.new_state(max_frames // UPSAMPLE)
        self.enc_tokens, self.enc_frames, _, _ = empty.batch_rows(num_slots + 1)
        self.max_frames = max_frames
        self.free = list(range(num_slots))
        self.scratch = num_slots
        self.chunk = est.dims.static_chunk_size
        self.graphs = GraphCache(self._ode, self.device, use_graphs, stream=capture_stream)
        self.encoder_graphs = GraphCache(self._encode_core, self.device, use_graphs, stream=capture_stream)
        self.final_encoder_graphs = GraphCache(self._final_encode_core, self.device, use_graphs, stream=capture_stream)
        self.final_step_graphs = GraphCache(self._final_step_core, self.device, use_graphs, stream=capture_stream)
        # each Euler step's t and dt on the device, read by the one graph every step of a final pass replays
        self.t_steps = torch.tensor(self.cfm.t_steps, device=self.device, dtype=torch.float32)
        self.dt_steps = torch.tensor(self.cfm.dt_steps, device=self.device, dtype=torch.float32)
        self.recompute_graphs = GraphCache(self._recompute_core, self.device, use_graphs, stream=capture_stream)
        self._step = maybe_compile(self._estimator_step, compile)
        self.watch = watch or Stopwatch(self.device)
        self.attention_ops = flow_kernels if fused_kernels and triton_usable(self.device) else reference_kernels
        # the ODE's final projection, CFG mix and Euler update as one kernel (None: the module statements)
        self.solver_ops: ModuleType | None = None
        if self.attention_ops is flow_kernels:
            self.use_fused_ops(flow_kernels, l2_prefetch_mb)
        # Each Euler step's time terms made once (Estimator.step_times) where graphs replay them as constants
        # (CUDA): there they save ~15 launches a step. On the CPU every path embeds t row by row, so that the
        # pooled, eager and final passes keep computing the same float sums (a one-row GEMM sums differently).
        self.step_index = torch.arange(steps, device=self.device)  # a final pass's Euler step, as a graph input
        self.step_times: list[StepTimes] | None = None  # each Euler step's, when constant
        self.final_times: tuple[torch.Tensor, torch.Tensor] | None = None  # (t_emb [S, 4C], ResNet terms [S, 14C])
        if self.device.type == "cuda":
            self.use_constant_step_times()

    def use_fused_ops(self, ops: ModuleType | None, l2_prefetch_mb: float = 0.0) -> None:
        """Run the estimator's steps and the ODE's tail through `ops` (`cosystream.kernels.flow`, or
        `.reference` for their torch statements; engine/flow_fast.py) from now on; None: the plain modules.
        The estimator is shared with the per-request flow, which follows it. Before any graph capture."""
        est = self.cfm.estimator
        flow_fast.restore(est)
        if ops is not None:
            flow_fast.accelerate(est, ops, l2_prefetch_mb)
        self.solver_ops = ops

    def _estimator_step(self, *args, **kwargs) -> torch.Tensor:
        """The estimator's step as it is now (plain, or replaced by `use_fused_ops`)."""
        return self.cfm.estimator.step(*args, **kwargs)

    def use_constant_step_times(self) -> None:
        """Make each Euler step's time terms once (`Estimator.step_times`, before any graph capture) and use
        them in every pass from now on; the final pass's one step graph serves every Euler step, so it
        gathers its step's terms from tables by the step index (two launches instead of ~13)."""
        made = [self.cfm.estimator.step_times(t) for t in self.cfm.t_steps]
        self.final_times = (torch.cat([m.t_emb for m in made]), torch.cat([torch.cat(m.resnet, dim=1) for m in made]))
        self.step_times = made

    # ------------------------------------------------------------------ slots
    def holds(self, prompt: PromptCache) -> bool:
        """Whether a slot holds the voice's encoded prompt frames (else a stream opens without them)."""
        return UPSAMPLE * prompt.num_tokens <= self.max_frames

    def open(self, prompt: PromptCache) -> PooledStream:
        """Take a slot and copy the voice's prompt state into it (≈ 0.6 GB for a 6 s prompt, one copy)."""
        slot = self.free.pop(0)
        rows = slice(2 * slot, 2 * slot + 2)
        n = prompt.kv.shape[-2]
        try:
            self.kv[:, :, :, rows, :n] = prompt.kv
            self.conv[:, rows] = prompt.conv
            encoder = self._encoder_in_slot(slot, prompt)
        except BaseException:  # e.g. out of memory for the encoder state: the slot is not lost
            self.free.append(slot)
            self.free.sort()
            raise
        return PooledStream(slot, prompt, encoder)

    @torch.inference_mode()
    def build_prompt_caches(self, stream: FlowStream,
                            prompts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[PromptCache]:
        """FlowStream.build_prompt_cache for voices whose prompts have one length, through the pool: their
        frames advance in free slots as one chunk (one graphed ODE for all), then leave them as
        PromptCaches. prompts: (tokens [1, P], mel [1, 2P, 80], xvector [1, 192]) each. PERF: the eager pass
        launches each op of ten estimator steps from Python: ≈ 0.5 s per 6 s prompt on the H100, on the
        first chunk's path of every request in a voice not in memory."""
        empties = [stream.empty_prompt(*prompt) for prompt in prompts]
        lengths = {empty.prompt_tokens.shape[0] for empty in empties}
        if len(lengths) != 1 or len(empties) > len(self.free):
            raise ValueError(f"prompts of {sorted(lengths)} tokens for {len(self.free)} free slots: one length, "
                             "at most one prompt per free slot")
        boundary = stream.prompt_cache_tokens(lengths.pop())
        pooled: list[PooledStream] = []
        try:
            for empty in empties:
                pooled.append(self.open(empty))
            if boundary > 0:
                ahead = boundary + stream.lookahead
                self.advance(pooled, [(e.prompt_tokens[:boundary], e.prompt_tokens[boundary:ahead]) for e in empties])
            return [PromptCache(e.prompt_tokens, e.prompt_mel, e.spks, p.encoder.trimmed(),
                                self.kv[:, :, :, 2 * p.slot:2 * p.slot + 2, :p.num_frames].clone(),
                                self.conv[:, 2 * p.slot:2 * p.slot + 2].clone())
                    for e, p in zip(empties, pooled, strict=True)]
        finally:
            for p in pooled:
                self.close(p)

    def _encoder_in_slot(self, slot: int, prompt: PromptCache) -> EncoderState:
        """The encoder state of a stream opened in `slot`: views of the slot's pool row, holding the voice's
        prompt caches."""
        n = prompt.num_tokens
        self.enc_tokens[slot, :, :, :n] = prompt.encoder.kv_tokens
        self.enc_frames[slot, :, :, :UPSAMPLE * n] = prompt.encoder.kv_frames
        return EncoderState(self.enc_tokens[slot], self.enc_frames[slot], prompt.encoder.lookahead_tail.clone(),
                            prompt.encoder.up_tail.clone(), n)

    def close(self, stream: PooledStream) -> None:
        """Give the stream's slot back; again is a no-op (a stream's slot goes back when its final pass
        starts, and the stream is released again when it ends)."""
        if stream.closed:
            return
        stream.closed = True
        self.free.append(stream.slot)
        self.free.sort()

    # ------------------------------------------------------------------ chunks
    @torch.inference_mode()
    def advance(self, streams: Sequence[PooledStream], windows: Sequence[tuple[torch.Tensor, torch.Tensor | None]]
                ) -> list[torch.Tensor]:
        """Encode each stream's new tokens, then integrate every stream's new frames in one graph.

        windows[i] = (new position ids [n], look-ahead ids [3] or None); all n must be equal.
        Returns each stream's new frames [80, 2n] (float32), prompt frames included.
        """
        starts = [s.num_frames for s in streams]
        num_new = UPSAMPLE * windows[0][0].shape[0]
        b, padded = len(streams), bucket(len(streams))
        mu = torch.zeros(padded, self.cfm.num_bins, num_new, device=self.device, dtype=self.dtype)
        self._encode_all(streams, windows, mu)
        self.watch.lap("encoder")
        attn_len = self.attn_len_for(max(starts) + num_new)
        z = torch.zeros(padded, self.cfm.num_bins, num_new, device=self.device)
        z[:b] = torch.cat([self.cfm.noise(f0, num_new) for f0 in starts]).to(self.device)
        cond = torch.zeros_like(mu)
        for i, (s, f0) in enumerate(zip(streams, starts, strict=True)):
            cond[i] = _prompt_cond(s.prompt, f0, num_new)
        spks = torch.zeros(padded, self.cfm.num_bins, device=self.device, dtype=self.dtype)
        spks[:b] = torch.stack([s.prompt.spks for s in streams])
        slots = torch.full((padded,), self.scratch, device=self.device, dtype=torch.long)
        slots[:b] = torch.tensor([s.slot for s in streams], device=self.device)
        start_t = torch.zeros(padded, device=self.device, dtype=torch.long)
        start_t[:b] = torch.tensor(starts, device=self.device)
        marker = torch.empty(attn_len, device=self.device, dtype=torch.int8)
        # Capturing runs the step once outside the graph, which would advance these streams' conv tails
        # and then replay over them: capture a new shape on the scratch slot first.
        self.capture(padded, num_new, attn_len)
        self.watch.lap("ode_setup")
        (x,) = self.graphs.run((padded, num_new, attn_len), [z, mu, spks, cond, slots, start_t, marker])
        out = [x[i].clone() for i in range(b)]
        self.watch.lap("ode", tag=f"ode_{b}x{num_new}")
        return out

    def _encode_all(self, streams: Sequence[PooledStream], windows: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
                    mu: torch.Tensor) -> None:
        """mu[i] [80, 2n] for each stream's n new tokens; updates the streams' encoder states. Streams at the
        same token with the same window shape share one batched step."""
        groups: dict[tuple[int, int, bool], list[int]] = {}
        for i, (s, (ids, ctx)) in enumerate(zip(streams, windows, strict=True)):
            groups.setdefault((s.encoder.num_tokens, ids.shape[0], ctx is not None), []).append(i)
        for (start, n, _), members in groups.items():
            if not self._pooled_encoder(streams[members[0]]) or start + n > self.enc_tokens.shape[3]:
                for i in members:  # a state that left the pool (or must grow) steps eagerly
                    mu[i] = self.flow.encode_step(windows[i][0], windows[i][1], streams[i].encoder, streaming=True)
                continue
            for part in range(0, len(members), _ENCODER_ROWS[-1]):
                chunk = members[part:part + _ENCODER_ROWS[-1]]
                out = self._encode_batch([streams[i] for i in chunk], [windows[i] for i in chunk])
                for j, i in enumerate(chunk):
                    mu[i] = out[j]

    def _pooled_encoder(self, stream: PooledStream) -> bool:
        return stream.encoder.kv_tokens.data_ptr() == self.enc_tokens[stream.slot].data_ptr()

    def _encode_batch(self, streams: Sequence[PooledStream], windows: Sequence[tuple[torch.Tensor, torch.Tensor | None]]
                      ) -> torch.Tensor:
        """One encoder step for streams that are all at the same token: mu [B, 80, 2n].

        PERF: the step is ~300 small kernels; it runs as one graph keyed by (batch bucket, first token, n,
        look-ahead or not) that reads and writes the streams' pool rows in place (padding rows use the
        scratch slot), instead of one graph per stream.
        """
        b = len(streams)
        start, n = streams[0].encoder.num_tokens, windows[0][0].shape[0]
        has_context = windows[0][1] is not None
        key, inputs = self._encoder_inputs(b, start, n, has_context)
        ids, ctx, la_tail, up_tail, slots = inputs[:5]
        ids[:b] = torch.stack([w[0] for w in windows]).to(self.device)
        if has_context:
            ctx[:b] = torch.stack([w[1] for w in windows]).to(self.device)
        la_tail[:b] = torch.stack([s.encoder.lookahead_tail for s in streams])
        up_tail[:b] = torch.stack([s.encoder.up_tail for s in streams])
        slots[:b] = torch.tensor([s.slot for s in streams], device=self.device)
        self.capture_encoder(b, start, n, has_context)
        mu, la_out, up_out = self.encoder_graphs.run(key, inputs)
        for i, s in enumerate(streams):
            s.encoder.lookahead_tail, s.encoder.up_tail = la_out[i].clone(), up_out[i].clone()
            s.encoder.num_tokens = start + n
        return mu[:b].clone()

    def _encoder_inputs(self, batch: int, start: int, n: int, has_context: bool) -> tuple[tuple, list[torch.Tensor]]:
        """The graph key and zeroed inputs of a batched encoder step (every row on the scratch slot)."""
        rows, dev, d = bucket(batch, _ENCODER_ROWS), self.device, self.enc_tokens.shape[-1]
        # shape-only markers carry the Python ints the step is specialised on (the graph key)
        return (rows, start, n, has_context), [
            torch.zeros(rows, n, dtype=torch.long, device=dev),
            torch.zeros(rows, self.flow.dims.pre_lookahead_len, dtype=torch.long, device=dev),
            torch.zeros(rows, LOOKAHEAD_CONTEXT, d, device=dev, dtype=self.dtype),
            torch.zeros(rows, UP_CONTEXT, d, device=dev, dtype=self.dtype),
            torch.full((rows,), self.scratch, dtype=torch.long, device=dev),
            torch.empty(start, device=dev, dtype=torch.int8),
            torch.empty(int(has_context), device=dev, dtype=torch.int8)]

    def capture_encoder(self, batch: int, start: int, n: int, has_context: bool) -> None:
        """Capture a batched encoder step ahead of traffic (warm-up). Capturing runs the step outside the
        graph too, so it works on the scratch slot only."""
        batch = min(batch, _ENCODER_ROWS[-1])  # larger groups run in parts of this size
        key = (bucket(batch, _ENCODER_ROWS), start, n, has_context)
        if not self.encoder_graphs.enabled or key in self.encoder_graphs.graphs or start + n > self.enc_tokens.shape[3]:
            return
        self.encoder_graphs.run(*self._encoder_inputs(batch, start, n, has_context))

    def _encode_core(self, ids, ctx, la_tail, up_tail, slots, marker, flag):
        start = marker.shape[0]
        kv_tokens = self.enc_tokens.index_select(0, slots)
        kv_frames = self.enc_frames.index_select(0, slots)
        context = self.flow.embed_tokens(ctx) if flag.shape[0] else None
        h, la_out, up_out = self.flow.encoder.step_batch(self.flow.embed_tokens(ids), context, kv_tokens, kv_frames,
                                                        la_tail, up_tail, start, streaming=True)
        self.enc_tokens.index_copy_(0, slots, kv_tokens)
        self.enc_frames.index_copy_(0, slots, kv_frames)
        return self.flow.encoder_proj(h).transpose(1, 2), la_out, up_out

    def capture(self, batch: int, num_new: int, attn_len: int) -> None:
        """Capture the graph for one shape ahead of traffic, on the scratch slot (warm-up)."""
        if (batch, num_new, attn_len) in self.graphs.graphs or not self.graphs.enabled:
            return
        bins, dev = self.cfm.num_bins, self.device
        z = torch.zeros(batch, bins, num_new, device=dev)
        mu = torch.zeros(batch, bins, num_new, device=dev, dtype=self.dtype)
        slots = torch.full((batch,), self.scratch, device=dev, dtype=torch.long)
        starts = torch.zeros(batch, device=dev, dtype=torch.long)
        marker = torch.empty(attn_len, device=dev, dtype=torch.int8)
        spks = torch.zeros(batch, bins, device=dev, dtype=self.dtype)
        self.graphs.run((batch, num_new, attn_len), [z, mu, spks, torch.zeros_like(mu), slots, starts, marker])

    def capture_full(self, num_frames: int, batch: int = 1) -> None:
        """Capture the final pass's graphs (its encoder; one Euler step) for `batch` streams of `num_frames`
        (prompt included); padding rows only."""
        rows, padded = bucket(batch), self._full_length(num_frames)
        if not self.final_step_graphs.enabled or (rows, padded) in self.final_step_graphs.graphs:
            return
        self.final_step(self.begin_final(padded, [], rows=rows))

    def _full_length(self, num_frames: int) -> int:
        """Frames a final pass is padded to (even: whole tokens). Not capped by the slot: the pass attends
        to its own keys, so a stream that outgrew its slot still gets its final call graphed and batched."""
        return -(-num_frames // _LEN_BUCKET) * _LEN_BUCKET

    def attn_len_for(self, end_frame: int) -> int:
        return min(-(-end_frame // _LEN_BUCKET) * _LEN_BUCKET, self.max_frames)

    @torch.inference_mode()
    def full_pass(self, prompt: PromptCache, target_ids: torch.Tensor) -> torch.Tensor | None:
        """The official final call (full attention, zero look-ahead) over prompt + every target token.
        Returns mel [80, F] (prompt frames included), or None when it is longer than the official noise
        table (the caller then runs it eagerly)."""
        return self.full_passes([(prompt, target_ids)])[0]

    @torch.inference_mode()
    def full_passes(self, items: Sequence[tuple[PromptCache, torch.Tensor]]) -> list[torch.Tensor | None]:
        """Final calls of several streams, items (prompt, target ids), run to the end (`begin_finals`)."""
        begun = self.begin_finals(items)
        out: list[torch.Tensor | None] = []
        for item in begun:
            if item is None:
                out.append(None)
                continue
            final, row = item
            self.finish_final(final)
            out.append(final.mel(row))
        return out

    @torch.inference_mode()
    def begin_finals(self, items: Sequence[tuple[PromptCache, torch.Tensor]]) -> list[tuple[FinalPass, int] | None]:
        """Start the official final calls of several streams, items (prompt, target ids): streams padded to
        the same length share a FinalPass (its encoder has run, no Euler step yet). Returns each item's
        (pass, row), or None for a stream longer than the official noise table."""
        out: list[tuple[FinalPass, int] | None] = [None] * len(items)
        frames = [UPSAMPLE * (prompt.prompt_tokens.shape[0] + ids.shape[0]) for prompt, ids in items]
        fits = [i for i, n in enumerate(frames) if n <= self.cfm.rand_noise.shape[-1]]
        for padded, members in self._by_padded_length(fits, frames):
            final = self.begin_final(padded, [items[i] for i in members])
            for row, i in enumerate(members):
                out[i] = (final, row)
        self.watch.lap("final_setup")
        return out

    def begin_final(self, padded: int, items: Sequence[tuple[PromptCache, torch.Tensor]],
                    rows: int | None = None) -> FinalPass:
        """PERF: the finalizing encoder of every stream (padded to the batch's length, masked) as one graph
        replay per (batch bucket, padded length); rows past the items (at least `rows`) are padding."""
        rows = bucket(max(len(items), rows or 1))
        ids = torch.zeros(rows, padded // UPSAMPLE, dtype=torch.long, device=self.device)
        valid = torch.full((rows,), padded // UPSAMPLE, device=self.device, dtype=torch.long)
        lengths = []
        for j, (prompt, target) in enumerate(items):
            all_ids = _all_ids(prompt, target)
            ids[j, :all_ids.shape[0]] = all_ids
            valid[j] = all_ids.shape[0]
            lengths.append(UPSAMPLE * all_ids.shape[0])
        z, cond, spks = self._whole_pass_inputs(
            padded, rows, [(prompt, n) for (prompt, _), n in zip(items, lengths, strict=True)])
        mu, spks, cond = self.final_encoder_graphs.run((rows, padded), [ids, valid, spks, cond])
        # graph outputs are overwritten by the next replay of this shape: the pass keeps its own
        return FinalPass((rows, padded), z, mu.clone(), spks.clone(), cond.clone(), UPSAMPLE * valid, lengths,
                         self.cfm.num_steps)

    @torch.inference_mode()
    def final_step(self, final: FinalPass) -> None:
        """One Euler step of a final pass (one graph replay)."""
        (x,) = self.final_step_graphs.run(final.key, [final.x, final.mu, final.spks, final.cond, final.frames,
                                                     self.step_index[final.step:final.step + 1]])
        final.x.copy_(x)
        final.step += 1

    @torch.inference_mode()
    def finish_final(self, final: FinalPass) -> None:
        """The Euler steps a final pass has left."""
        # every stream of a batched pass asks for it; the first runs it: only that one counts as a call
        tag = None if final.done else f"final_{len(final.lengths)}x{final.key[1]}"
        while not final.done:
            self.final_step(final)
        self.watch.lap("final_pass", tag=tag)

    def _final_encode_core(self, ids, valid, spks, cond) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The official final call's finalizing encoder, and its inputs as the estimator's CFG rows."""
        return self.cfm.cfg_inputs(self.flow.encode_padded(ids, valid), spks, cond)

    def _final_step_core(self, x, mu, spks, cond, frames, step) -> tuple[torch.Tensor]:
        """Euler step `step` ([1] int64) of the official final call: full attention over each row's first
        `frames` frames (padding frames come after them: the causal convs never carry them backwards).
        With the fused ODE tail the estimator's final projection, the CFG mix and the update are one op."""
        fused = self.solver_ops
        velocity = self._whole_pass_velocity(frames, x.shape[-1], chunk=0, project=fused is None,
                                             times=lambda _: self._final_step_times(step))
        t = self.t_steps.index_select(0, step).expand(2 * x.shape[0]) if self.final_times is None else None
        out = velocity(0, self.cfm.cfg_rows(x), mu, spks, cond, t)
        dt = self.dt_steps.index_select(0, step)
        if fused is None:
            return (self.cfm.euler_step(x, out, dt[0]),)
        proj = self.cfm.estimator.final_proj
        return (fused.project_cfg_euler(out, proj.weight, proj.bias, x, dt, self.cfm.cfg_rate)[0],)

    def _final_step_times(self, step: torch.Tensor) -> StepTimes | None:
        """The StepTimes of Euler step `step` ([1] int64, on the device) from `final_times` (None without
        constant step times: the estimator then embeds t row by row)."""
        if self.final_times is None:
            return None
        t_emb, resnet = self.final_times
        resnet_step = resnet.index_select(0, step)
        return StepTimes(t_emb.index_select(0, step), tuple(resnet_step.split(self.cfm.estimator.dims.channels, dim=1)))

    def _by_padded_length(self, indices: Sequence[int], frames: Sequence[int]) -> list[tuple[int, list[int]]]:
        """Whole-utterance passes grouped by the length they are padded to, at most REPLAY_ROWS streams
        per group (one graph replay each: a larger batch bucket would capture a graph mid-traffic)."""
        groups: dict[int, list[int]] = {}
        for i in indices:
            groups.setdefault(self._full_length(frames[i]), []).append(i)
        return [(padded, members[k:k + REPLAY_ROWS]) for padded, members in groups.items()
                for k in range(0, len(members), REPLAY_ROWS)]

    def _whole_pass_inputs(self, padded: int, rows: int, items: Sequence[tuple[PromptCache, int]]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(z, cond, spks) of a padded batch of `rows` whole-utterance passes from frame 0; items are
        (prompt, frames); rows past the items are padding."""
        bins, dev = self.cfm.num_bins, self.device
        z = torch.zeros(rows, bins, padded, device=dev)
        cond = torch.zeros(rows, bins, padded, device=dev, dtype=self.dtype)
        spks = torch.zeros(rows, bins, device=dev, dtype=self.dtype)
        for j, (prompt, frames) in enumerate(items):
            z[j, :, :frames] = self.cfm.noise(0, frames)[0].to(dev)
            cond[j, :, :prompt.prompt_mel.shape[0]] = prompt.prompt_mel.T
            spks[j] = prompt.spks
        return z, cond, spks

    def recompute(self, prompt: PromptCache, target_ids: torch.Tensor, finalize: bool) -> torch.Tensor:
        """`recompute_many` for one stream."""
        return self.recompute_many([(prompt, target_ids, finalize)])[0]

    @torch.inference_mode()
    def recompute_many(self, items: Sequence[tuple[PromptCache, torch.Tensor, bool]]) -> list[torch.Tensor]:
        """The official streaming call (spec/streaming.md §2: chunk masks) over prompt + target ids, every
        frame recomputed as the official code does at each chunk: for streams whose next chunk would
        outgrow their slots. No keys are kept and no slot
        is read, so it needs no memory beyond the pass's own, and it costs one graphed pass of the
        stream's length (encoder and ODE) instead of the eager path's Python launches. items: (prompt,
        target ids, finalize); finalize=False: the last 3 target ids are look-ahead. Streams padded to
        one length share one graph replay. Returns mel [80, F] each (prompt frames included)."""
        lookahead = self.flow.dims.pre_lookahead_len
        frames = [UPSAMPLE * (prompt.prompt_tokens.shape[0] + ids.shape[0] - (0 if finalize else lookahead))
                  for prompt, ids, finalize in items]
        out: list[torch.Tensor | None] = [None] * len(items)
        for padded, members in self._by_padded_length(range(len(items)), frames):
            mels = self._recompute_batch(padded, [items[i] for i in members])
            for i, mel in zip(members, mels, strict=True):
                out[i] = mel
        self.watch.lap("recompute")
        return out  # type: ignore[return-value]

    def _recompute_batch(self, padded: int, items: Sequence[tuple[PromptCache, torch.Tensor, bool]]
                         ) -> list[torch.Tensor]:
        """PERF: the streaming encoder of every stream (padded, masked to its own tokens) and the ODE as one
        graph replay per (batch bucket, padded length); the encoder ran eagerly per stream before, ≈ 40 ms
        of Python launches per long stream on the H100's host."""
        lookahead = self.flow.dims.pre_lookahead_len
        rows = bucket(len(items))
        ids = torch.zeros(rows, padded // UPSAMPLE + lookahead, dtype=torch.long, device=self.device)
        valid = torch.full((rows,), ids.shape[1], device=self.device, dtype=torch.long)
        positions = torch.full((rows,), padded // UPSAMPLE, device=self.device, dtype=torch.long)
        lengths = []
        for j, (prompt, target, finalize) in enumerate(items):
            all_ids = _all_ids(prompt, target)
            num_positions = all_ids.shape[0] - (0 if finalize else lookahead)
            ids[j, :all_ids.shape[0]] = all_ids
            valid[j] = all_ids.shape[0]
            positions[j] = num_positions
            lengths.append(UPSAMPLE * num_positions)  # from the host's int: reading positions back would sync
        z, cond, spks = self._whole_pass_inputs(
            padded, rows, [(prompt, n) for (prompt, _, _), n in zip(items, lengths, strict=True)])
        self.watch.lap("recompute_setup")
        (x,) = self.recompute_graphs.run((rows, padded), [ids, valid, positions, z, spks, cond])
        return [x[j, :, :n].clone() for j, n in enumerate(lengths)]

    def _recompute_core(self, ids, valid, positions, z, spks, cond) -> tuple[torch.Tensor]:
        """A streaming pass from frame 0 over each row's first 2·positions frames: the chunk-masked encoder
        (tokens past a row's positions up to valid are its look-ahead), then chunk-masked attention to its
        own keys (padding frames come after a row's frames)."""
        mu = self.flow.encode_padded(ids, valid, streaming=True, positions=positions)[:, :, :z.shape[-1]]
        velocity = self._whole_pass_velocity(
            UPSAMPLE * positions, z.shape[-1], self.chunk, project=self.solver_ops is None,
            times=lambda k: self.step_times[k] if self.step_times is not None else None)
        return (self.cfm.solve(z, mu, spks, cond, velocity, fused=self.solver_ops),)

    def _whole_pass_velocity(self, frames: torch.Tensor, num_frames: int, chunk: int, project: bool,
                             times: Callable[[int], StepTimes | None]):
        """The estimator's velocity for a whole-utterance pass from frame 0 of rows [B] each `frames` long
        (graph body): attention over its own keys (chunk masks when chunk > 0), causal-conv tails from zero
        at every Euler step (the official left padding). It touches no pool slot. project=False: it returns
        the hidden state for a fused ODE tail; times(k): Euler step k's StepTimes (None: from t)."""
        est = self.cfm.estimator
        rows = 2 * frames.shape[0]
        write_pos = torch.arange(num_frames, device=frames.device).repeat(rows, 1)
        limits = frames.repeat_interleave(2)
        own = torch.arange(rows, device=frames.device)  # row r attends to its own keys (PooledKV.own_keys)

        def velocity(k: int, x, mu_in, spks_in, cond_in, t):
            conv = torch.zeros(rows, est.conv_state_channels, 2, device=x.device, dtype=self.dtype)
            keys = PooledKV(self.kv[0], own, write_pos, limits, chunk, num_frames, self.attention_ops, own_keys=True)
            return self._step(x, mu_in, spks_in, cond_in, t, [keys], conv, write_pos, [], times=times(k),
                              project=project)

        return velocity

    def _ode(self, z, mu, spks, cond, slots, starts, marker) -> tuple[torch.Tensor]:
        """The 10-step CFG Euler ODE for a padded batch (graph body: static shapes, no host syncs).
        Each new frame sees its own chunk and everything before it, up to the batch's last new frame."""
        num_new = z.shape[-1]
        rows = torch.stack([2 * slots, 2 * slots + 1], dim=1).flatten()  # [2B]: (cond, uncond) per stream
        write_pos = (starts.unsqueeze(1) + torch.arange(num_new, device=z.device)).repeat_interleave(2, dim=0)
        limits = (starts + num_new).repeat_interleave(2, dim=0)
        attn_len = marker.shape[0]

        def velocity(k: int, x, mu_in, spks_in, cond_in, t):
            conv = self.conv[k][rows]
            pooled = PooledKV(self.kv[k], rows, write_pos, limits, self.chunk, attn_len, self.attention_ops)
            v = self._step(x, mu_in, spks_in, cond_in, t, [pooled], conv, write_pos, [],
                           times=self.step_times[k] if self.step_times is not None else None,
                           project=self.solver_ops is None)
            self.conv[k][rows] = conv
            return v

        return (self.cfm.solve(z, mu, spks, cond, velocity, fused=self.solver_ops),)


def _all_ids(prompt: PromptCache, target_ids: torch.Tensor) -> torch.Tensor:
    """Prompt + target speech token ids [P + N] (int64, on the prompt's device)."""
    return torch.cat([prompt.prompt_tokens, target_ids.to(prompt.prompt_tokens.device, torch.long)])


def _prompt_cond(prompt: PromptCache, start: int, num_new: int) -> torch.Tensor:
    """cond [80, num_new] for frames [start, start + num_new): the prompt mel where it exists, else 0."""
    mel = prompt.prompt_mel
    cond = mel.new_zeros(mel.shape[1], num_new)
    m = min(max(mel.shape[0] - start, 0), num_new)
    cond[:, :m] = mel[start:start + m].T
    return cond
