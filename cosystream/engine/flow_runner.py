"""FlowRunner: the incremental flow of many streams batched through one CUDA-graphed ODE.

Each stream holds a slot of a static pool that keeps, for every Euler step, the estimator's keys/values
of its finished frames and its causal-conv tails (models/flow_stream.py explains why that is exact). A
batch of chunks that add the same number of frames runs the whole 10-step ODE as one graph replay,
keyed by (batch bucket, new frames, attended-length bucket); before it, one batched encoder step per
group of streams at the same token (the slot's encoder caches are pooled too). Official final chunks
(full attention, finalizing encoder) and chunks past a slot run as whole-utterance passes that read no slot
(engine/flow_passes.py). New voices' prompt passes run in their streams' own slots, on CUDA on a lane beside
the worker (engine/prompt_lane.py); a first chunk that follows its pass runs the ODE one graph per Euler step.
Pool memory: models.flow_stream.cache_bytes_per_frame × slots × frames (≈ 2.3 MB per frame for
CosyVoice2-0.5B in bf16), so the pool is sized by EngineConfig.flow_slots × flow_frames. A stream takes a
slot when its first chunk fits; its chunks past the slot recompute every frame as the official code does
(`recompute`: one graphed pass, no keys kept), and its official final pass runs at any length.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from cosystream.cuda_graphs import bucket
from cosystream.engine import flow_fast
from cosystream.engine.flow_passes import LEN_BUCKET, WholePasses
from cosystream.engine.graphs import GraphCache, maybe_compile
from cosystream.engine.pool_copy import copy_words
from cosystream.engine.prompt_lane import NewVoices, PromptLane, PromptPassEvents
from cosystream.engine.stopwatch import Stopwatch
from cosystream.kernels import flow as flow_kernels
from cosystream.kernels import reference as reference_kernels
from cosystream.kernels import triton_usable
from cosystream.models.cfm import VelocityFn
from cosystream.models.estimator import PooledKV, StepTimes
from cosystream.models.flow import LOOKAHEAD_CONTEXT, UP_CONTEXT, UPSAMPLE, EncoderState, Flow
from cosystream.models.flow_stream import EncoderProgress, PromptCache, Window
from cosystream.transfers import ints_to_device, to_device

_ENCODER_ROWS = (1, 2, 4, 8, 16, 32)  # streams per batched encoder step (graph buckets)


@dataclass
class PooledStream(EncoderProgress):
    """A stream's place in the pool: its slot, encoder state and how many frames are final."""

    slot: int
    prompt: PromptCache
    encoder: EncoderState
    is_finished: bool = False
    closed: bool = False  # its slot was given back
    building: PromptPassEvents | None = None  # its prompt pass, still running on the prompt lane when not None


class FlowRunner(WholePasses, NewVoices):
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
        # a first chunk whose stream's prompt pass still runs: its ODE one graph per Euler step, each waiting for
        # that step of the pass
        self.step_graphs = GraphCache(self._ode_step, self.device, use_graphs, stream=capture_stream)
        self.lane = PromptLane(self, use_graphs) if self.device.type == "cuda" else None
        # prompt passes not yet reported (`finished_passes`): (voices, seconds, or the lane's events)
        self._passes: list[tuple[int, float | PromptPassEvents]] = []
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
        self._step_markers = [torch.empty(k, device=self.device, dtype=torch.int8) for k in range(steps)]
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
        """Take a slot and copy the voice's prompt state into it (≈ 0.6 GB for a 6 s prompt, one copy: `copy_words`)."""
        slot = self.free.pop(0)
        rows = slice(2 * slot, 2 * slot + 2)
        n = prompt.kv.shape[-2]
        if prompt.written is not None:  # a voice's cache its prompt pass still writes on the prompt lane
            torch.cuda.current_stream(self.device).wait_event(prompt.written)
        try:
            copy_words(self.kv[:, :, :, rows, :n], prompt.kv)
            self.conv[:, rows] = prompt.conv
            encoder = self._encoder_in_slot(slot, prompt)
        except BaseException:  # e.g. out of memory for the encoder state: the slot is not lost
            self.free.append(slot)
            self.free.sort()
            raise
        return PooledStream(slot, prompt, encoder)

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
        if stream.building is not None:  # its prompt pass may still write the slot: nothing reuses it before
            torch.cuda.current_stream(self.device).wait_event(stream.building.done)
            stream.building = None
        self.free.append(stream.slot)
        self.free.sort()

    # ------------------------------------------------------------------ chunks
    @torch.inference_mode()
    def advance(self, streams: Sequence[PooledStream], windows: Sequence[Window]) -> list[torch.Tensor]:
        """Encode each stream's new tokens, then integrate every stream's new frames in one graph.

        windows[i] = (new position ids [n], look-ahead ids [3] or None); all n must be equal.
        Returns each stream's new frames [80, 2n] (float32), prompt frames included. A stream whose prompt
        pass still runs on the prompt lane (its first chunk) is waited for step by step: the encoder after the
        pass's encoder step, each Euler step after the pass's same step (one graph per step).
        """
        passes = [s.building for s in streams if s.building is not None]
        for s in streams:
            s.building = None  # what this stream queues from now on comes after the waits below
        worker = torch.cuda.current_stream(self.device) if passes else None
        for events in passes:
            worker.wait_event(events.encoded)
        inputs = self._ode_inputs(streams, windows, self.encoder_graphs)
        by_step = bool(passes) and self._steps_captured(inputs.key)
        for events in passes if not by_step else ():
            worker.wait_event(events.done)
        if by_step:
            x = list(self._ode_steps(inputs, self.step_graphs, waits=passes))[-1]
        else:
            (x,) = self.graphs.run(inputs.key, inputs.tensors)
        out = [x[i].clone() for i in range(len(streams))]
        self.watch.lap("ode", tag=f"ode_{len(streams)}x{inputs.num_new}")
        return out

    def _ode_inputs(self, streams: Sequence[PooledStream], windows: Sequence[Window], encoder_graphs: GraphCache,
                    on_lane: bool = False) -> _OdeInputs:
        """The streams' new tokens encoded (with `encoder_graphs`) and the ODE's padded inputs. on_lane: for the
        prompt lane's step graphs (no stage laps: the worker's stopwatch times the worker's stream)."""
        starts = [s.num_frames for s in streams]
        num_new = UPSAMPLE * windows[0][0].shape[0]
        b, padded = len(streams), bucket(len(streams))
        mu = torch.zeros(padded, self.cfm.num_bins, num_new, device=self.device, dtype=self.dtype)
        self._encode_all(streams, windows, mu, encoder_graphs)
        if not on_lane:
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
        slots[:b] = ints_to_device([s.slot for s in streams], self.device)
        start_t = torch.zeros(padded, device=self.device, dtype=torch.long)
        start_t[:b] = ints_to_device(starts, self.device)
        marker = torch.empty(attn_len, device=self.device, dtype=torch.int8)
        if not on_lane:
            # Capturing runs the step once outside the graph, which would advance these streams' conv tails
            # and then replay over them: capture a new shape on the scratch slot first.
            self.capture(padded, num_new, attn_len)
            self.watch.lap("ode_setup")
        return _OdeInputs((padded, num_new, attn_len), num_new, [z, mu, spks, cond, slots, start_t, marker])

    def _steps_captured(self, key: tuple[int, int, int]) -> bool:
        """Are this ODE shape's step graphs at hand? A first chunk whose shape warm-up did not capture step by
        step (e.g. later chunks riding with it attend further) waits for its prompt passes whole instead: ten
        captures in traffic would hold the worker for about a second."""
        graphs = self.step_graphs
        return not graphs.enabled or all((*key, k) in graphs.graphs for k in range(self.cfm.num_steps))

    def _ode_steps(self, inputs: _OdeInputs, graphs: GraphCache,
                   waits: Sequence[PromptPassEvents] = ()) -> Iterator[torch.Tensor]:
        """The ODE of `_ode` one Euler step (one replay of `graphs`) at a time, each after the same step of
        every pass in `waits`; yields the state after each step ([B, 80, C] float32, the graph's buffer)."""
        z, mu, spks, cond, slots, start_t, marker = inputs.tensors
        mu_in, spks_in, cond_in = self.cfm.cfg_inputs(mu, spks, cond)
        x, rows = z, self.cfm.cfg_rows(z)
        stream = torch.cuda.current_stream(self.device) if waits else None
        for k in range(self.cfm.num_steps):
            for events in waits:
                stream.wait_event(events.steps[k])
            self._capture_step(graphs, inputs.key, k)
            x, rows = graphs.run((*inputs.key, k), [x, rows, mu_in, spks_in, cond_in, slots, start_t, marker,
                                                   self._step_markers[k]])
            yield x

    def _encode_all(self, streams: Sequence[PooledStream], windows: Sequence[Window], mu: torch.Tensor,
                    graphs: GraphCache) -> None:
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
                out = self._encode_batch([streams[i] for i in chunk], [windows[i] for i in chunk], graphs)
                for j, i in enumerate(chunk):
                    mu[i] = out[j]

    def _pooled_encoder(self, stream: PooledStream) -> bool:
        return stream.encoder.kv_tokens.data_ptr() == self.enc_tokens[stream.slot].data_ptr()

    def _encode_batch(self, streams: Sequence[PooledStream], windows: Sequence[Window], graphs: GraphCache
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
        ids[:b] = to_device(torch.stack([w[0] for w in windows]), self.device)
        if has_context:
            ctx[:b] = to_device(torch.stack([w[1] for w in windows]), self.device)
        la_tail[:b] = torch.stack([s.encoder.lookahead_tail for s in streams])
        up_tail[:b] = torch.stack([s.encoder.up_tail for s in streams])
        slots[:b] = ints_to_device([s.slot for s in streams], self.device)
        self.capture_encoder(b, start, n, has_context, graphs)
        mu, la_out, up_out = graphs.run(key, inputs)
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

    def capture_encoder(self, batch: int, start: int, n: int, has_context: bool, graphs: GraphCache | None = None
                        ) -> None:
        """Capture a batched encoder step ahead of traffic (warm-up), in `graphs` (the worker's by default).
        Capturing runs the step outside the graph too, so it works on the scratch slot only."""
        graphs = self.encoder_graphs if graphs is None else graphs
        batch = min(batch, _ENCODER_ROWS[-1])  # larger groups run in parts of this size
        key = (bucket(batch, _ENCODER_ROWS), start, n, has_context)
        if not graphs.enabled or key in graphs.graphs or start + n > self.enc_tokens.shape[3]:
            return
        graphs.run(*self._encoder_inputs(batch, start, n, has_context))

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
        return (self.cfm.solve(z, mu, spks, cond, self._velocity(z.shape[-1], slots, starts, marker.shape[0]),
                               fused=self.solver_ops),)

    def _ode_step(self, x, rows, mu_in, spks_in, cond_in, slots, starts, marker, step
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Euler step `step.shape[0]` of `_ode` (a graph of its own per step): the state x and the estimator's
        input rows made for this step (ignored at step 0: made from x) -> the next state and rows."""
        k = step.shape[0]
        velocity = self._velocity(x.shape[-1], slots, starts, marker.shape[0])
        x, rows = self.cfm.step(k, x, rows if k and self.solver_ops is not None else None, mu_in, spks_in, cond_in,
                                velocity, self.solver_ops)
        return x, self.cfm.cfg_rows(x) if rows is None else rows

    def _velocity(self, num_new: int, slots: torch.Tensor, starts: torch.Tensor, attn_len: int) -> VelocityFn:
        """The estimator's velocity at Euler step k for pooled streams: their new frames' keys go into their
        slots at their starts, their conv tails are read and written there."""
        rows = torch.stack([2 * slots, 2 * slots + 1], dim=1).flatten()  # [2B]: (cond, uncond) per stream
        write_pos = (starts.unsqueeze(1) + torch.arange(num_new, device=slots.device)).repeat_interleave(2, dim=0)
        limits = (starts + num_new).repeat_interleave(2, dim=0)

        def velocity(k: int, x, mu_in, spks_in, cond_in, t):
            conv = self.conv[k][rows]
            pooled = PooledKV(self.kv[k], rows, write_pos, limits, self.chunk, attn_len, self.attention_ops)
            v = self._step(x, mu_in, spks_in, cond_in, t, [pooled], conv, write_pos, [],
                           times=self.step_times[k] if self.step_times is not None else None,
                           project=self.solver_ops is None)
            self.conv[k][rows] = conv
            return v

        return velocity

    def _capture_step(self, graphs: GraphCache, key: tuple[int, int, int], k: int) -> None:
        """Capture Euler step k of an ODE shape ahead of its use, on the scratch slot (as `capture`)."""
        if (*key, k) in graphs.graphs or not graphs.enabled:
            return
        batch, num_new, attn_len = key
        bins, dev = self.cfm.num_bins, self.device
        x = torch.zeros(batch, bins, num_new, device=dev)
        rows = torch.zeros(2 * batch, bins, num_new, device=dev, dtype=self.dtype)
        cfg = torch.zeros(2 * batch, bins, num_new, device=dev, dtype=self.dtype)
        slots = torch.full((batch,), self.scratch, device=dev, dtype=torch.long)
        starts = torch.zeros(batch, device=dev, dtype=torch.long)
        marker = torch.empty(attn_len, device=dev, dtype=torch.int8)
        spks = torch.zeros(2 * batch, bins, device=dev, dtype=self.dtype)
        graphs.run((*key, k), [x, rows, cfg, spks, cfg.clone(), slots, starts, marker, self._step_markers[k]])

    def capture_steps(self, batch: int, num_new: int, attn_len: int) -> None:
        """Capture every Euler step of a first chunk's ODE shape, for first chunks that follow their prompt
        passes step by step (warm-up)."""
        for k in range(self.cfm.num_steps):
            self._capture_step(self.step_graphs, (batch, num_new, attn_len), k)

@dataclass
class _OdeInputs:
    key: tuple[int, int, int]  # (padded batch, new frames, attended length): the ODE graph's
    num_new: int
    tensors: list[torch.Tensor]  # z, mu, spks, cond, slots, starts, marker (`_ode`'s arguments)


def _prompt_cond(prompt: PromptCache, start: int, num_new: int) -> torch.Tensor:
    """cond [80, num_new] for frames [start, start + num_new): the prompt mel where it exists, else 0."""
    mel = prompt.prompt_mel
    cond = mel.new_zeros(mel.shape[1], num_new)
    m = min(max(mel.shape[0] - start, 0), num_new)
    cond[:, :m] = mel[start:start + m].T
    return cond
