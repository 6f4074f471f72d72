"""FlowRunner: the incremental flow of many streams batched through one CUDA-graphed ODE.

Each stream holds a slot of a static pool that keeps, for every Euler step, the estimator's keys/values
of its finished frames and its causal-conv tails (models/flow_stream.py explains why that is exact). A
batch of chunks that add the same number of frames runs the whole 10-step ODE as one graph replay,
keyed by (batch bucket, new frames, attended-length bucket); before it, one batched encoder step per
group of streams at the same token (the slot's encoder caches are pooled too). Official final chunks
(full attention, finalizing encoder) and chunks past a slot run as whole-utterance passes that read no slot
(engine/flow_passes.py).
Pool memory: models.flow_stream.cache_bytes_per_frame × slots × frames (≈ 2.3 MB per frame for
CosyVoice2-0.5B in bf16), so the pool is sized by EngineConfig.flow_slots × flow_frames. A stream takes a
slot when its first chunk fits; its chunks past the slot recompute every frame as the official code does
(`recompute`: one graphed pass, no keys kept), and its official final pass runs at any length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from cosystream.cuda_graphs import bucket
from cosystream.engine import flow_fast
from cosystream.engine.flow_passes import LEN_BUCKET, WholePasses
from cosystream.engine.graphs import GraphCache, maybe_compile
from cosystream.engine.stopwatch import Stopwatch
from cosystream.kernels import flow as flow_kernels
from cosystream.kernels import reference as reference_kernels
from cosystream.kernels import triton_usable
from cosystream.models.estimator import PooledKV, StepTimes
from cosystream.models.flow import LOOKAHEAD_CONTEXT, UP_CONTEXT, UPSAMPLE, EncoderState, Flow
from cosystream.models.flow_stream import EncoderProgress, FlowStream, PromptCache

_ENCODER_ROWS = (1, 2, 4, 8, 16, 32)  # streams per batched encoder step (graph buckets)


@dataclass
class PooledStream(EncoderProgress):
    """A stream's place in the pool: its slot, encoder state and how many frames are final."""

    slot: int
    prompt: PromptCache
    encoder: EncoderState
    is_finished: bool = False
    closed: bool = False  # its slot was given back


class FlowRunner(WholePasses):
    """The flow pool of `num_slots` streams × `max_frames` frames, its graphs and its fused ops (on CUDA the
    estimator runs `engine/flow_fast.py`'s step; elsewhere the plain modules, attention through
    `kernels.reference`). One thread at a time: the engine hands it to the token-to-wave worker."""

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
        self.num_slots = num_slots
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
        """FlowStream.build_prompt_cache for voices whose prompt caches have one length, through the pool: their
        frames advance in free slots as one chunk (one graphed ODE for all), then leave them as
        PromptCaches. prompts: (tokens [1, P], mel [1, 2P, 80], xvector [1, 192]) each; their token counts
        may differ as long as their caches end at one chunk boundary (`FlowStream.prompt_cache_tokens`: the
        tokens past it only give look-ahead). PERF: the eager pass launches each op of ten estimator steps
        from Python: ≈ 0.5 s per 6 s prompt on the H100, on the first chunk's path of every request in a
        voice not in memory."""
        empties = [stream.empty_prompt(*prompt) for prompt in prompts]
        boundaries = {stream.prompt_cache_tokens(empty.prompt_tokens.shape[0]) for empty in empties}
        if len(boundaries) != 1 or len(empties) > len(self.free):
            raise ValueError(f"prompts whose caches end at {sorted(boundaries)} tokens for {len(self.free)} free "
                             "slots: one length (one cache boundary), at most one prompt per free slot")
        boundary = boundaries.pop()
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

    def attn_len_for(self, end_frame: int) -> int:
        """Frames a chunk ending at `end_frame` attends to: rounded up to a multiple of LEN_BUCKET (fewer
        graphs, little waste), at most the slot's."""
        return min(-(-end_frame // LEN_BUCKET) * LEN_BUCKET, self.max_frames)

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


def _prompt_cond(prompt: PromptCache, start: int, num_new: int) -> torch.Tensor:
    """cond [80, num_new] for frames [start, start + num_new): the prompt mel where it exists, else 0."""
    mel = prompt.prompt_mel
    cond = mel.new_zeros(mel.shape[1], num_new)
    m = min(max(mel.shape[0] - start, 0), num_new)
    cond[:, :m] = mel[start:start + m].T
    return cond
