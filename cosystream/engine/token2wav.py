"""Token2WavRunner: owns the flow and HiFT; turns ready chunks of several requests into audio.

Per request it keeps the incremental flow state (only new frames are computed; models/flow_stream.py)
and the vocoder's continuity cache (8 mel frames, 3840 source and speech samples, Hamming cross-fade:
spec/streaming.md §3). A registered voice's encoded prompt is computed once and reused by every
request in that voice. Chunks that add the same number of frames are batched through the estimator,
and vocoder calls on equal-length mel are batched through HiFT.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from cosystream.config import EngineConfig
from cosystream.cuda_graphs import BATCH_BUCKETS, bucket, capture_stream
from cosystream.engine import runners, vocoder_fast
from cosystream.engine.chunking import ChunkPlan
from cosystream.engine.flow_passes import FinalPass
from cosystream.engine.flow_runner import FlowRunner, PooledStream
from cosystream.engine.graphs import REPLAY_ROWS, GraphCache, maybe_compile
from cosystream.engine.scheduler import PROMPT_PHASE_STREAMS
from cosystream.engine.stopwatch import Stopwatch
from cosystream.engine.upload_cache import is_upload_key
from cosystream.kernels import triton_usable
from cosystream.kernels import vocoder as vocoder_kernels
from cosystream.models.flow import UPSAMPLE
from cosystream.models.flow_stream import FlowStream, FlowStreamState, PromptCache, cache_bytes_per_frame
from cosystream.models.hift import MEL_CACHE_FRAMES, HiFTGenerator, crossfade, fade_window
from cosystream.transfers import ints_to_device, to_device, to_host

_FINGERPRINT = "model"  # which flow (dims and dtype) a stored prompt cache belongs to
_NOISE_SEED = 20250101
_NOISE_SAMPLES = 24000 * 20  # 20 s of noise rows, reused cyclically
# Recordings sent with requests whose prompt pass ran, remembered by key (`_keeps_cache`): four times the analyses
# the engine keeps (upload_cache.MAX_UPLOADS), so a recording sent again while its analysis is still held is known.
UPLOADS_REMEMBERED = 256
SourceOverride = Callable[[Any, int], "torch.Tensor | None"]


@dataclass
class Token2WavState:
    """One segment's token-to-wave stream."""

    flow: FlowStreamState | PooledStream
    key: Any  # opaque id for test hooks
    noise_offset: int = 0  # where this stream reads the shared source-noise table
    speed: float = 1.0
    chunk_index: int = 0
    mel_cache: torch.Tensor | None = None  # [80, 8]
    source_cache: torch.Tensor | None = None  # [1, 3840]
    wav_cache: torch.Tensor | None = None  # [3840]
    frames_done: int = 0
    # its official final pass, begun and not yet voiced: (pass, row); it may pause between Euler steps
    final: tuple[FinalPass, int] | None = None


class Token2WavRunner:
    def __init__(self, flow: Any, hift: HiFTGenerator, config: EngineConfig,
                 source_override: SourceOverride | None = None, max_voice_caches: int = 16) -> None:
        self.flow = flow
        self.hift = hift
        self.stream = FlowStream(flow, config.final_attention)
        self.final_attention = config.final_attention
        self.final_reads_slot = False  # the official final pass re-encodes every token: it reads no slot
        self.device = flow.input_embedding.weight.device
        # token-to-wave graphs may replay beside the LM's (overlap): captured on a stream of their own
        graph_stream = capture_stream(self.device)
        self.watch = Stopwatch(self.device)  # stage times of the batches the engine runs
        slots = _pool_slots(flow, config) if self.device.type == "cuda" else 0
        self.pool = (FlowRunner(flow, slots, config.flow_frames, config.cuda_graphs, config.compile,
                                config.fused_kernels, capture_stream=graph_stream, watch=self.watch,
                                l2_prefetch_mb=config.flow_l2_prefetch_mb)
                     if slots else None)
        if config.fused_kernels and triton_usable(self.device):
            vocoder_fast.accelerate(hift, vocoder_kernels)  # one launch per Snake instead of seven
        self.overlap = MEL_CACHE_FRAMES * hift.upsample_scale  # 3840 samples
        self.window = fade_window(self.overlap, self.device)
        self.source_override = source_override
        self.voice_caches: OrderedDict[str, PromptCache] = OrderedDict()
        # recordings sent with requests whose prompt pass has run once (keys only, most recent last)
        self.uploads_passed: OrderedDict[str, None] = OrderedDict()
        # Called (engine thread) with CPU tensors when a registered voice's prompt is encoded.
        self.on_new_voice_cache: Callable[[str, dict[str, torch.Tensor]], None] | None = None
        self.fingerprint = f"{flow.dims}|{flow.input_embedding.weight.dtype}"
        self.max_voice_caches = max_voice_caches
        # flow passes over new voices' prompts: calls, prompts encoded, most prompts in one call
        self.prompt_build_calls = self.prompts_built = self.largest_prompt_build = 0
        self.max_voice_cache_bytes = int(config.max_voice_cache_gb * 2**30)
        self.sync = self.device.type == "cuda"
        # The NSF source noise is read from one fixed table at a per-request offset, so a request's
        # audio does not depend on which requests share its batch (the reference draws fresh noise).
        gen = torch.Generator().manual_seed(_NOISE_SEED)
        self.noise_table = torch.randn(_NOISE_SAMPLES, hift.m_source.num_harmonics, generator=gen).to(self.device)
        # PERF: HiFT is launch-bound in eager mode; one graph per (batch bucket, mel length, cached?).
        vocode = maybe_compile(self.hift.inference, config.compile)
        self.hift_first = GraphCache(lambda mel, noise: vocode(mel, None, noise=noise), self.device,
                                     config.cuda_graphs, stream=graph_stream)
        self.hift_next = GraphCache(lambda mel, cache, noise: vocode(mel, cache, noise=noise),
                                    self.device, config.cuda_graphs, stream=graph_stream)

    # ------------------------------------------------------------------ per-voice and per-request state
    def open_streams(self, items: Sequence[dict[str, Any]]) -> list[Token2WavState | Exception]:
        """The streams a batch opens together, each item `start`'s keyword arguments. Voices at hand open from
        their encoded prompts. New voices that fit a slot open in free slots with the flow run over their
        prompts right there, those whose caches end at one chunk boundary in one batched prompt pass
        (FlowRunner.open_new_voices; on CUDA it runs beside the worker and each first chunk follows it step by
        step), and their caches are kept for the streams after them where they will serve (`_keeps_cache`); a
        voice new twice in the batch is built once. The rest open one by one (`start`). A stream that cannot
        open gets its exception instead."""
        out: list[Token2WavState | Exception | None] = [None] * len(items)
        builds: dict[Any, list[int]] = {}  # voice (its key, or the item's index without one) -> its items
        for i, item in enumerate(items):
            voice_key = item.get("voice_key")
            if voice_key is not None and voice_key in builds:
                builds[voice_key].append(i)
            elif self._at_hand(voice_key, item.get("stored")) or not self._builds_in_a_slot(item["inputs"]):
                out[i] = self._start_or_error(item)
            else:
                builds[voice_key if voice_key is not None else ("item", i)] = [i]
        for members in self._by_cache_boundary(items, builds):
            keep = [self._keeps_cache(items[m[0]].get("voice_key"), len(m)) for m in members]
            try:
                opened = self.pool.open_new_voices(self.stream, self._prompts_args([items[m[0]]["inputs"]
                                                                                    for m in members]), keep)
            except Exception:  # e.g. out of memory for the whole group: each opens (or fails) alone
                for m in members:
                    for i in m:
                        out[i] = self._start_or_error(items[i])
                continue
            self._count_builds(len(members))
            for m, (pooled, cache) in zip(members, opened, strict=True):
                out[m[0]] = self._state(pooled, items[m[0]])
                self._register(cache, items[m[0]].get("voice_key"), fresh=True)
                for i in m[1:]:
                    out[i] = self._start_or_error(items[i], cache)
        return [state for state in out if state is not None]

    def _keeps_cache(self, voice_key: str | None, streams: int) -> bool:
        """Keep a new voice's encoded prompt (0.6 GB on the device for a 6 s prompt) for later streams? A
        registered voice's, always (it is stored too); a recording sent with requests, when this batch opens
        more than one stream in it or its prompt pass ran once before (it is sent again); a voice without a
        key, never. A recording sent once (a caller's voice cloned for one call) would only fill the device
        with a cache nothing reads, its pass copying every step's keys into it."""
        if voice_key is None:
            return False
        if not is_upload_key(voice_key) or streams > 1:
            return True
        seen = voice_key in self.uploads_passed
        self.uploads_passed[voice_key] = None
        self.uploads_passed.move_to_end(voice_key)
        while len(self.uploads_passed) > UPLOADS_REMEMBERED:
            self.uploads_passed.popitem(last=False)
        return seen

    def _at_hand(self, voice_key: str | None, stored: dict[str, torch.Tensor] | None) -> bool:
        return (voice_key is not None and voice_key in self.voice_caches) or self._stored_matches(stored)

    def _builds_in_a_slot(self, inputs: Any) -> bool:
        """Would a new voice's prompt pass run in a slot (a pool, a free slot, a prompt that fits one)?"""
        tokens = int(inputs.flow_prompt_speech_tokens.shape[0])
        return self.pool is not None and bool(self.pool.free) and UPSAMPLE * tokens <= self.pool.max_frames

    def _by_cache_boundary(self, items: Sequence[dict[str, Any]], builds: dict[Any, list[int]]
                           ) -> list[list[list[int]]]:
        """New voices (each its items) in groups that one pool call can build: caches ending at one chunk
        boundary, at most the free slots (a voice's later items open from its cache, in slots of their own)."""
        groups: dict[int, list[list[int]]] = {}
        for members in builds.values():
            tokens = int(items[members[0]]["inputs"].flow_prompt_speech_tokens.shape[0])
            groups.setdefault(self.stream.prompt_cache_tokens(tokens), []).append(members)
        free = len(self.pool.free) if self.pool is not None else 0
        calls = []
        for voices in groups.values():
            for i in range(0, len(voices), max(free, 1)):
                calls.append(voices[i:i + max(free, 1)])
        return calls

    def finished_prompt_passes(self) -> list[tuple[int, float]]:
        """(voices, seconds) of each prompt pass of new voices done since the last call (the cost model's)."""
        return [] if self.pool is None else self.pool.finished_passes()

    def _count_builds(self, voices: int) -> None:
        self.prompt_build_calls += 1
        self.prompts_built += voices
        self.largest_prompt_build = max(self.largest_prompt_build, voices)

    def _start_or_error(self, item: dict[str, Any], prompt: PromptCache | None = None) -> Token2WavState | Exception:
        return runners.start_or_error(self, item, self.device, **({} if prompt is None else {"prompt": prompt}))

    def prompt_cache(self, inputs: Any, voice_key: str | None, stored: dict[str, torch.Tensor] | None = None
                     ) -> PromptCache:
        """A voice's encoded prompt: from memory, else from its stored record, else computed (once)."""
        cache = self._in_memory(voice_key)
        if cache is None:
            cache = self._from_store(stored)
            self._register(cache, voice_key, fresh=False)
        if cache is None:
            cache = self._build_prompt_cache(inputs)
            self._register(cache, voice_key, fresh=True)
        return cache

    def _register(self, cache: PromptCache | None, voice_key: str | None, fresh: bool) -> None:
        """Keep a voice's cache in memory (most recent last); a freshly built one of a registered voice is also
        handed to `on_new_voice_cache` (a request's own recording has no record to keep it in: its cache is not
        waited for nor copied to the host)."""
        if voice_key is None or cache is None:
            return
        if fresh and self.on_new_voice_cache is not None and not is_upload_key(voice_key):
            if cache.written is not None:  # its prompt pass still writes it on the prompt lane
                cache.written.synchronize()
            tensors = {k: v.to("cpu") for k, v in cache.to_tensors().items()}
            self.on_new_voice_cache(voice_key, {**tensors, **self._fingerprint_tensor()})
        self.voice_caches[voice_key] = cache
        self.voice_caches.move_to_end(voice_key)
        self._evict_voice_caches()

    def _in_memory(self, voice_key: str | None) -> PromptCache | None:
        """The voice's encoded prompt if memory holds it (marked as just used), else None."""
        if voice_key is None or voice_key not in self.voice_caches:
            return None
        self.voice_caches.move_to_end(voice_key)
        return self.voice_caches[voice_key]

    def _evict_voice_caches(self) -> None:
        """Least recently used first, recordings sent with requests before registered voices, down to
        max_voice_caches voices and max_voice_cache_bytes (the newest stays even alone over the bytes: its
        stream is opening). A 6 s prompt is ≈ 0.7 GB on the device for CosyVoice2-0.5B in bf16, a 16 s one
        ≈ 1.9 GB: a count alone let sixteen of those take ~30 GB. A flood of new recordings (each seen once)
        does not push out the registered voices' states."""
        def held() -> int:
            return sum(c.kv.numel() * c.kv.element_size() for c in self.voice_caches.values())

        while len(self.voice_caches) > 1 and (len(self.voice_caches) > self.max_voice_caches
                                              or held() > self.max_voice_cache_bytes):
            older = list(self.voice_caches)[:-1]
            victim = next((key for key in older if is_upload_key(key)), older[0])
            del self.voice_caches[victim]

    def _prompt_args(self, inputs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(prompt tokens [1, P], prompt mel [1, 2P, 80], x-vector [1, 192]) on the device."""
        return self._prompts_args([inputs])[0]

    def _prompts_args(self, inputs: Sequence[Any]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """`_prompt_args` of several voices, each kind of tensor sent to the device in one copy for all of them
        (views of it each). PERF: a wave of 15 new voices made 45 copies from pinned staging buffers."""
        tokens = [i.flow_prompt_speech_tokens for i in inputs]
        mels = [i.prompt_mel for i in inputs]
        lengths = [t.shape[0] for t in tokens]
        all_tokens = to_device(torch.cat(tokens), self.device).split(lengths)
        all_mels = to_device(torch.cat(mels), self.device).split([m.shape[0] for m in mels])
        xvectors = to_device(torch.stack([i.xvector for i in inputs]), self.device)
        return [(t[None], m[None], x[None]) for t, m, x in zip(all_tokens, all_mels, xvectors, strict=True)]

    def _build_prompt_cache(self, inputs: Any) -> PromptCache:
        """A voice's prompt through the flow: in a free pool slot (graphed) when there is one, else eagerly."""
        args = self._prompt_args(inputs)
        frames = UPSAMPLE * int(inputs.flow_prompt_speech_tokens.shape[0])
        if self.pool is not None and frames > self.pool.max_frames:
            # longer than a slot: its streams recompute every chunk (FlowRunner.recompute), no keys to keep
            return self.stream.empty_prompt(*args)
        self._count_builds(1)
        if self.pool is not None and self.pool.free:
            return self.pool.build_prompt_caches(self.stream, [args])[0]
        return self.stream.build_prompt_cache(*args)

    def _fingerprint_tensor(self) -> dict[str, torch.Tensor]:
        return {_FINGERPRINT: torch.tensor(list(self.fingerprint.encode()), dtype=torch.uint8)}

    def has_prompt(self, voice_key: str | None, stored: dict[str, torch.Tensor] | None = None) -> bool:
        """Is this voice's prompt state at hand (in memory, or a stored record of this very model), so that
        opening a stream in it needs no flow pass?"""
        return (voice_key is not None and voice_key in self.voice_caches) or self._stored_matches(stored)

    def _stored_matches(self, stored: dict[str, torch.Tensor] | None) -> bool:
        if not stored or _FINGERPRINT not in stored:
            return False
        return bytes(stored[_FINGERPRINT].tolist()).decode(errors="replace") == self.fingerprint

    def _from_store(self, stored: dict[str, torch.Tensor] | None) -> PromptCache | None:
        """The stored cache if it was made by this very model and dtype (else None: rebuild)."""
        if not self._stored_matches(stored):
            return None
        dtype = self.flow.input_embedding.weight.dtype
        return PromptCache.from_tensors({k: v.to(self.device, dtype if v.is_floating_point() else v.dtype)
                                         for k, v in stored.items() if k != _FINGERPRINT})

    def forget_voice(self, voice_key: str) -> None:
        self.voice_caches.pop(voice_key, None)

    def start(self, inputs: Any, voice_key: str | None, key: Any = None, speed: float = 1.0,
              max_target_tokens: int = 256, seed: int = 0, stored: dict | None = None,
              prompt: PromptCache | None = None) -> Token2WavState:
        """A new stream's state: in a free pool slot (its chunks past the slot recompute, so any prompt and
        length go there), else on the eager path with caches for `max_target_tokens` to begin with (what
        the stream needs from its start, core._start_tokens; they grow). `prompt`: the voice's encoded
        prompt when the caller has it (`open_streams`), else found or built here."""
        if prompt is None:
            prompt = self.prompt_cache(inputs, voice_key, stored)
        if self.pool is not None and self.pool.free:
            flow_state = self.pool.open(prompt if self.pool.holds(prompt) else self.stream.without_cache(prompt))
        else:
            flow_state = self.stream.start(prompt, max_target_tokens)
        return Token2WavState(flow_state, key=key, speed=speed, noise_offset=_noise_offset(seed))

    @staticmethod
    def _state(flow_state: PooledStream, item: dict[str, Any]) -> Token2WavState:
        return Token2WavState(flow_state, key=item.get("key"), speed=item.get("speed", 1.0),
                              noise_offset=_noise_offset(item.get("seed", 0)))

    def opened(self) -> None:
        """A batch that only opened streams: wait for its copies (this thread's stream only) so the stage
        times of the batch are known."""
        self._now()
        self.watch.settle()

    def release(self, state: Token2WavState) -> None:
        """Give a finished or abandoned stream's pool slot back."""
        if isinstance(state.flow, PooledStream) and self.pool is not None:
            self.pool.close(state.flow)

    # ------------------------------------------------------------------ chunks
    @torch.inference_mode()
    def run(self, jobs: Sequence[tuple[Token2WavState, list[int], ChunkPlan]],
            should_stop: Callable[[], bool] | None = None) -> list[tuple[np.ndarray, float, float]] | None:
        """Audio for each job (state, all tokens of the segment so far, plan): (pcm, flow_s, vocoder_s).

        should_stop: when every job is an official final pass in the pool (`pausable`), it is asked after
        each Euler step of their passes; True pauses them: None is returned, their progress stays on their
        states and a later run with these jobs goes on from there."""
        t0 = time.perf_counter()
        if should_stop is not None and self.pausable(jobs) and not self._step_finals(jobs, should_stop):
            return None
        mels = self._flow(jobs)
        t1 = self._now()
        wavs = self._vocode([(st, mel, plan.is_final) for (st, _, plan), mel in zip(jobs, mels, strict=True)])
        self.watch.lap("vocoder")
        host = to_host(wavs)
        self.watch.lap("to_host")
        self.watch.settle()
        t2 = time.perf_counter()
        return [(pcm, t1 - t0, t2 - t1) for pcm in host]

    def _wait_for_stream(self) -> None:
        """Wait for the work queued on this thread's CUDA stream (not the LM's)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _now(self) -> float:
        if self.sync:  # this thread's stream only: the LM runs on another one meanwhile
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def _flow(self, jobs: Sequence[tuple[Token2WavState, list[int], ChunkPlan]]) -> list[torch.Tensor]:
        """New target mel [80, F] per job; chunks adding equal frame counts share one batch."""
        mels: list[torch.Tensor | None] = [None] * len(jobs)
        groups: dict[tuple[bool, int, bool], list[tuple[int, tuple]]] = {}
        finals: list[tuple[int, Token2WavState, torch.Tensor, ChunkPlan]] = []
        recomputes: list[tuple[int, Token2WavState, torch.Tensor, ChunkPlan]] = []
        for i, (st, tokens, plan) in enumerate(jobs):
            ids = self._tokens(tokens[:plan.token_end])
            if plan.provisional and not self._outgrows_slot(st, self._window_tokens(st, plan)):
                self.watch.lap("flow_setup")
                mels[i] = self._provisional(st, ids, plan)
                self.watch.lap("provisional")
                continue
            if plan.provisional:  # a prompt longer than its slot: the chunk ends inside a block, no state kept
                recomputes.append((i, st, ids, plan))
                continue
            window = self.stream._window(st.flow, ids, finalize=plan.is_final)
            pooled = isinstance(st.flow, PooledStream)
            official_final = plan.is_final and self.final_attention == "full"  # needs no slot's keys
            if not official_final and self._outgrows_slot(st, window[0].shape[0]):
                recomputes.append((i, st, ids, plan))
            elif plan.is_final and window[0].shape[0] == 0 and self.final_attention == "chunk":
                mels[i] = torch.zeros(self.flow.dims.output_size, 0, device=self.device)
                st.flow.is_finished = True
                self.release(st)
            elif plan.is_final and self.final_attention == "full" and pooled:
                finals.append((i, st, ids, plan))
            elif plan.is_final and not pooled:
                self.watch.lap("flow_setup")
                mels[i] = self._finish_eager(st, ids, plan)
                self.watch.lap("eager_flow")
            else:
                groups.setdefault((pooled, window[0].shape[0], plan.is_final), []).append((i, window))
        self.watch.lap("flow_setup")
        if groups:
            self.watch.count(f"run_with_{len(groups)}_ode_groups")
        for (pooled, _, final), members in groups.items():
            states = [jobs[i][0] for i, _ in members]
            starts = [st.flow.num_frames for st in states]
            windows = [w for _, w in members]
            if pooled:
                out = self.pool.advance([st.flow for st in states], windows)
            else:
                out = [m[0] for m in self.stream._advance([st.flow for st in states], windows, streaming=True)]
                self.watch.lap("eager_flow")
            for (i, _), st, m, f0 in zip(members, states, out, starts, strict=True):
                mels[i] = m[:, self._emitted_from(st, jobs[i][2]) - f0:]
                if final:
                    st.flow.is_finished = True
                    self.release(st)
        self._finish_pooled(finals, mels)
        self._recompute(recomputes, mels)
        return mels  # type: ignore[return-value]

    def pausable(self, jobs: Sequence[tuple[Token2WavState, list[int], ChunkPlan]]) -> bool:
        """Whether every job is an official final pass of a pooled stream (run() may pause them)."""
        return self.pool is not None and self.final_attention == "full" and bool(jobs) and all(
            plan.is_final and isinstance(st.flow, PooledStream) for st, _, plan in jobs)

    def _step_finals(self, jobs: Sequence[tuple[Token2WavState, list[int], ChunkPlan]],
                     should_stop: Callable[[], bool]) -> bool:
        """PERF: the Euler steps of the jobs' final passes (begun, or going on from where they paused),
        asking should_stop after each; False: paused. A batch of them takes ≈ 270 ms for 16 streams on the
        H100; a first chunk that turns ready meanwhile waits for one step (≈ 1/10 of that), not all."""
        self._begin_finals([(st, self._tokens(tokens[:plan.token_end])) for st, tokens, plan in jobs
                            if st.final is None])  # a resumed run has nothing to begin
        passes = list({id(st.final[0]): st.final[0] for st, _, _ in jobs if st.final is not None}.values())
        for final in passes:
            while not final.done:
                self.pool.final_step(final)
                # PERF: a replay only queues the step; unless the host waits for it, all ten steps are queued
                # at once and a chunk that pauses the pass still runs after them on this stream, so the pause
                # would save that chunk nothing
                self._wait_for_stream()
                if should_stop() and not all(p.done for p in passes):
                    self.watch.lap("final_pass")
                    return False
        self.watch.lap("final_pass")
        return True

    def _begin_finals(self, items: Sequence[tuple[Token2WavState, torch.Tensor]]) -> None:
        """Begin the final passes of the streams that have none yet; each gives its slot back at once (the
        pass reads none), so a new stream may open in it while the pass runs or pauses."""
        new = [(st, ids) for st, ids in items if st.final is None]
        if not new:
            return
        for (st, _), begun in zip(new, self.pool.begin_finals([(st.flow.prompt, ids[0]) for st, ids in new]),
                                  strict=True):
            st.final = begun
            if begun is not None:
                self.release(st)

    def _finish_pooled(self, finals: list[tuple[int, Token2WavState, torch.Tensor, ChunkPlan]],
                       mels: list[torch.Tensor | None]) -> None:
        """Official final calls of pooled streams: streams of one padded length share a FinalPass (begun
        here or by a paused run), run to the end; one longer than the official noise table runs eagerly."""
        if not finals:
            return
        self._begin_finals([(st, ids) for _, st, ids, _ in finals])
        for i, st, ids, plan in finals:
            if st.final is None:
                mels[i] = self._finish_eager(st, ids, plan)
                self.watch.lap("eager_flow")
                continue
            final, row = st.final
            self.pool.finish_final(final)
            st.final = None
            st.flow.is_finished = True
            self.release(st)
            mels[i] = final.mel(row)[:, self._emitted_from(st, plan):]

    def flow_group(self, st: Token2WavState, plan: ChunkPlan) -> tuple[bool, int, bool] | None:
        """The key under which `_flow` would batch this chunk's ODE with others (chunks of equal keys share
        one call), or None for a chunk that runs on a path of its own (provisional, final, past its slot)."""
        if plan.provisional or plan.is_final:
            return None
        n = self._window_tokens(st, plan)
        if n <= 0 or self._outgrows_slot(st, n):
            return None
        return (isinstance(st.flow, PooledStream), n, False)

    def _emitted_from(self, st: Token2WavState, plan: ChunkPlan) -> int:
        """Absolute frame where this chunk's audio starts (frames before it were already voiced)."""
        return UPSAMPLE * (st.flow.prompt.prompt_tokens.shape[0] + plan.offset)

    def _provisional(self, st: Token2WavState, ids: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
        """A chunk that ends inside an attention block (a short first hop): computed like any chunk,
        then the stream's state is put back, so the next, block-aligned chunk recomputes these frames
        exactly and only their audio comes from here."""
        flow = st.flow
        p = flow.prompt.prompt_tokens
        all_ids = torch.cat([p, ids[0].to(p.device, torch.long)])
        end = all_ids.shape[0] - self.stream.lookahead
        window = (all_ids[flow.num_tokens:end], all_ids[end:])
        enc = flow.encoder
        saved = (enc.num_tokens, enc.lookahead_tail.clone(), enc.up_tail.clone())
        start = flow.num_frames
        if isinstance(flow, PooledStream):
            rows = slice(2 * flow.slot, 2 * flow.slot + 2)
            conv = self.pool.conv[:, rows].clone()
            mel = self.pool.advance([flow], [window])[0]
            self.pool.conv[:, rows] = conv
        else:
            conv = flow.conv.clone()
            mel = self.stream._advance([flow], [window], streaming=True)[0][0]
            flow.conv = conv
        enc.num_tokens, enc.lookahead_tail, enc.up_tail = saved
        return mel[:, self._emitted_from(st, plan) - start:]

    def _finish_eager(self, st: Token2WavState, ids: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
        if self.pool is not None and self.final_attention == "full":  # the pool's final pass is the official one
            mel = self.pool.full_pass(st.flow.prompt, ids[0])
            if mel is not None:
                st.flow.is_finished = True
                self.release(st)
                return mel[:, self._emitted_from(st, plan):]
        first_returned = max(UPSAMPLE * st.flow.prompt.prompt_tokens.shape[0], st.flow.num_frames)
        mel = self.stream.finish(st.flow, ids)[0]
        self.release(st)
        return mel[:, self._emitted_from(st, plan) - first_returned:]

    def _window_tokens(self, st: Token2WavState, plan: ChunkPlan) -> int:
        """New positions (prompt + target) this chunk's window adds to the stream's finished ones."""
        return self.stream.window_end(st.flow, plan.token_end, finalize=plan.is_final) - st.flow.num_tokens

    def _outgrows_slot(self, st: Token2WavState, new_tokens: int) -> bool:
        """Whether the chunk must recompute every frame: it would outgrow the stream's slot."""
        flow = st.flow
        return isinstance(flow, PooledStream) and UPSAMPLE * (flow.num_tokens + new_tokens) > self.pool.max_frames

    def _recompute(self, jobs: list[tuple[int, Token2WavState, torch.Tensor, ChunkPlan]],
                   mels: list[torch.Tensor | None]) -> None:
        """Chunks of pooled streams past their slots, computed as the official code computes every chunk
        (FlowRunner.recompute_many: streams of one padded length in one graph replay); such a stream keeps
        its slot (admission) but no longer reads its keys."""
        if not jobs:
            return
        full = self.pool.recompute_many([(st.flow.prompt, ids[0], plan.is_final) for _, st, ids, plan in jobs])
        for (i, st, _, plan), mel in zip(jobs, full, strict=True):
            if plan.is_final:
                st.flow.is_finished = True
                self.release(st)
            mels[i] = mel[:, self._emitted_from(st, plan):]

    def _tokens(self, tokens: list[int]) -> torch.Tensor:
        return ints_to_device(tokens, self.device).unsqueeze(0)

    def _vocode(self, items: list[tuple[Token2WavState, torch.Tensor, bool]]) -> list[torch.Tensor]:
        """Continuity-cached HiFT per job; calls with equal mel length run as one batch (REPLAY_ROWS at most)."""
        inputs = [self._vocoder_input(st, mel) for st, mel, _ in items]
        out: list[torch.Tensor | None] = [None] * len(items)
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, mel in enumerate(inputs):
            st, new_mel, final = items[i]
            if self._defers(st, mel, final):
                out[i] = self._defer(st, mel, new_mel.shape[-1])
                continue
            groups.setdefault((mel.shape[-1], st.source_cache is None), []).append(i)
        for members in groups.values():
            for part in range(0, len(members), REPLAY_ROWS):
                idx = members[part:part + REPLAY_ROWS]
                wavs, sources = self._hift_batch([items[i][0] for i in idx], [inputs[i] for i in idx])
                for j, i in enumerate(idx):
                    st, _, final = items[i]
                    out[i] = self._continue(st, inputs[i], wavs[j], sources[j], final)
        return out  # type: ignore[return-value]

    @staticmethod
    def _defers(st: Token2WavState, mel: torch.Tensor, final: bool) -> bool:
        """Is this a stream's first vocoder input, not its last, and shorter than the overlap it must withhold
        (MEL_CACHE_FRAMES: a first chunk of fewer than 4 tokens)? Cross-fading needs a whole overlap's tail."""
        return not final and st.source_cache is None and mel.shape[-1] < MEL_CACHE_FRAMES

    def _defer(self, st: Token2WavState, mel: torch.Tensor, new_frames: int) -> torch.Tensor:
        """Keep a too-short first vocoder input for the next call, which vocodes it with its own frames as the
        stream's first call (the same audio as one longer first chunk); this chunk's audio is empty."""
        st.mel_cache = mel
        st.frames_done += new_frames  # _noise counts the kept frames from the stream's start
        return torch.zeros(0, device=mel.device, dtype=torch.float32)

    def _vocoder_input(self, st: Token2WavState, mel: torch.Tensor) -> torch.Tensor:
        mel = mel.to(self.hift.conv_pre.weight.dtype)
        if st.speed != 1.0:  # offline only: time-stretch the mel (spec/hift.md §6)
            # at least one frame: a very short utterance at high speed would otherwise shrink to none
            mel = F.interpolate(mel[None], size=max(1, int(mel.shape[-1] / st.speed)), mode="linear")[0]
        return mel if st.mel_cache is None else torch.cat([st.mel_cache, mel], dim=-1)

    def _hift_batch(self, states: list[Token2WavState], mels: list[torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        mel = torch.stack(mels)
        overrides = [self.source_override(st.key, st.chunk_index) if self.source_override else None
                     for st in states]
        if all(o is not None for o in overrides):
            source = torch.stack([o.to(self.device).reshape(1, -1) for o in overrides])
            return self.hift.decode(mel, source), source
        noise = torch.stack([self._noise(st, mel.shape[-1]) for st in states])
        rows = len(states)
        padded = bucket(rows)
        mel, noise = _pad_rows(mel, padded), _pad_rows(noise, padded)
        if states[0].source_cache is None:
            wav, source = self.hift_first.run((padded, mel.shape[-1]), [mel, noise])
        else:
            cache = _pad_rows(torch.stack([st.source_cache for st in states]), padded)
            wav, source = self.hift_next.run((padded, mel.shape[-1]), [mel, cache, noise])
        # graph outputs are reused by the next replay: keep copies
        return wav[:rows].clone(), source[:rows].clone()

    def _noise(self, st: Token2WavState, num_frames: int) -> torch.Tensor:
        """Noise rows for this call's samples, indexed by the stream's absolute sample position."""
        first_frame = st.frames_done - (0 if st.mel_cache is None else st.mel_cache.shape[-1])
        start = st.noise_offset + first_frame * self.hift.upsample_scale
        idx = torch.arange(start, start + num_frames * self.hift.upsample_scale, device=self.device)
        return self.noise_table[idx % _NOISE_SAMPLES]

    def _continue(self, st: Token2WavState, mel: torch.Tensor, wav: torch.Tensor, source: torch.Tensor,
                  final: bool) -> torch.Tensor:
        """Cross-fade with the previous chunk's tail and keep this chunk's tail (spec/streaming.md §3)."""
        if st.wav_cache is not None:
            wav = crossfade(wav[None], st.wav_cache[None], self.window)[0]
        st.chunk_index += 1
        st.frames_done += mel.shape[-1] - (0 if st.mel_cache is None else st.mel_cache.shape[-1])
        if final:
            st.mel_cache = st.source_cache = st.wav_cache = None
            return wav
        st.mel_cache = mel[:, -MEL_CACHE_FRAMES:]
        st.source_cache = source[:, -self.overlap:]
        st.wav_cache = wav[-self.overlap:]
        return wav[:-self.overlap]

    def can_start(self, inputs: Any, max_target_tokens: int) -> bool:
        """False while a new stream must wait for a free pool slot. With a pool every stream runs in one,
        never on the eager path (an order of magnitude slower, with its own ≈ 2.3 MB per frame of
        keys/values outside the pool; streams sent there ran the GPU out of memory). The slots are the
        engine's admission control."""
        return self.pool is None or bool(self.pool.free)

    def needs_slot(self, inputs: Any, max_target_tokens: int) -> bool:
        """True when a new stream runs in a pool slot (so must wait for one): whenever there is a pool."""
        return self.pool is not None

    def free_slots(self) -> int | None:
        """Free pool slots (None: no pool)."""
        return None if self.pool is None else len(self.pool.free)

    def flow_slots(self) -> int | None:
        """The pool's slots, free or held (None: no pool)."""
        return None if self.pool is None else self.pool.num_slots

    def slot_gauges(self) -> dict[str, float]:
        """Flow-slot gauges for /metrics (none without a pool)."""
        prompts = {"flow_prompt_build_calls": float(self.prompt_build_calls),
                   "flow_prompts_built": float(self.prompts_built),
                   "flow_prompt_build_largest": float(self.largest_prompt_build)}
        if self.pool is None:
            return prompts
        return {"flow_slots_free": float(len(self.pool.free)), **prompts}

    @torch.inference_mode()
    def warmup(self, prompt_tokens: int = 150, target_tokens: int = 250, schedule=None) -> int:
        """Capture the flow and HiFT graphs a steady stream of requests with this prompt and length
        will use, for every batch bucket up to the pool size (official final passes and their vocoder
        calls: up to REPLAY_ROWS); returns the number of graphs."""
        if self.pool is None or not self.pool.graphs.enabled:
            return 0
        from cosystream.config import ChunkSchedule
        from cosystream.engine.chunking import ChunkPlanner

        planner = ChunkPlanner(schedule or ChunkSchedule(), prompt_tokens)
        frame = UPSAMPLE * self.stream.prompt_cache_tokens(prompt_tokens)
        shapes, encoder_shapes, mel_lengths, cached = [], [], [], False
        official_final = self.final_attention == "full"
        while (plan := planner.next_plan(target_tokens, done=True)) is not None:
            end = UPSAMPLE * (prompt_tokens + plan.offset + plan.num_new)
            if not plan.is_final or not official_final:
                shapes.append((end - frame, self.pool.attn_len_for(end)))
                encoder_shapes.append((frame // UPSAMPLE, (end - frame) // UPSAMPLE, not plan.is_final))
            # (mel frames, cached?, bounded by the slots?)
            mel_lengths.append((2 * plan.num_new + (MEL_CACHE_FRAMES if cached else 0), cached,
                                not (plan.is_final and official_final)))
            frame, cached = end, True
        batches = [b for b in BATCH_BUCKETS if b <= bucket(len(self.pool.free))]
        boundary = self.stream.prompt_cache_tokens(prompt_tokens)
        # new voices' prompt passes (open_streams): the encoder from token 0 and the ODE over the cached frames,
        # in the batches a phase of them fills
        prompt_batches = [b for b in batches if b <= bucket(PROMPT_PHASE_STREAMS)] if boundary > 0 else []
        # their first chunks, which follow the passes step by step, alone or with later chunks of the first
        # chunk's length riding along (those attend further)
        first_chunks = {shape for shape in shapes if shape[0] == shapes[0][0]} if shapes else set()
        for b in prompt_batches:
            self.pool.capture_prompt_pass(b, boundary)
            for num_new, attn_len in first_chunks:
                self.pool.capture_steps(b, num_new, attn_len)
        # official final passes wait without a slot: up to REPLAY_ROWS of them share a replay, however few slots
        unbounded = [b for b in BATCH_BUCKETS if b <= REPLAY_ROWS]
        for b in batches:
            for num_new, attn_len in shapes:
                self.pool.capture(b, num_new, attn_len)
            for start, n, has_context in encoder_shapes:
                self.pool.capture_encoder(b, start, n, has_context)
        for b in unbounded if official_final else []:
            self.pool.capture_full(UPSAMPLE * (prompt_tokens + target_tokens), b)
        for frames, has_cache, by_slots in mel_lengths:
            for b in (batches if by_slots else unbounded):
                if b <= REPLAY_ROWS:  # larger vocoder batches are split (_vocode)
                    self._capture_hift(b, frames, has_cache)
        pool = self.pool
        lane = [pool.lane.encoder_graphs, pool.lane.step_graphs] if pool.lane is not None else []
        return sum(len(cache.graphs) for cache in (pool.graphs, pool.final_encoder_graphs, pool.final_step_graphs,
                                                    pool.encoder_graphs, pool.recompute_graphs, pool.step_graphs,
                                                    *lane, self.hift_first, self.hift_next))

    def _capture_hift(self, batch: int, frames: int, has_cache: bool) -> None:
        mel = torch.zeros(batch, self.hift.conv_pre.weight.shape[1], frames, device=self.device,
                          dtype=self.hift.conv_pre.weight.dtype)
        noise = torch.zeros(batch, frames * self.hift.upsample_scale, self.hift.m_source.num_harmonics,
                            device=self.device)
        if has_cache:
            self.hift_next.run((batch, frames), [mel, torch.zeros(batch, 1, self.overlap, device=self.device), noise])
        else:
            self.hift_first.run((batch, frames), [mel, noise])


def _noise_offset(seed: int) -> int:
    """Where a stream's vocoder noise starts in the table (its seed's)."""
    return (seed * 2654435761) % _NOISE_SAMPLES


def _pool_slots(flow: Any, config: EngineConfig, share: float = 0.7) -> int:
    """Flow-pool slots: the configured number, or what `share` of the free GPU memory holds."""
    if config.flow_slots is not None:
        return config.flow_slots
    free_bytes, _ = torch.cuda.mem_get_info(flow.input_embedding.weight.device)
    per_slot = cache_bytes_per_frame(flow.dims, flow.input_embedding.weight.dtype) * config.flow_frames
    return max(1, min(64, int(share * free_bytes // per_slot) - 1))  # one slot is the scratch slot


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows appended up to `rows` (a batch bucket); rows are independent in every model here."""
    if x.shape[0] >= rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])
