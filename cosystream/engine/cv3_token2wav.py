"""CV3Token2WavRunner: the CosyVoice3 token-to-wave side of the engine, behind the runner contract that
`EngineCore` uses for CosyVoice2's `Token2WavRunner` (start / run / release / slot queries / watch).

Per request it holds a `Token2WavStream` (models/cosyvoice3/stream.py): the DiT runs over new frames only
(keys/values of complete attention blocks kept per Euler step) and the causal vocoder over new frames plus
a fixed left context. The official final chunk (full attention) re-runs the flow once over the whole
sequence unless `final_attention` is "chunk".

With a flow slot pool (`flow_slots` > 0, the default on CUDA) every stream opens in a slot of a
`FlowSlotPool` (models/cosyvoice3/pool.py): its keys/values live in static buffers, and the block-causal
chunks of all streams in one `run` are voiced together, grouped by padded frame count, as one replay of
a CUDA graph per (batch, frames) bucket (and key frames, where the torch statements run: `FlowSlotPool.
key_frames`). A stream whose utterance outgrows its slot leaves the pool and continues eagerly; without a
pool (or a free slot) chunks run one stream at a time.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from cosystream.config import ChunkSchedule
from cosystream.cuda_graphs import BATCH_BUCKETS, bucket, capture_stream
from cosystream.engine import runners
from cosystream.engine.chunking import ChunkPlan, ChunkPlanner
from cosystream.engine.graphs import GraphCache
from cosystream.engine.stopwatch import Stopwatch
from cosystream.kernels import flow as flow_kernels
from cosystream.kernels import reference as reference_kernels
from cosystream.kernels import triton_usable
from cosystream.models.cosyvoice3.flow import CV3Flow, PromptBlocks, encode_prompt_blocks
from cosystream.models.cosyvoice3.hift import CausalHiFT, HiftStream, VocoderWindow, window_audio
from cosystream.models.cosyvoice3.pool import FlowSlotPool, PooledFlowStream, SlotChunk, finish_chunks, pack_chunks
from cosystream.models.cosyvoice3.stream import ChunkCall, Token2WavStream
from cosystream.transfers import ints_to_device, to_device, to_host


@dataclass
class CV3Token2WavState:
    """One segment's token-to-wave stream."""

    stream: Token2WavStream
    key: Any
    speed: float = 1.0
    pooled: PooledFlowStream | None = None  # its flow state in a pool slot (None: in `stream`)
    chunk_index: int = 0
    samples_done: int = 0
    finished: bool = False
    extras: dict[str, Any] = field(default_factory=dict)


log = logging.getLogger("cosystream.engine")


class CV3Token2WavRunner:
    """Owns the CosyVoice3 flow and vocoder; turns ready chunks into audio."""

    final_attention: str
    # the official final pass runs in the stream's pool slot (or its eager caches): the slot is kept to the end
    final_reads_slot = True
    overflow_started = 0
    pooled_chunks = 0  # chunks voiced in the pool (batched)
    graph_error: str | None = None  # why graph capture was turned off, if it was
    pool_exits = 0  # streams that outgrew their slot and went on eagerly

    def __init__(self, flow: CV3Flow, hift: CausalHiFT, final_attention: str = "full",
                 max_voice_caches: int = 16, flow_slots: int | None = None, slot_frames: int = 1024,
                 cuda_graphs: bool = True) -> None:
        """flow_slots: streams whose flow state lives in the static pool (None: 16 on CUDA, none on the
        CPU; 0: no pool). slot_frames: 50 Hz mel frames one slot holds, prompt included (a stream that
        outgrows it continues eagerly); a slot costs `FlowSlotPool.bytes_per_frame(flow)` per frame
        (≈ 1.8 MB in bf16 at the 0.5B shapes). cuda_graphs: replay the pooled chunks as CUDA graphs."""
        if final_attention not in ("full", "chunk"):
            raise ValueError(f"final_attention: 'full' or 'chunk', got {final_attention!r}")
        self.flow, self.hift = flow, hift
        self.final_attention = final_attention
        self.device = flow.input_embedding.weight.device
        self.watch = Stopwatch(self.device)
        self.on_new_voice_cache: Callable[[str, dict[str, torch.Tensor]], None] | None = None
        # a registered voice's target-independent prompt blocks, encoded once (LRU)
        self.voice_caches: OrderedDict[str, PromptBlocks] = OrderedDict()
        self.max_voice_caches = max_voice_caches
        if flow_slots is None:
            flow_slots = 16 if self.device.type == "cuda" else 0
        triton = triton_usable(self.device)
        self.pool = (FlowSlotPool(flow, flow_slots, slot_frames, flow_kernels if triton else reference_kernels,
                                  keys_in_place=triton) if flow_slots > 0 else None)
        self.graphs = (GraphCache(self._graph_chunk, self.device, enabled=cuda_graphs,
                                  stream=capture_stream(self.device)) if self.pool is not None else None)
        self.vocoder_graphs = GraphCache(self._graph_window, self.device, enabled=cuda_graphs,
                                         stream=capture_stream(self.device))

    # ------------------------------------------------------------------ per-request state
    def start(self, inputs: Any, voice_key: str | None, key: Any = None, speed: float = 1.0,
              max_target_tokens: int = 256, seed: int = 0, stored: dict | None = None) -> CV3Token2WavState:
        """A new stream from a segment's `ModelInputs` (flow prompt tokens, prompt mel, x-vector), in a free
        pool slot when there is one.

        A registered voice (`voice_key`) reuses its encoded prompt blocks. seed and max_target_tokens are
        accepted for the runner contract: CosyVoice3's source noise is the model's fixed table (indexed by
        sample), and a stream that outgrows its slot continues eagerly.
        """
        del max_target_tokens, seed, stored
        dev = self.device
        prompt_token = to_device(inputs.flow_prompt_speech_tokens, dev, torch.long).view(1, -1)
        prompt_feat = to_device(inputs.prompt_mel, dev).view(1, -1, inputs.prompt_mel.shape[-1])
        embedding = to_device(inputs.xvector, dev).view(1, -1)
        blocks = self._prompt_blocks(voice_key, prompt_token, prompt_feat, embedding) if voice_key else None
        stream = Token2WavStream(self.flow, self.hift, prompt_token, prompt_feat, embedding,
                                 final_full_attention=self.final_attention == "full", prompt_blocks=blocks)
        pooled = None
        # every stream that `needs_slot` takes one (a speed-changed one voices its single non-streaming
        # chunk eagerly but holds the slot all the same, so the core's count of free slots stays exact)
        if self.pool is not None and self.pool.free and self._fits(prompt_feat.shape[1]):
            with torch.inference_mode():
                pooled = PooledFlowStream(self.pool, prompt_token, prompt_feat, embedding, blocks)
        return CV3Token2WavState(stream=stream, key=key, speed=speed, pooled=pooled)

    def finished_prompt_passes(self) -> list[tuple[int, float]]:
        """None: a new voice's prompt blocks are encoded as its stream opens (`start`), in the open phase."""
        return []

    def open_streams(self, items: Sequence[dict[str, Any]]) -> list[CV3Token2WavState | Exception]:
        """Each stream opens on its own (`start`); one that cannot gets its exception."""
        return [runners.start_or_error(self, item, self.device) for item in items]

    def _fits(self, prompt_frames: int) -> bool:
        """Whether a slot holds the prompt and at least one chunk after it."""
        return self.pool is not None and prompt_frames + 4 * self.flow.decoder.estimator.dims.static_chunk_size \
            <= self.pool.max_frames

    @torch.inference_mode()
    def _prompt_blocks(self, voice_key: str, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                       embedding: torch.Tensor) -> PromptBlocks:
        if voice_key in self.voice_caches:
            self.voice_caches.move_to_end(voice_key)
            return self.voice_caches[voice_key]
        blocks = encode_prompt_blocks(self.flow, prompt_token, prompt_feat, embedding)
        self.voice_caches[voice_key] = blocks
        while len(self.voice_caches) > self.max_voice_caches:
            self.voice_caches.popitem(last=False)
        return blocks

    def opened(self) -> None:
        """A batch that only opened streams: wait for its work (this thread's stream) so its stage times
        can be read."""
        self._sync()
        self.watch.settle()

    def release(self, state: CV3Token2WavState) -> None:
        """The stream is done (or abandoned): its pool slot goes back."""
        state.finished = True
        self._leave_pool(state, keep_state=False)

    def _leave_pool(self, state: CV3Token2WavState, keep_state: bool) -> None:
        """Give the stream's slot back; keep_state: its keys/values continue in the eager `FlowStream`."""
        if state.pooled is None:
            return
        if keep_state:
            state.stream.flow_stream.state.caches = self.pool.export(state.pooled.slot)
            self.pool_exits += 1
        state.pooled.close()
        state.pooled = None

    def has_prompt(self, voice_key: str | None, stored: dict[str, torch.Tensor] | None = None) -> bool:
        """Whether a stream in this voice starts without encoding its prompt blocks first."""
        return voice_key is None or voice_key in self.voice_caches

    def forget_voice(self, voice_key: str) -> None:
        self.voice_caches.pop(voice_key, None)

    def can_start(self, inputs: Any, max_target_tokens: int) -> bool:
        """False while a new stream that runs in the pool must wait for a free slot."""
        return not self.needs_slot(inputs, max_target_tokens) or bool(self.pool.free)

    def needs_slot(self, inputs: Any, max_target_tokens: int) -> bool:
        """True when a new stream runs in a pool slot: with a pool, unless its prompt leaves no room."""
        return self.pool is not None and self._fits(inputs.prompt_mel.view(-1, inputs.prompt_mel.shape[-1]).shape[0])

    def free_slots(self) -> int | None:
        """Free pool slots (None: no pool)."""
        return None if self.pool is None else len(self.pool.free)

    def flow_slots(self) -> int | None:
        """The pool's slots, free or held (None: no pool)."""
        return None if self.pool is None else self.pool.num_slots

    def slot_gauges(self) -> dict[str, float]:
        """Flow-slot gauges for /metrics (none without a pool)."""
        return {} if self.pool is None else {"flow_slots_free": float(len(self.pool.free))}

    def overflow_room(self) -> int:
        return 0

    def flow_group(self, state: CV3Token2WavState, plan: ChunkPlan) -> Hashable | None:
        """Chunks of equal keys share one graph replay: a pooled chunk's key is its kind (block-causal
        chunk or official final pass) and padded frame count; eager chunks run on their own (None)."""
        if state.pooled is None or state.speed != 1.0:
            return None
        total = state.pooled.frames_after(plan.token_end, plan.is_final)
        if total > self.pool.max_frames:
            return None
        if plan.is_final and self.final_attention == "full":
            return ("cv3-pool", False, self._frames_bucket(total))
        return ("cv3-pool", True, self._frames_bucket(total - state.pooled.length))

    def pausable(self, jobs: Sequence[tuple[CV3Token2WavState, list[int], ChunkPlan]]) -> bool:
        return False

    @torch.inference_mode()
    def warmup(self, prompt_tokens: int = 150, target_tokens: int = 250, schedule: ChunkSchedule | None = None
               ) -> int:
        """Capture the graphs a stream of this shape uses (the engine's chunk plan under `schedule`), for
        every batch bucket up to the pool size: the pooled flow chunks on the scratch slot (no stream's
        state changes) and the vocoder windows on scratch streams. Returns the graphs captured."""
        if self.graphs is None or not self.graphs.enabled:
            return 0
        before = len(self.graphs.graphs) + len(self.vocoder_graphs.graphs)
        block = self.flow.decoder.estimator.dims.static_chunk_size
        ratio, lookahead = self.flow.ratio, self.flow.dims.pre_lookahead_len
        planner = ChunkPlanner(schedule or ChunkSchedule(), prompt_tokens, block=block // ratio)
        plans = []
        while (plan := planner.next_plan(target_tokens, done=True)) is not None:
            plans.append(plan)
        buckets = [b for b in BATCH_BUCKETS if b <= self.pool.num_slots]
        committed = (ratio * max(prompt_tokens - lookahead, 0) // block) * block
        for plan in plans:
            total = ratio * (prompt_tokens + plan.token_end - (0 if plan.is_final else lookahead))
            if total > self.pool.max_frames:
                continue
            full = plan.is_final and self.final_attention == "full"  # the official final pass: every frame
            start = 0 if full else committed
            mel = torch.zeros(1, self.flow.dims.output_size, total - start, device=self.device)
            chunk = SlotChunk(slot=self.pool.scratch, start=start, valid=total - start, keep=0, first_new=start,
                              mu=mel, cond=mel, spks=mel[:, :, 0], streaming=not full)
            for b in buckets:
                self._pooled_flow([chunk] * b)
            committed = (total // block) * block if not plan.is_final else total
        self.pool.lengths[self.pool.scratch] = 0
        for b in buckets:
            self._warm_vocoder(b, prompt_tokens, plans)
        self._sync()
        return len(self.graphs.graphs) + len(self.vocoder_graphs.graphs) - before

    def _warm_vocoder(self, batch: int, prompt_tokens: int, plans: list[ChunkPlan]) -> None:
        """Scratch `HiftStream`s voice zero mels of the plan's chunk sizes, `batch` at a time."""
        streams = [HiftStream(self.hift) for _ in range(batch)]
        ratio, lookahead = self.flow.ratio, self.flow.dims.pre_lookahead_len
        for plan in plans:
            frames = ratio * (plan.token_end - (0 if plan.is_final else lookahead) - plan.offset)
            mel = torch.zeros(1, self.flow.dims.output_size, frames, device=self.device)
            windows = [s.window(mel, plan.is_final) for s in streams]
            if windows[0] is None:
                continue
            shape = self._window_key(windows[0])  # type: ignore[arg-type]
            _, f0 = self._window_batch(windows, shape[0], capture=True)  # type: ignore[arg-type]
            for s, w in zip(streams, windows, strict=True):
                s.commit(w, f0[:1].clone())  # type: ignore[arg-type]

    # ------------------------------------------------------------------ chunks
    @torch.inference_mode()
    def run(self, jobs: Sequence[tuple[CV3Token2WavState, list[int], ChunkPlan]],
            should_stop: Callable[[], bool] | None = None) -> list[tuple[np.ndarray, float, float]]:
        """Audio for each job (state, all tokens of the segment so far, plan): (pcm, flow_s, vocoder_s).

        Pooled block-causal chunks run batched (grouped by padded frame count); the others one by one.
        """
        del should_stop
        mels, flow_s = self.flow_chunks(jobs)
        wavs, vocoder_s = self.vocode_chunks([(state, mel, plan.is_final) for (state, _, plan), mel
                                              in zip(jobs, mels, strict=True)])
        results = []
        host = to_host([wav[0] for wav in wavs])
        for (state, _, plan), wav, pcm, f_s, v_s in zip(jobs, wavs, host, flow_s, vocoder_s, strict=True):
            state.chunk_index += 1
            state.samples_done += wav.shape[1]
            if plan.is_final:
                state.finished = True
                self._leave_pool(state, keep_state=False)
            results.append((pcm, f_s, v_s))
        self._sync()  # the laps' events are read next (a batch may have voiced nothing to copy)
        self.watch.settle()
        return results

    @torch.inference_mode()
    def vocode_chunks(self, items: Sequence[tuple[CV3Token2WavState, torch.Tensor, bool]]
                      ) -> tuple[list[torch.Tensor], list[float]]:
        """Each stream's new samples [1, n] for its new mel, and the seconds its vocoder call took.

        Incremental windows of equal shape key run together (one graph replay per batch bucket on CUDA);
        speed-changed (non-streaming) chunks run the whole-mel vocoder alone.
        """
        wavs: list[torch.Tensor] = [torch.empty(1, 0)] * len(items)
        seconds = [0.0] * len(items)
        groups: dict[tuple, list[tuple[int, VocoderWindow]]] = {}
        for i, (state, mel, final) in enumerate(items):
            if state.speed != 1.0:
                t0 = time.perf_counter()
                wavs[i] = self.hift.inference(mel, finalize=True)[0]
                self._sync()
                seconds[i] = time.perf_counter() - t0
                continue
            window = state.stream.hift_stream.window(mel, final)
            if window is None:
                wavs[i] = mel.new_zeros(1, 0).float()
            else:
                groups.setdefault(self._window_key(window), []).append((i, window))
        for key, members in groups.items():
            t0 = time.perf_counter()
            for first in range(0, len(members), BATCH_BUCKETS[-1]):
                part = members[first:first + BATCH_BUCKETS[-1]]
                out, f0 = self._window_batch([w for _, w in part], key[0])
                u = self.hift.upsample_scale
                for row, (i, window) in enumerate(part):
                    samples = window.end_sample - window.start_frame * u - window.out_start
                    wavs[i] = out[row:row + 1, :samples].clone()
                    items[i][0].stream.hift_stream.commit(window, f0[row:row + 1].clone())
            self._sync()
            spent = time.perf_counter() - t0
            for i, _ in members:
                seconds[i] = spent
        return wavs, seconds

    def _window_key(self, window: VocoderWindow) -> tuple[int, int, int, bool]:
        """The shape a window is decoded at: a non-final window's frames rounded up to an attention block
        (padded on the right: its emitted samples do not depend on later frames, which is what makes
        incremental vocoding exact); a final window's exact frames (its right edge is the utterance's).
        The padding needs noise-table samples; near the table's end a window keeps its exact frames."""
        frames, f0_skip, out_start, finalize = window.key
        if not finalize:
            padded = self._frames_bucket(frames)
            last = (window.start_frame + padded - f0_skip) * self.hift.upsample_scale
            if last <= self.hift.m_source.noise_table.shape[1]:
                frames = padded
        return frames, f0_skip, out_start, finalize

    def _window_batch(self, windows: list[VocoderWindow], frames: int, capture: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """One replay of the vocoder graph of these windows' shape (`frames` after right padding), padded
        to a batch bucket: (samples [rows, n] from each window's `out_start`, f0 [rows, f]).

        A final window's exact length varies with the utterance, so it replays a graph only when one was
        captured for it (`capture`: warm-up), else runs eagerly: no capture stalls the worker mid-traffic.
        """
        rows = bucket(len(windows))
        padded = windows + [windows[0]] * (rows - len(windows))  # repeated rows: computed, never read
        u = self.hift.upsample_scale
        mel = torch.cat([F.pad(w.mel, (0, frames - w.mel.shape[2])) for w in padded])
        carry = torch.cat([w.carry for w in padded])
        start = ints_to_device([w.start_frame * u for w in padded], self.device)
        _, f0_skip, out_start, finalize = windows[0].key
        key = (rows, frames, f0_skip, out_start, finalize)
        if finalize and not capture and key not in self.vocoder_graphs.graphs:
            return window_audio(self.hift, mel, carry, start, f0_skip, out_start, finalize)
        return self._replay(self.vocoder_graphs, key,
                            [mel, carry, start, *self._window_constants(f0_skip, out_start, finalize)])

    def _window_constants(self, f0_skip: int, out_start: int, finalize: bool) -> list[torch.Tensor]:
        """A graph's static ints, carried as tensor shapes (GraphCache passes tensors only)."""
        return [torch.empty(f0_skip, device=self.device, dtype=torch.int8),
                torch.empty(out_start, device=self.device, dtype=torch.int8),
                torch.empty(int(finalize), device=self.device, dtype=torch.int8)]

    def _graph_window(self, mel: torch.Tensor, carry: torch.Tensor, start: torch.Tensor, f0_skip: torch.Tensor,
                      out_start: torch.Tensor, finalize: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return window_audio(self.hift, mel, carry, start, f0_skip.shape[0], out_start.shape[0],
                            bool(finalize.shape[0]))

    @torch.inference_mode()
    def flow_chunks(self, jobs: Sequence[tuple[CV3Token2WavState, list[int], ChunkPlan]]
                    ) -> tuple[list[torch.Tensor], list[float]]:
        """Each job's new mel [1, 80, m] float32 and the seconds its flow call took (a batched call's
        seconds count for each of its chunks)."""
        for state, _, _ in jobs:
            if state.finished:
                raise RuntimeError("CV3Token2WavRunner: chunk for a finished stream")
        mels: list[torch.Tensor] = [torch.empty(0)] * len(jobs)
        flow_s = [0.0] * len(jobs)
        groups: dict[tuple[bool, int], list[tuple[int, SlotChunk]]] = {}
        for i, (state, tokens, plan) in enumerate(jobs):
            ids = ints_to_device(tokens[:plan.token_end], self.device).view(1, -1)
            call = ChunkCall(plan.token_end, plan.offset, plan.is_final)
            chunk = self._pool_chunk(state, ids, call)
            if chunk is None:
                t0 = time.perf_counter()
                mels[i] = self._speed_mel(state, ids, call) if state.speed != 1.0 else state.stream.new_mel(ids, call)
                self._sync()
                flow_s[i] = time.perf_counter() - t0
            else:
                groups.setdefault((chunk.streaming, self._frames_bucket(chunk.valid)), []).append((i, chunk))
        for (_, frames), members in sorted(groups.items()):
            t0 = time.perf_counter()
            out = self._pooled_flow([c for _, c in members], frames)
            self._sync()
            spent = time.perf_counter() - t0
            for (i, _), mel in zip(members, out, strict=True):
                mels[i], flow_s[i] = mel, spent
        return mels, flow_s

    def _pool_chunk(self, state: CV3Token2WavState, ids: torch.Tensor, call: ChunkCall) -> SlotChunk | None:
        """The chunk's pooled inputs, or None when it runs eagerly (no slot, an official final pass, or a
        chunk past the slot: then the stream leaves the pool, its state continuing in `FlowStream`)."""
        if state.pooled is None or state.speed != 1.0:
            return None
        if state.pooled.frames_after(call.num_tokens, call.finalize) > self.pool.max_frames:
            self._leave_pool(state, keep_state=True)
            return None
        if call.finalize and self.final_attention == "full":
            return state.pooled.prepare_full(ids, call.token_offset)
        return state.pooled.prepare(ids, call.token_offset, call.finalize)

    def _frames_bucket(self, frames: int) -> int:
        block = self.flow.decoder.estimator.dims.static_chunk_size
        return -(-frames // block) * block

    def _pooled_flow(self, chunks: list[SlotChunk], frames: int | None = None) -> list[torch.Tensor]:
        """One graph replay (per batch bucket) of the pooled chunks, padded to `frames` new frames."""
        frames = frames or self._frames_bucket(max(c.valid for c in chunks))
        out: list[torch.Tensor] = []
        largest = BATCH_BUCKETS[-1]
        for first in range(0, len(chunks), largest):
            part = chunks[first:first + largest]
            rows = bucket(len(part))
            pad = SlotChunk(slot=self.pool.scratch, start=0, valid=1, keep=0, first_new=0, mu=part[0].mu[:, :, :1],
                            cond=part[0].cond[:, :, :1], spks=part[0].spks, streaming=part[0].streaming)
            inputs = pack_chunks(self.pool, part + [pad] * (rows - len(part)), frames)
            longest = max(c.start + c.valid for c in part)
            key_frames = self.pool.key_frames(longest)
            # the graph's static ints, carried as tensor shapes (GraphCache passes tensors only)
            lengths = torch.empty(key_frames, device=self.device, dtype=torch.int8)
            streaming = torch.empty(int(part[0].streaming), device=self.device, dtype=torch.int8)
            [x1] = self._replay(self.graphs, (rows, frames, key_frames, part[0].streaming),
                                [*inputs, lengths, streaming])
            out += finish_chunks(self.pool, part, x1[:len(part)])
            self.pooled_chunks += len(part)
        return out

    def _replay(self, graphs: GraphCache, key: Hashable, inputs: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        """`graphs.run`; a graph that fails to capture turns that cache's graphs off (logged, kept in
        `graph_error`) and the call runs eagerly: the captured functions are idempotent, so nothing of a
        half-done capture remains in the slots."""
        if not graphs.enabled or key in graphs.graphs:
            return graphs.run(key, inputs)
        try:
            return graphs.run(key, inputs)
        except RuntimeError as e:
            self.graph_error = f"{key}: {e}"
            log.warning("CV3Token2WavRunner: CUDA graph capture failed (%s); running eagerly", self.graph_error)
            graphs.enabled = False
            self._sync()
            return graphs.fn(*inputs)

    def _graph_chunk(self, *inputs: torch.Tensor) -> tuple[torch.Tensor]:
        *args, lengths, streaming = inputs
        return (self.pool.chunk(*args, key_frames=lengths.shape[0], streaming=bool(streaming.shape[0])),)

    def _speed_mel(self, state: CV3Token2WavState, ids: torch.Tensor, call: ChunkCall) -> torch.Tensor:
        """The official speed change: non-streaming only; the mel is linearly resampled to ⌊F / speed⌋."""
        if call.token_offset != 0 or not call.finalize:
            raise ValueError("speed: a speed other than 1 needs a non-streaming request (official constraint)")
        s = state.stream
        mel = self.flow.inference(ids, s.prompt_token, s.prompt_feat, s.embedding, streaming=False, finalize=True)
        return F.interpolate(mel, size=int(mel.shape[2] / state.speed), mode="linear")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
