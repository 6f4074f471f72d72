"""New voices' prompt passes in the flow pool, and the prompt lane they run on.

A stream whose voice is not in memory (a recording seen for the first time) needs the flow run over its
prompt's frames before its first chunk: a prompt pass, one ODE over about 250 frames for a 6 s prompt (≈ 33 ms
alone on an H200). `NewVoices.open_new_voices` runs it right in the stream's own slot, the new voices of a batch
whose caches end at one chunk boundary in one call, and copies the voice's PromptCache out for the streams after
it. On CUDA the pass runs on the prompt lane, a CUDA stream of its own beside the token-to-wave worker, one graph
per Euler step with an event after each (`PromptPassEvents`); the stream's first chunk (`FlowRunner.advance`)
then runs its own ODE one graph per step, each step waiting only for the pass's same step, instead of waiting
for the whole pass as when the pass was a phase of the worker. Each step's keys and conv tails are copied into
the cache before that step's event, because the first chunk's same step overwrites the slot's conv tails.

`NewVoices` is a part of `FlowRunner` (engine/flow_runner.py): it uses the runner's pool, slots and ODE.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cosystream import cuda_graphs
from cosystream.engine.graphs import GraphCache
from cosystream.engine.pool_copy import copy_words
from cosystream.models.flow import UPSAMPLE
from cosystream.models.flow_stream import FlowStream, PromptCache, Window

if TYPE_CHECKING:
    from cosystream.engine.flow_runner import FlowRunner, PooledStream
    from cosystream.models.cfm import CausalConditionalCFM


@dataclass
class PromptPassEvents:
    """A new voice's prompt pass on the prompt lane (`FlowRunner.open_new_voices`), as CUDA events: its encoder
    step done, each Euler step done (the step's keys and conv tails in the slot and in the voice's cache), and
    the whole pass done."""

    started: torch.cuda.Event
    encoded: torch.cuda.Event
    steps: list[torch.cuda.Event]
    done: torch.cuda.Event


class PromptLane:
    """The CUDA stream new voices' prompt passes run on, beside the token-to-wave worker's, so that a first
    chunk follows its prompt pass step by step instead of waiting for all of it (`FlowRunner.advance`). Its
    graphs are its own, captured on a stream of its own: graphs that replay at the same time must not share
    cuBLAS workspaces or a memory pool (engine/graphs.py)."""

    def __init__(self, runner: FlowRunner, use_graphs: bool) -> None:
        device = runner.device
        self.stream = torch.cuda.Stream(device)
        captures = cuda_graphs.capture_stream(device)
        self.encoder_graphs = GraphCache(runner._encode_core, device, use_graphs, stream=captures)
        self.step_graphs = GraphCache(runner._ode_step, device, use_graphs, stream=captures)


class NewVoices:
    """The new voices' prompt passes of a `FlowRunner`."""

    # the runner's, set in FlowRunner.__init__
    cfm: CausalConditionalCFM
    device: torch.device
    kv: torch.Tensor
    conv: torch.Tensor
    free: list[int]
    lane: PromptLane | None
    _passes: list[tuple[int, float | PromptPassEvents]]
    # and its slots (open, close), chunks (advance: _ode_inputs, _ode_steps) and captures (capture,
    # capture_encoder, _capture_step, attn_len_for)

    @torch.inference_mode()
    def build_prompt_caches(self, stream: FlowStream,
                            prompts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[PromptCache]:
        """New voices' PromptCaches, their streams closed at once (`open_new_voices`, for voices registered
        ahead of any request): the caller may use them as soon as this returns."""
        opened = self.open_new_voices(stream, prompts)
        for pooled, _ in opened:
            self.close(pooled)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        caches = [cache for _, cache in opened]
        assert all(cache is not None for cache in caches)  # every voice's cache is kept by default
        return caches  # type: ignore[return-value]

    @torch.inference_mode()
    def open_new_voices(self, stream: FlowStream, prompts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                        keep: Sequence[bool] | None = None) -> list[tuple[PooledStream, PromptCache | None]]:
        """Open a stream for each new voice, with the flow run over its prompt's frames in its own slot (one
        batched pass for all), and the voice's PromptCache for later streams. prompts: (tokens [1, P], mel
        [1, 2P, 80], xvector [1, 192]) each; their token counts may differ as long as their caches end at one
        chunk boundary (`FlowStream.prompt_cache_tokens`: the tokens past it only give look-ahead). keep: per
        voice, whether to make its cache (default: every voice's); a voice not kept gets None, its stream the
        same pass without the copies of each step's keys (0.6 GB for a 6 s prompt) into a cache.

        On CUDA the pass runs on the prompt lane and this returns once it is queued: each stream's first chunk
        waits for it step by step (`advance`), a stream opened from the cache waits for all of it (`open`).
        PERF: the pass is one ODE over the prompt's frames (≈ 33 ms for a 6 s prompt alone on the H200), on the
        first chunk's path of every request in a voice not in memory; waited for whole, it held the first chunk
        back by that much."""
        empties = [stream.empty_prompt(*prompt) for prompt in prompts]
        boundaries = {stream.prompt_cache_tokens(empty.prompt_tokens.shape[0]) for empty in empties}
        if len(boundaries) != 1 or len(empties) > len(self.free):
            raise ValueError(f"prompts whose caches end at {sorted(boundaries)} tokens for {len(self.free)} free "
                             "slots: one length (one cache boundary), at most one prompt per free slot")
        boundary = boundaries.pop()
        keep = [True] * len(empties) if keep is None else list(keep)
        if len(keep) != len(empties):
            raise ValueError(f"keep: {len(keep)} flags for {len(empties)} prompts")
        pooled: list[PooledStream] = []
        try:
            for empty in empties:
                pooled.append(self.open(empty))
            caches = [self._cache_buffers(empty, boundary) if k else None for empty, k in zip(empties, keep,
                                                                                              strict=True)]
            kept = [(p, cache) for p, cache in zip(pooled, caches, strict=True) if cache is not None]
            if boundary > 0:
                ahead = boundary + stream.lookahead
                windows = [(e.prompt_tokens[:boundary], e.prompt_tokens[boundary:ahead]) for e in empties]
                if self.lane is None:
                    t0 = time.perf_counter()
                    self.advance(pooled, windows)
                    self._copy_into_caches(kept, range(self.cfm.num_steps))
                    self._passes.append((len(pooled), time.perf_counter() - t0))
                else:
                    self._prompt_pass_on_lane(pooled, windows, kept)
            else:
                self._copy_into_caches(kept, range(self.cfm.num_steps))
        except BaseException:
            for p in pooled:
                self.close(p)
            raise
        for p, cache in kept:
            p.prompt = cache  # the voice's, as for a stream opened from it (the same tokens, mel and speaker)
        return list(zip(pooled, caches, strict=True))

    def finished_passes(self) -> list[tuple[int, float]]:
        """(voices, seconds) of each prompt pass done since the last call, for the cost model: on the lane, its
        GPU time from start to end (a pass still running waits for a later call)."""
        done, pending = [], []
        for voices, took in self._passes:
            if isinstance(took, PromptPassEvents):
                if not took.done.query():
                    pending.append((voices, took))
                    continue
                took = took.started.elapsed_time(took.done) / 1e3
            done.append((voices, took))
        self._passes = pending
        return done

    def _cache_buffers(self, empty: PromptCache, boundary: int) -> PromptCache:
        """The voice's PromptCache to be filled for a prompt pass up to token `boundary` (on the worker's
        stream: the lane writes it, later streams read it there)."""
        frames = UPSAMPLE * boundary
        kv = self.kv.new_empty(*self.kv.shape[:3], 2, frames, self.kv.shape[-1])
        conv = self.conv.new_empty(self.conv.shape[0], 2, *self.conv.shape[2:])
        return PromptCache(empty.prompt_tokens, empty.prompt_mel, empty.spks, empty.encoder, kv, conv)

    def _copy_into_caches(self, kept: Sequence[tuple[PooledStream, PromptCache]], steps: Iterable[int]) -> None:
        """The streams' keys and conv tails of these Euler steps into their voices' caches (and, first time,
        their encoder states)."""
        for k in steps:
            for p, cache in kept:
                rows = slice(2 * p.slot, 2 * p.slot + 2)
                copy_words(cache.kv[k], self.kv[k, :, :, rows, :cache.kv.shape[-2]])
                cache.conv[k].copy_(self.conv[k, rows])
        for p, cache in kept:
            if cache.encoder.num_tokens != p.encoder.num_tokens:
                cache.encoder = p.encoder.trimmed()

    def _prompt_pass_on_lane(self, pooled: Sequence[PooledStream], windows: Sequence[Window],
                             kept: Sequence[tuple[PooledStream, PromptCache]]) -> None:
        """The prompt pass of `advance`, queued on the prompt lane step by step with an event after each
        (`PromptPassEvents`); each step's keys and conv tails are copied into the kept voices' caches before its
        event, so a first chunk that overwrites the slot's conv tails of that step comes after the copy."""
        assert self.lane is not None
        lane, worker = self.lane, torch.cuda.current_stream(self.device)
        events = PromptPassEvents(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                                  [torch.cuda.Event() for _ in range(self.cfm.num_steps)],
                                  torch.cuda.Event(enable_timing=True))
        lane.stream.wait_stream(worker)  # the slots' openings, and whatever last used these slots
        self._passes.append((len(pooled), events))
        for _, cache in kept:  # written on the lane, freed (evicted) by the worker's side: keep the lane's use
            for t in (cache.kv, cache.conv):
                t.record_stream(lane.stream)
        with torch.cuda.stream(lane.stream):
            events.started.record()
            inputs = self._ode_inputs(pooled, windows, lane.encoder_graphs, on_lane=True)
            for p in pooled:  # the encoder's new tails: made here, read by the first chunk's encoder there
                p.encoder.lookahead_tail.record_stream(worker)
                p.encoder.up_tail.record_stream(worker)
            for p, cache in kept:
                cache.encoder = p.encoder.trimmed()
                for t in (cache.encoder.kv_tokens, cache.encoder.kv_frames, cache.encoder.lookahead_tail,
                          cache.encoder.up_tail):
                    t.record_stream(worker)  # made here, read there by streams that open from the cache
            events.encoded.record()
            for k, _ in enumerate(self._ode_steps(inputs, lane.step_graphs)):
                self._copy_into_caches(kept, [k])
                events.steps[k].record()
            events.done.record()
        for p in pooled:
            p.building = events
        for _, cache in kept:
            cache.written = events.done

    def capture_prompt_pass(self, batch: int, boundary: int) -> None:
        """Capture the prompt pass of `batch` new voices whose caches end at token `boundary`: its encoder
        step and each Euler step, in the prompt lane's graphs (warm-up; the worker's own without a lane)."""
        frames = UPSAMPLE * boundary
        if self.lane is None:
            self.capture(batch, frames, self.attn_len_for(frames))
            self.capture_encoder(batch, 0, boundary, True)
            return
        self.capture_encoder(batch, 0, boundary, True, self.lane.encoder_graphs)
        for k in range(self.cfm.num_steps):
            self._capture_step(self.lane.step_graphs, (batch, frames, self.attn_len_for(frames)), k)
