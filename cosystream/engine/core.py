"""EngineCore: the one thread that owns the GPU. Requests in through a queue, audio chunks out.

Each loop iteration: take new messages (blocking only when idle: no polling), admit waiting
segments into free LM slots (prefill), run one batched decode step for every decoding stream, then
run the token-to-wave chunks that became ready, first chunks of new requests ahead of later chunks
of older ones, several requests per batch (spec/streaming.md §2 for the schedule).

Over the 400-line budget on purpose: the text-streaming (bistream) methods drive an LM row directly and
share the admission and token bookkeeping, so they stay beside them rather than in a mixin.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from cosystream.engine import faults
from cosystream.engine.bistream import BistreamState, Feed
from cosystream.engine.lm_runner import LMRunner, RowSampling
from cosystream.engine.request import LMStatus, RequestState, Segment
from cosystream.errors import EngineDead
from cosystream.outputs import AudioChunk

log = logging.getLogger("cosystream.engine")
_NEVER = 1 << 40  # a min_len that is never reached


@dataclass
class _Message:
    kind: str  # "add" | "abort" | "text" | "text_end" | "call" | "chunks_done" | "stop"
    payload: Any = None


class EngineCore:
    def __init__(self, lm_runner: LMRunner, token2wav: Any, lm: Any, max_chunk_batch: int = 64,
                 overlap: bool = True) -> None:
        self.lm_runner = lm_runner
        self.t2w = token2wav
        self.lm = lm
        self.max_chunk_batch = max_chunk_batch
        self.inbox: queue.Queue[_Message] = queue.Queue()
        self.requests: dict[str, RequestState] = {}
        self.waiting: deque[RequestState] = deque()  # requests whose LM segment needs a slot
        self.free_slots = list(range(lm_runner.max_slots))
        self.slot_owner: dict[int, RequestState] = {}
        self.num_steps = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="cosystream-engine", daemon=True)
        # PERF: token-to-wave batches run on a second thread and CUDA stream, so LM decode steps go on
        # while a flow/HiFT batch computes. One batch is in flight at a time; the engine thread still
        # plans every batch (first chunks first) and owns every request's state.
        self._chunks: _ChunkWorker | None = _ChunkWorker(self) if overlap else None
        self._in_flight: list | None = None  # the jobs of the batch on the worker
        self._release_later: list[Any] = []  # t2w states of requests finished while their batch ran

    # ------------------------------------------------------------------ thread-safe API
    def start(self) -> None:
        self._thread.start()
        if self._chunks is not None:
            self._chunks.start()

    def stop(self) -> None:
        self.inbox.put(_Message("stop"))
        self._thread.join(timeout=30)
        if self._chunks is not None:
            self._chunks.stop()

    def submit(self, req: RequestState) -> None:
        self._check_alive()
        self.inbox.put(_Message("add", req))

    def abort(self, request_id: str) -> None:
        self.inbox.put(_Message("abort", request_id))

    def add_text(self, request_id: str, text_ids: list[int]) -> None:
        """Text streaming in: the next text ids of a bistream request."""
        self.inbox.put(_Message("text", (request_id, text_ids)))

    def end_text(self, request_id: str) -> None:
        self.inbox.put(_Message("text_end", request_id))

    def call(self, fn, *args, timeout_s: float = 600.0) -> Any:
        """Run fn(*args) on the engine thread (GPU jobs such as voice caches) and wait for it."""
        self._check_alive()
        done, box = threading.Event(), {}
        self.inbox.put(_Message("call", (fn, args, done, box)))
        while not done.wait(timeout=1.0):
            self._check_alive()
            timeout_s -= 1.0
            if timeout_s <= 0:
                raise EngineDead("engine did not answer in time")
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def _check_alive(self) -> None:
        if self.error is not None or not self._thread.is_alive():
            raise EngineDead(f"engine thread is not running ({self.error!r})")

    def stats(self) -> dict[str, float]:
        """Gauges for /metrics (read from any thread; approximate by design)."""
        out = {"num_active": float(len(self.requests)), "queue_depth": float(len(self.waiting)),
               "num_free_slots": float(len(self.free_slots)), "num_steps": float(self.num_steps),
               "alive": float(self.error is None and self._thread.is_alive())}
        device = self.lm_runner.device
        if device.type == "cuda":
            out["gpu_memory_allocated_bytes"] = float(torch.cuda.memory_allocated(device))
            out["gpu_memory_reserved_bytes"] = float(torch.cuda.memory_reserved(device))
            out["gpu_memory_total_bytes"] = float(torch.cuda.get_device_properties(device).total_memory)
        return out

    @property
    def num_active(self) -> int:
        return len(self.requests)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        try:
            torch.set_grad_enabled(False)
            while self._drain():
                self._guarded(self._admit, self._admitting)
                self._guarded(self._decode, self._decoding)
                self._guarded(self._token2wav, self._voicing)
        except BaseException as e:  # the engine is dead: tell every waiting client
            log.exception("engine loop failed")
            self.error = e
            for req in list(self.requests.values()):
                req.emit(EngineDead(f"engine failed: {e!r}"))

    def _guarded(self, step, affected) -> None:
        """Run one phase; if it fails, fail only the requests it was working on and go on serving."""
        try:
            step()
        except Exception as e:
            log.exception("engine step %s failed", step.__name__)
            faults.release_device_memory(e, self.lm_runner.device)
            for req in affected():
                self._fail(req, e)

    def _fail(self, req: RequestState, error: Exception) -> None:
        req.emit(faults.to_request_error(error))
        req.cancelled = True
        self._scrub(req)
        self._finish(req)

    def _scrub(self, req: RequestState) -> None:
        """A failed request's slots may hold NaN: zero them before another stream reuses them."""
        for seg in req.segments:
            if seg.slot >= 0:
                faults.scrub_lm_slot(self.lm_runner, seg.slot)
            if seg.t2w is not None:
                faults.scrub_flow_slot(self.t2w, seg.t2w)

    def _voicing(self) -> list[RequestState]:
        return [r for r in self.requests.values() if self._has_audio_work(r)]

    def _admitting(self) -> list[RequestState]:
        return [r for r in self.slot_owner.values() if r.lm_segment is not None and r.t_first_token is None]

    def _decoding(self) -> list[RequestState]:
        return list({id(r): r for r in self.slot_owner.values()}.values())

    def _busy(self) -> bool:
        """Is there work that needs no new message? (Rows parked for text are not work.)"""
        decoding = any(r.lm_segment is not None and r.lm_segment.lm_status == LMStatus.decoding
                       for r in self.slot_owner.values())
        admittable = bool(self.waiting) and bool(self.free_slots)
        if decoding or admittable:
            return True
        # while a batch is on the worker, its "chunks_done" message wakes the loop
        return self._in_flight is None and any(self._has_audio_work(r) for r in self.requests.values())

    def _drain(self) -> bool:
        """Handle every queued message; block for one only when there is nothing else to do."""
        block = not self._busy()
        while True:
            try:
                msg = self.inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if msg.kind == "stop":
                return False
            self._handle(msg)

    def _handle(self, msg: _Message) -> None:
        if msg.kind == "add":
            req: RequestState = msg.payload
            self.requests[req.request_id] = req
            self._queue_lm(req)
        elif msg.kind == "abort":
            req = self.requests.get(msg.payload)
            if req is not None:
                req.emit(faults.aborted())  # a reader that did not ask for the abort stops waiting
                req.cancelled = True
                self._finish(req)
        elif msg.kind == "call":
            fn, args, done, box = msg.payload
            try:
                box["result"] = fn(*args)
            except Exception as e:  # reported to the caller, the engine goes on
                box["error"] = e
            done.set()
        elif msg.kind == "text":
            self._on_text(*msg.payload)
        elif msg.kind == "text_end":
            self._on_text_end(msg.payload)
        elif msg.kind == "chunks_done":
            self._chunks_done(*msg.payload)

    # ------------------------------------------------------------------ LM side
    def _queue_lm(self, req: RequestState) -> None:
        seg = req.lm_segment
        while seg is not None and seg.skips_lm:  # vc: tokens are known already
            seg.tokens = seg.inputs.source_speech_tokens.tolist()
            seg.lm_status = LMStatus.done
            req.lm_index += 1
            seg = req.lm_segment
        if seg is not None and seg.lm_status == LMStatus.pending:
            self.waiting.append(req)

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            if req.cancelled or req.lm_segment is None:
                continue
            self.free_slots.sort()
            slot = self.free_slots.pop(0)  # lowest free slot keeps the decode bucket small
            try:
                self._prefill(req, req.lm_segment, slot)
            except Exception as e:  # this prompt failed (e.g. out of memory): fail it alone, admit the rest
                self._prefill_failed(req, slot, e)

    def _prefill_failed(self, req: RequestState, slot: int, error: Exception) -> None:
        log.exception("prefill of %s failed", req.request_id)
        faults.release_device_memory(error, self.lm_runner.device)
        if slot not in self.slot_owner and slot not in self.free_slots:
            self.free_slots.append(slot)  # it failed before the slot was recorded as taken
        self._fail(req, error)

    def _prefill(self, req: RequestState, seg: Segment, slot: int) -> None:
        t0 = time.perf_counter()
        if req.t_admit is None:
            req.t_admit = t0
            req.times.queue_s = t0 - req.t_submit - req.times.frontend_s
        seg.slot = slot
        self.slot_owner[slot] = req
        streaming_text = seg.text_stream
        # bistream: EOS stays masked while text streams in (the reference's ignore_eos=True)
        min_len = _NEVER if streaming_text else seg.min_len
        self.lm_runner.set_row_sampling(slot, replace(req.sampling, seed=req.sampling.seed + req.lm_index,
                                                      min_len=min_len))
        if streaming_text:
            seg.bistream = self._new_bistream(seg)
            self._bistream_advance(req, seg)
            return
        inp = seg.inputs
        embeds = self.lm.embed_prompt(inp.text_ids, inp.llm_prompt_speech_tokens, inp.prompt_text_ids)
        token = self.lm_runner.prefill(slot, embeds)
        seg.pos = embeds.shape[0]
        if req.lm_index == 0:
            req.times.llm_prefill_s = time.perf_counter() - t0
        self._set_decoding(seg, True)
        self._accept_token(req, seg, token)

    def _set_decoding(self, seg: Segment, decoding: bool) -> None:
        seg.lm_status = LMStatus.decoding if decoding else LMStatus.waiting_text
        self.lm_runner.set_active(seg.slot, decoding)

    def _decode(self) -> None:
        rows = [s for s, r in self.slot_owner.items()
                if r.lm_segment is not None and r.lm_segment.lm_status == LMStatus.decoding]
        if not rows:
            return
        max_pos = max(self.slot_owner[s].lm_segment.pos for s in rows)
        tokens = self.lm_runner.decode(max(rows) + 1, max_pos)
        self.num_steps += 1
        for slot in rows:
            req = self.slot_owner[slot]
            seg = req.lm_segment
            seg.pos += 1
            self._accept_token(req, seg, tokens[slot])

    def _accept_token(self, req: RequestState, seg: Segment, token: int) -> None:
        if token == faults.NON_FINITE_TOKEN:  # this row's logits held NaN/inf; the other rows are fine
            self._fail(req, faults.non_finite("speech LM"))
            return
        if req.t_first_token is None:
            req.t_first_token = time.perf_counter()
            req.times.first_token_s = req.t_first_token - (req.t_admit or req.t_submit)
        if seg.bistream is not None:
            self._accept_bistream_token(req, seg, token)
            return
        is_stop = token >= self.lm.dims.speech_token_size
        if not is_stop:
            seg.tokens.append(token)
        limit = req.force_tokens if req.force_tokens is not None else seg.max_len
        if is_stop or len(seg.tokens) >= limit or seg.pos >= self.lm_runner.max_len - 1:
            self._lm_done(req, seg)

    def _lm_done(self, req: RequestState, seg: Segment) -> None:
        seg.lm_status = LMStatus.done
        self._release_slot(seg)
        req.lm_index += 1
        self._queue_lm(req)

    def _release_slot(self, seg: Segment) -> None:
        if seg.slot >= 0:
            self.lm_runner.set_active(seg.slot, False)
            self.slot_owner.pop(seg.slot, None)
            self.free_slots.append(seg.slot)
            seg.slot = -1

    # ------------------------------------------------------------------ text streaming in (bistream)
    def _bistream_advance(self, req: RequestState, seg: Segment) -> None:
        """Feed the row whatever the text received so far allows (spec/llm.md §7)."""
        bs = seg.bistream
        feed = bs.next_feed()
        if feed == Feed.wait:
            self._set_decoding(seg, False)
        elif feed == Feed.decode:
            self._set_decoding(seg, True)
        elif feed == Feed.done:
            self._lm_done(req, seg)
        else:
            if bs.final_stage and req.force_tokens is None:
                self.lm_runner.set_min_len(seg.slot, 0)  # EOS allowed once the text has ended
            embeds = bs.take_pending()
            if seg.pos + embeds.shape[0] >= self.lm_runner.max_len - 1:
                self._lm_done(req, seg)
                return
            token = self.lm_runner.prefill(seg.slot, embeds, start_pos=seg.pos)
            seg.pos += embeds.shape[0]
            self._set_decoding(seg, True)
            self._accept_token(req, seg, token)

    def _new_bistream(self, seg: Segment) -> BistreamState:
        lm, inp = self.lm, seg.inputs
        dev = lm.llm_embedding.weight.device
        state = BistreamState(
            sos=lm.llm_embedding.weight[0], task_id=lm.llm_embedding.weight[1],
            prompt_text=lm.text_embedding(inp.prompt_text_ids.to(dev, torch.long)),
            prompt_speech=lm.speech_embedding(inp.llm_prompt_speech_tokens.to(dev, torch.long)),
            fill_token=lm.dims.fill_token, mix_ratio=lm.dims.mix_ratio)
        if seg.text_backlog:
            state.add_text(lm.text_embedding(torch.tensor(seg.text_backlog, device=dev)))
        if seg.text_closed:
            state.end_text()
        return state

    def _accept_bistream_token(self, req: RequestState, seg: Segment, token: int) -> None:
        bs = seg.bistream
        forced = bs.forced_token()
        if forced is not None and forced != token:
            token = forced
            self.lm_runner.override_last_token(seg.slot, token)
        is_stop = token >= self.lm.dims.speech_token_size
        if bs.on_token(token, is_stop):
            seg.tokens.append(token)
        forced_done = req.force_tokens is not None and len(seg.tokens) >= req.force_tokens
        if forced_done or seg.pos >= self.lm_runner.max_len - 1 or (bs.final_stage and is_stop):
            self._lm_done(req, seg)
        elif not bs.decoding:
            self._bistream_advance(req, seg)

    def _text_segment(self, request_id: str) -> tuple[RequestState | None, Segment | None]:
        req = self.requests.get(request_id)
        seg = req.lm_segment if req is not None and not req.cancelled else None
        return (req, seg) if seg is not None and seg.text_stream else (None, None)

    def _on_text(self, request_id: str, text_ids: list[int]) -> None:
        req, seg = self._text_segment(request_id)
        if seg is None:
            return
        if seg.bistream is None:  # not admitted yet
            seg.text_backlog.extend(text_ids)
            return
        dev = self.lm.text_embedding.weight.device
        seg.bistream.add_text(self.lm.text_embedding(torch.tensor(text_ids, device=dev, dtype=torch.long)))
        if seg.lm_status == LMStatus.waiting_text:
            self._bistream_advance(req, seg)

    def _on_text_end(self, request_id: str) -> None:
        req, seg = self._text_segment(request_id)
        if seg is None:
            return
        seg.text_closed = True
        if seg.bistream is None:
            return
        seg.bistream.end_text()
        if seg.lm_status == LMStatus.waiting_text:
            self._bistream_advance(req, seg)

    # ------------------------------------------------------------------ token -> wave
    def _has_audio_work(self, req: RequestState) -> bool:
        seg = req.audio_segment
        if seg is None or req.cancelled or not self._can_voice(req, seg):
            return False
        return seg.lm_status == LMStatus.done or len(seg.tokens) >= seg.planner.tokens_needed()

    def _can_voice(self, req: RequestState, seg: Segment) -> bool:
        """A segment that has not started its audio needs a flow slot first."""
        return seg.t2w is not None or self.t2w.can_start(seg.inputs, self._expected_tokens(req, seg))

    @staticmethod
    def _expected_tokens(req: RequestState, seg: Segment) -> int:
        return min(req.force_tokens or seg.max_len, 1024)

    def _token2wav(self) -> None:
        if self._in_flight is not None:
            return
        ready = []
        for req in self.requests.values():
            seg = req.audio_segment
            if seg is None or req.cancelled or not self._can_voice(req, seg):
                continue
            if seg.planner.has_plan(len(seg.tokens), seg.lm_status == LMStatus.done):
                ready.append((req, seg))
        if not ready:
            return
        ready.sort(key=lambda j: (not j[0].is_first_chunk, j[0].t_submit))  # first chunks first
        ready = self._within_free_slots(ready)
        if self._chunks is not None:
            ready = ready[:self.max_chunk_batch]  # the rest waits for the next batch, plans untouched
        jobs = [(req, seg, seg.planner.next_plan(len(seg.tokens), seg.lm_status == LMStatus.done))
                for req, seg in ready]
        if self._chunks is None:
            for start in range(0, len(jobs), self.max_chunk_batch):
                self._run_chunks(jobs[start:start + self.max_chunk_batch])
            return
        jobs = self._start_t2w(jobs)
        if jobs:
            self._in_flight = jobs
            self._chunks.submit(jobs)

    def _within_free_slots(self, ready: list) -> list:
        """Open no more new streams in one batch than there are free flow slots: each one beyond would fall
        to the eager path and its own multi-GB key/value cache (at 64 streams on the H100 that ran the GPU
        out of memory); the rest start in a later batch, oldest first."""
        free = self.t2w.free_slots()
        if free is None:
            return ready
        kept = []
        for req, seg in ready:
            if seg.t2w is None and self.t2w.needs_slot(seg.inputs, self._expected_tokens(req, seg)):
                if free == 0:
                    continue
                free -= 1
            kept.append((req, seg))
        return kept

    def _start_t2w(self, jobs: list) -> list:
        """The jobs whose token-to-wave stream is open (a request whose stream cannot open fails alone)."""
        return [job for job in jobs if self._start_audio(*job)]

    def _run_chunks(self, jobs: list) -> None:
        jobs = self._start_t2w(jobs)
        if not jobs:
            return
        try:
            results = self.t2w.run([(seg.t2w, seg.tokens, plan) for _, seg, plan in jobs])
        except Exception as e:
            self._chunks_done(jobs, None, e, time.perf_counter())
            return
        self._chunks_done(jobs, results, None, time.perf_counter())

    def _chunks_done(self, jobs: list, results: list | None, error: BaseException | None, now: float) -> None:
        """A batch came back (from the worker or inline): emit its audio, or fail its requests alone
        (the batch failed: its requests fail, the others never were in it)."""
        self._in_flight = None
        for state in self._release_later:
            self.t2w.release(state)
        self._release_later.clear()
        if error is not None:
            log.error("token-to-wave batch failed: %r", error)
            err = error if isinstance(error, Exception) else RuntimeError(repr(error))
            faults.release_device_memory(err, self.lm_runner.device)
            for req, _, _ in jobs:
                if req.request_id in self.requests:
                    self._fail(req, err)
            return
        for (req, seg, plan), (pcm, flow_s, vocoder_s) in zip(jobs, results, strict=True):
            if req.request_id not in self.requests or req.cancelled:
                continue
            if faults.is_finite_audio(pcm):  # the chunk is on the host already: checking it is cheap
                self._emit(req, seg, plan, pcm, flow_s, vocoder_s, now)
            else:
                self._fail(req, faults.non_finite("flow or vocoder"))

    def _start_audio(self, req: RequestState, seg: Segment, plan: Any) -> bool:
        """Open the segment's token-to-wave stream at its first chunk; False (request failed) if that fails."""
        if seg.t2w is not None:
            return True
        try:
            seg.t2w = self.t2w.start(seg.inputs, req.voice_key, key=(req.request_id, req.audio_index),
                                     speed=req.speed, max_target_tokens=self._expected_tokens(req, seg),
                                     seed=req.sampling.seed + req.audio_index, stored=req.voice_cache)
        except Exception as e:  # e.g. out of memory building the voice's prompt state
            log.exception("token-to-wave start of %s failed", req.request_id)
            faults.release_device_memory(e, self.lm_runner.device)
            self._fail(req, e)
            return False
        return True

    def _emit(self, req: RequestState, seg: Segment, plan, pcm: np.ndarray, flow_s: float, vocoder_s: float,
              now: float) -> None:
        t = req.times
        if req.is_first_chunk:
            t.first_chunk_flow_s, t.first_chunk_vocoder_s = flow_s, vocoder_s
            t.first_audio_s = now - req.t_submit
        t.audio_s += pcm.shape[0] / 24000
        last = plan.is_final and req.audio_index == len(req.segments) - 1
        if plan.is_final:
            t.num_tokens += len(seg.tokens)
            seg.t2w = None
            req.audio_index += 1
        if last:
            t.total_s = now - req.t_submit
        req.emit(AudioChunk(pcm=pcm, index=req.chunks_emitted, is_final=last, times=t if last else None,
                            request_id=req.request_id))
        req.chunks_emitted += 1
        if last:
            req.finished = True
            self._finish(req)

    def _finish(self, req: RequestState) -> None:
        busy = self._in_flight is not None and any(r is req for r, _, _ in self._in_flight)
        for seg in req.segments:
            self._release_slot(seg)
            if seg.t2w is not None:
                if busy:  # the worker is using it: give its flow slot back when the batch returns
                    self._release_later.append(seg.t2w)
                else:
                    self.t2w.release(seg.t2w)
            seg.t2w = None
        self.requests.pop(req.request_id, None)
        if req in self.waiting:
            self.waiting.remove(req)


class _ChunkWorker:
    """The token-to-wave thread: runs one batch at a time on its own CUDA stream and posts the result
    to the engine's inbox. It never touches request state (the engine thread does)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.jobs: queue.Queue[list | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="cosystream-token2wav", daemon=True)
        device = core.lm_runner.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def submit(self, jobs: list) -> None:
        self.jobs.put(jobs)

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while (jobs := self.jobs.get()) is not None:
            results, error = None, None
            try:
                results = self._compute(jobs)
            except BaseException as e:  # reported with the batch; the engine thread decides
                error = e
            self.core.inbox.put(_Message("chunks_done", (jobs, results, error, time.perf_counter())))

    def _compute(self, jobs: list) -> list:
        work = [(seg.t2w, seg.tokens[:], plan) for _, seg, plan in jobs]
        if self.stream is None:
            return self.core.t2w.run(work)
        # the batch may read what the engine thread just wrote on its stream (new voices' pool slots)
        self.stream.wait_stream(torch.cuda.default_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            return self.core.t2w.run(work)


__all__ = ["EngineCore", "RowSampling"]
