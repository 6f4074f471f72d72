"""EngineCore: the one thread that owns the GPU. Requests in through a queue, audio chunks out.

Each loop iteration: take new messages (blocking only when idle: no polling), admit waiting
segments into free LM slots (prefill), launch one batched decode step for every decoding stream and
read the previous step's tokens (one step in flight: the GPU works while the host reads), then
run the token-to-wave chunks that became ready, first chunks of new requests ahead of later chunks
of older ones, several requests per batch (spec/streaming.md §2 for the schedule).

Over the 400-line budget on purpose: the text-streaming (bistream) methods drive an LM row directly and
share the admission and token bookkeeping, so they stay beside them rather than in a mixin.
"""

from __future__ import annotations

import logging
import math
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

import numpy as np
import torch

from cosystream.engine import faults
from cosystream.engine.bistream import BistreamState, Feed
from cosystream.engine.lm_runner import LMRunner, RowSampling, StepTicket
from cosystream.engine.request import LMStatus, RequestState, Segment
from cosystream.errors import EngineDead
from cosystream.outputs import AudioChunk

log = logging.getLogger("cosystream.engine")
_NEVER = 1 << 40  # a min_len that is never reached


@dataclass
class _Job:
    """One chunk of one request in a token-to-wave batch."""

    req: RequestState
    seg: Segment
    plan: Any  # None: the job only opens the segment's stream (EngineCore._open_ahead)
    open_args: dict | None = None  # the segment's stream opens with this chunk (on whoever runs the batch)
    state: Any = None  # the segment's token-to-wave stream
    error: Exception | None = None  # this job alone failed (e.g. its stream could not open)
    first: bool = False  # the request's first chunk (snapshot when planned: the worker reads no request state)
    # an official final pass with pause_final_passes: its phase may pause between Euler steps, for a first
    # chunk or a client about to run dry; when `due` (_due_finals) only for the latter (snapshots when the
    # batch is submitted)
    pausable: bool = False
    due: bool = False


@dataclass
class _Step:
    """A launched decode step: the rows it ran, as (slot, request, segment) when launched."""

    rows: list[tuple[int, RequestState, Segment]]
    ticket: StepTicket
    ahead: bool = False  # launched while the step before it was still in flight (decoding went on)


@dataclass
class _Message:
    kind: str  # "add" | "abort" | "text" | "text_end" | "call" | "chunks_done" | "stop"
    payload: Any = None


def _holds_cuda_tensors(msg: _Message) -> bool:
    """Does a message from another thread carry CUDA tensors (a request's inputs, a call's arguments)?"""
    if msg.kind == "add":
        return any(_holds_cuda(seg.inputs) for seg in msg.payload.segments) or _holds_cuda(msg.payload.voice_cache)
    if msg.kind == "call":
        return _holds_cuda(msg.payload[1])
    return False


def _holds_cuda(obj: Any, depth: int = 3) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.is_cuda
    if depth == 0 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return False
    if isinstance(obj, dict):
        return any(_holds_cuda(v, depth - 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_cuda(v, depth - 1) for v in obj)
    if is_dataclass(obj) and not isinstance(obj, type):
        return any(_holds_cuda(getattr(obj, f.name), depth - 1) for f in fields(obj))
    return False


class EngineCore:
    def __init__(self, lm_runner: LMRunner, token2wav: Any, lm: Any, max_chunk_batch: int = 64,
                 overlap: bool = True, chunk_slack_s: float = 0.0, first_chunk_wait_s: float = 0.0,
                 preempt: bool = True, rider_streams: int = 16, open_ahead: bool = True,
                 pause_final_passes: bool = False, final_slack_s: float = 0.0,
                 later_chunk_hold_s: float = 0.0, final_phase_streams: int = 0,
                 pause_decode_for_first_chunks: bool = True) -> None:
        self.lm_runner = lm_runner
        self.t2w = token2wav
        self.lm = lm
        self.max_chunk_batch = max_chunk_batch
        self.chunk_slack_s = chunk_slack_s
        self.first_chunk_wait_s = first_chunk_wait_s
        self.later_chunk_hold_s = later_chunk_hold_s
        self.final_phase_streams = final_phase_streams
        self.preempt = preempt
        self.pause_final_passes = preempt and pause_final_passes
        self.final_slack_s = final_slack_s if self.pause_final_passes else 0.0
        self.rider_streams = rider_streams
        self.open_ahead = open_ahead
        self.pause_decode_for_first_chunks = pause_decode_for_first_chunks
        self._step_s: float | None = None  # decode step period (moving average), for first-chunk waits
        # decode step periods (seconds, steps) by the worker's phase meanwhile (_ChunkWorker.running)
        self.step_beside: dict[str, tuple[float, int]] = {}
        self.slow_steps_beside: dict[str, tuple[float, int]] = {}  # ... of 20 ms or more
        # where the engine thread's time went in those slow steps: waiting for the step on the GPU ("gpu"),
        # waiting for messages ("inbox"; "drain": deciding whether to), handling each kind, admitting,
        # prefilling, launching the step, taking its tokens, planning token-to-wave ("voicing")
        self.slow_step_parts: dict[str, float] = {}
        self._parts_since_read: dict[str, float] = {}
        self._lap_mark = time.perf_counter()
        self._last_read_t: float | None = None
        self.inbox: queue.Queue[_Message] = queue.Queue()
        self.requests: dict[str, RequestState] = {}
        self.waiting: deque[RequestState] = deque()  # requests whose LM segment needs a slot
        self.free_slots = list(range(lm_runner.max_slots))
        self.slot_owner: dict[int, RequestState] = {}
        self.num_steps = 0
        # where the GPU owner's time goes (cumulative seconds; /metrics and benchmarks/bench_engine.py)
        self.lm_busy_s = 0.0  # admitting (prefill) and decode steps, on the engine thread
        self.t2w_busy_s = 0.0  # token-to-wave batches, on the worker (or inline)
        self.t2w_flow_s = 0.0  # of which the flow (encoder + ODE) ...
        self.t2w_vocoder_s = 0.0  # ... and HiFT with the copy to the host
        self.t2w_batches = 0
        self.t2w_final_s = 0.0  # ... of which phases of official final passes (paused ones included)
        self.t2w_finals = 0
        # ... of which phases with a due pass (they pause only for a client about to run dry: a first chunk
        # that becomes ready meanwhile waits for the whole phase)
        self.t2w_due_final_s = 0.0
        self.t2w_due_final_phases = 0
        self.t2w_chunks = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="cosystream-engine", daemon=True)
        device = lm_runner.device
        # PERF: with the overlap on, LM steps run on a high-priority stream, so a decode step's small
        # kernels are scheduled ahead of a flow batch's when both wait for the SMs.
        self.gpu_stream = (torch.cuda.Stream(device, priority=-1) if overlap and device.type == "cuda"
                           else None)
        # PERF: token-to-wave batches run on a second thread and CUDA stream, so LM decode steps go on
        # while a flow/HiFT batch computes. One batch is in flight at a time; the engine thread still
        # plans every batch (first chunks first) and owns every request's state.
        self._chunks: _ChunkWorker | None = _ChunkWorker(self) if overlap else None
        self._in_flight: list[_Job] | None = None  # the jobs of the batch on the worker
        self._first_in_flight: set[int] = set()  # ids of requests whose first chunk is on the worker
        # Token-to-wave work the engine thread must not do while a batch runs on the worker (its graphs
        # and pool would be used from two threads at once): done when the batch comes back.
        self._after_batch: list[Any] = []  # callables
        self._deferred_calls: list[_Message] = []
        # planned jobs of a batch the worker handed back before running them (preempted): the next batch
        # voices them, in their phase order, with the urgent chunks that preempted them
        self._returned: list[_Job] = []
        self._step_ahead: _Step | None = None  # a launched decode step whose tokens are not read yet
        # worker seconds of phases of official final passes and passes finished in them (decayed sums):
        # the measured cost of one pass, for the deadline test of the passes that wait (_due_finals)
        self._final_busy_s = 0.0
        self._finals_done = 0.0

    # ------------------------------------------------------------------ thread-safe API
    def start(self) -> None:
        if self._chunks is not None and self.gpu_stream is not None:
            # PERF: two Python threads feed the GPU; a thread waiting for the GIL held by the other's
            # bookkeeping waits up to the switch interval (5 ms by default, five decode steps)
            sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
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

    def capture_prefill(self) -> int:
        """Warm-up (run it through `call`): the batched prefill graphs, captured in a free LM row."""
        return self.lm_runner.capture_prefill(max(self.free_slots)) if self.free_slots else 0

    def _check_alive(self) -> None:
        if self.error is not None or not self._thread.is_alive():
            raise EngineDead(f"engine thread is not running ({self.error!r})")

    def stats(self) -> dict[str, float]:
        """Gauges for /metrics (read from any thread; approximate by design)."""
        out = {"num_active": float(len(self.requests)), "queue_depth": float(len(self.waiting)),
               "num_free_slots": float(len(self.free_slots)), "num_steps": float(self.num_steps),
               "alive": float(self.error is None and self._thread.is_alive()),
               "lm_busy_seconds": self.lm_busy_s, "token2wav_busy_seconds": self.t2w_busy_s,
               "token2wav_flow_seconds": self.t2w_flow_s, "token2wav_vocoder_seconds": self.t2w_vocoder_s,
               "token2wav_batches": float(self.t2w_batches), "token2wav_chunks": float(self.t2w_chunks),
               "token2wav_final_seconds": self.t2w_final_s, "token2wav_finals": float(self.t2w_finals),
               "token2wav_due_final_seconds": self.t2w_due_final_s,
               "token2wav_due_final_phases": float(self.t2w_due_final_phases)}
        for name, table in (("decode_step", self.step_beside), ("decode_slow_step", self.slow_steps_beside)):
            for beside, (total, count) in list(table.items()):
                out[f"{name}_seconds_beside_{beside}"] = total
                out[f"{name}s_beside_{beside}"] = float(count)
        for part, seconds in list(self.slow_step_parts.items()):
            out[f"decode_slow_step_seconds_in_{part}"] = seconds
        out.update(self.t2w.watch.stats())  # per-stage host and GPU seconds of the token-to-wave batches
        pool = getattr(self.t2w, "pool", None)
        if pool is not None:
            out.update(flow_slots_free=float(len(pool.free)), flow_overflow_streams=float(pool.overflow),
                       flow_overflow_started=float(self.t2w.overflow_started))
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
            if self.gpu_stream is not None:
                torch.cuda.set_stream(self.gpu_stream)
            while self._drain():
                t0 = time.perf_counter()
                self._guarded(self._admit, self._admitting)
                self._guarded(self._decode, self._decoding)
                self.lm_busy_s += time.perf_counter() - t0
                self._guarded(self._token2wav, self._voicing)
                self._lap("voicing")
        except BaseException as e:  # the engine is dead: tell every waiting client
            log.exception("engine loop failed")
            self.error = e
            for req in list(self.requests.values()):
                req.emit(EngineDead(f"engine failed: {e!r}"))

    def _lap(self, part: str, now: float | None = None) -> float:
        """The engine thread's time since the last lap was spent in `part` (of the current decode step
        period); returns now. Laps end where their part ends, so together they tile the period."""
        now = time.perf_counter() if now is None else now
        parts = self._parts_since_read
        parts[part] = parts.get(part, 0.0) + now - self._lap_mark
        self._lap_mark = now
        return now

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
                self._t2w_later(faults.scrub_flow_slot, self.t2w, seg.t2w)

    def _t2w_later(self, fn, *args) -> None:
        """Run a token-to-wave call now, or when the batch on the worker comes back."""
        if self._in_flight is not None:
            self._after_batch.append(lambda: fn(*args))
        else:
            fn(*args)

    def _voicing(self) -> list[RequestState]:
        return [r for r in self.requests.values() if self._has_audio_work(r)]

    def _admitting(self) -> list[RequestState]:
        return [r for r in self.slot_owner.values() if r.lm_segment is not None and r.t_first_token is None]

    def _decoding(self) -> list[RequestState]:
        return list({id(r): r for r in self.slot_owner.values()}.values())

    def _busy(self) -> bool:
        """Is there work that needs no new message? (Rows parked for text are not work.)"""
        decoding = (self._lm_decoding() and not self._decode_paused()) or self._step_ahead is not None
        admittable = bool(self.waiting) and bool(self.free_slots)
        if decoding or admittable:
            return True
        # while a batch is on the worker, its "chunks_done" message wakes the loop
        return self._in_flight is None and any(self._has_audio_work(r) for r in self.requests.values())

    def _lm_decoding(self) -> bool:
        return any(r.lm_segment is not None and r.lm_segment.lm_status == LMStatus.decoding
                   for r in self.slot_owner.values())

    def _decode_paused(self) -> bool:
        """PERF: while a new request's first chunk is on the worker, decode steps only slow it down (they
        share the GPU: ≈ 10 ms on a lone stream's first chunk on the H100) unless another request still
        waits for its first audio: pause them (`EngineConfig.pause_decode_for_first_chunks`)."""
        if not self._first_in_flight or not self.pause_decode_for_first_chunks:
            return False
        return not any(r.is_first_chunk and id(r) not in self._first_in_flight for r in self.slot_owner.values()
                       if r.lm_segment is not None and r.lm_segment.lm_status == LMStatus.decoding)

    def _wake_after_s(self, now: float) -> float | None:
        """Seconds until the first client with a ready chunk that waits behind the batch on the worker has
        less than chunk_slack_s / 2 of audio left, when the engine must ask the worker to make way
        (`_maybe_preempt`); None: nothing to wake for. PERF: running dry is a matter of time, not a message:
        once the LM had no row left to decode (the end of a burst), the engine thread slept until the
        worker's batch came back, and on the H100 the second chunks of the last requests of a burst came up
        to 0.55 s late behind a phase of final passes."""
        worker = self._chunks
        if not self.preempt or worker is None or not self._in_flight or worker.dry.is_set():
            return None
        dry_s = self.chunk_slack_s / 2
        skip = {id(job.seg) for job in self._in_flight}
        waits = [left - dry_s for req, _ in self._ready_chunks(skip, only=lambda req: not req.is_first_chunk)
                 if (left := _buffered_audio_s(req, now)) > dry_s]
        return min(waits) if waits else None

    def _drain(self) -> bool:
        """Handle every queued message; block for one only when there is nothing else to do, and then no
        longer than until a client waiting for a ready chunk runs dry (`_wake_after_s`)."""
        block = not self._busy()
        timeout = self._wake_after_s(time.perf_counter()) if block else None
        self._lap("drain")
        while True:
            try:
                msg = self.inbox.get(block=block, timeout=timeout)
            except queue.Empty:
                self._lap("inbox")
                return True
            self._lap("inbox")
            block = False
            if msg.kind == "stop":
                return False
            if self.gpu_stream is not None and _holds_cuda_tensors(msg):
                # what the sender's thread queued on the default stream for these tensors comes first.
                # PERF: only then: beside official final passes this wait took ≈ 18 ms of the engine
                # thread's time on the H100 (25 decode steps of 34 ms per run at 15 req/s), for requests
                # whose inputs are all on the CPU (the frontend's are)
                self.gpu_stream.wait_stream(torch.cuda.default_stream(self.gpu_stream.device))
                self._lap("wait_default_stream")
            self._handle(msg)
            self._lap(f"message_{msg.kind}")

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
            if self._in_flight is not None:  # a call may use the flow/HiFT the worker is running
                self._deferred_calls.append(msg)
            else:
                self._call(msg)
        elif msg.kind == "text":
            self._on_text(*msg.payload)
        elif msg.kind == "text_end":
            self._on_text_end(msg.payload)
        elif msg.kind == "chunks_done":
            jobs, results, error, now, busy_s, last, returned = msg.payload
            self.t2w_busy_s += busy_s
            if error is None:
                self._time_finals(jobs, busy_s)
            self._chunks_done(jobs, results, error, now, last, returned)

    @staticmethod
    def _call(msg: _Message) -> None:
        fn, args, done, box = msg.payload
        try:
            box["result"] = fn(*args)
        except Exception as e:  # reported to the caller, the engine goes on
            box["error"] = e
        done.set()

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
        """Give waiting segments free LM rows; the prompts admitted together are prefilled together."""
        t0 = time.perf_counter()
        batch = []  # (request, segment, slot, prompt embeddings)
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            if req.cancelled or req.lm_segment is None:
                continue
            self.free_slots.sort()
            slot = self.free_slots.pop(0)  # lowest free slot keeps the decode bucket small
            try:
                embeds = self._take_row(req, req.lm_segment, slot)
            except Exception as e:  # this prompt failed (e.g. out of memory): fail it alone, admit the rest
                self._prefill_failed(req, slot, e)
                continue
            if embeds is not None:
                batch.append((req, req.lm_segment, slot, embeds))
        self._lap("admit")
        if batch:
            self._prefill(batch, t0)
            self._lap("prefill")

    def _prefill_failed(self, req: RequestState, slot: int, error: Exception) -> None:
        log.exception("prefill of %s failed", req.request_id)
        faults.release_device_memory(error, self.lm_runner.device)
        if slot not in self.slot_owner and slot not in self.free_slots:
            self.free_slots.append(slot)  # it failed before the slot was recorded as taken
        self._fail(req, error)

    def _take_row(self, req: RequestState, seg: Segment, slot: int) -> torch.Tensor | None:
        """Set up LM row `slot` for the segment; returns its prompt embeddings to prefill (None: a text
        stream, fed as its text arrives)."""
        t0 = time.perf_counter()
        if req.t_admit is None:
            req.t_admit = t0
            req.times.queue_s = t0 - req.t_submit - req.times.frontend_s
        seg.slot = slot
        self.slot_owner[slot] = req
        self._reset_row_sampling(req, seg)
        if seg.text_stream:
            seg.bistream = self._new_bistream(seg)
            self._bistream_advance(req, seg)
            return None
        inp = seg.inputs
        return self.lm.embed_prompt(inp.text_ids, inp.llm_prompt_speech_tokens, inp.prompt_text_ids)

    def _reset_row_sampling(self, req: RequestState, seg: Segment) -> None:
        # bistream: EOS stays masked while text streams in (the reference's ignore_eos=True)
        min_len = _NEVER if seg.text_stream else seg.min_len
        self.lm_runner.set_row_sampling(seg.slot, replace(req.sampling, seed=req.sampling.seed + req.lm_index,
                                                          min_len=min_len))

    def _prefill(self, batch: list, t0: float) -> None:
        try:
            tokens = self.lm_runner.prefill_many([(slot, embeds) for _, _, slot, embeds in batch])
        except Exception as e:
            if len(batch) == 1:
                self._prefill_failed(batch[0][0], batch[0][2], e)
                return
            # e.g. out of memory for the batch, or one bad prompt: each prompt again alone, so only a
            # prompt that fails by itself fails its request
            faults.release_device_memory(e, self.lm_runner.device)
            for item in batch:
                # the failed batch may have sampled for this row already (steps, RAS history): start it afresh
                self._reset_row_sampling(item[0], item[1])
                self._prefill([item], t0)
            return
        elapsed = time.perf_counter() - t0
        for (req, seg, _, embeds), token in zip(batch, tokens, strict=True):
            seg.pos = embeds.shape[0]
            if req.lm_index == 0:
                req.times.llm_prefill_s = elapsed
            self._set_decoding(seg, True)
            self._accept_token(req, seg, token)

    def _set_decoding(self, seg: Segment, decoding: bool) -> None:
        seg.lm_status = LMStatus.decoding if decoding else LMStatus.waiting_text
        self.lm_runner.set_active(seg.slot, decoding)

    def _decode(self) -> None:
        """Run a decode step and read the tokens of the one before it.

        PERF: a step is read one call after it is launched, so the GPU computes step N+1 while the host
        reads step N's tokens, plans chunks and admits (launch-ahead; a step's inputs never leave the
        GPU). A row that ends at step N has already run step N+1: that token is dropped (its state is
        reset before the slot is reused, and the K/V it wrote lie past what any reader attends to).
        Rows fed by text streaming decide on each token whether to run again, so while any decodes
        every step is read before the next is launched.
        """
        previous, self._step_ahead = self._step_ahead, None
        current = None
        if not self._decode_paused():
            rows = self._decoding_rows()
            if rows:
                current = self._launch_step(rows, ahead=previous is not None)
        if previous is not None:
            self._read_step(previous)
        if current is not None:
            if all(seg.bistream is None for _, _, seg in current.rows):
                self._step_ahead = current
            else:
                self._read_step(current)

    def _decoding_rows(self) -> list[tuple[int, RequestState, Segment]]:
        return [(slot, req, req.lm_segment) for slot, req in sorted(self.slot_owner.items())
                if req.lm_segment is not None and req.lm_segment.lm_status == LMStatus.decoding]

    def _launch_step(self, rows: list, ahead: bool) -> _Step:
        # with a step still in flight every row stands one position further on the GPU than on the host
        max_pos = max(seg.pos for _, _, seg in rows) + int(ahead)
        ticket = self.lm_runner.launch(rows[-1][0] + 1, max_pos)
        self.num_steps += 1
        return _Step(rows, ticket, ahead)

    def _read_step(self, step: _Step) -> None:
        self._lap("launch")  # what came before the wait: the next step's launch (or the decision not to)
        tokens = self.lm_runner.collect(step.ticket)
        self._time_step(self._lap("gpu"), step.ahead)
        for slot, req, seg in step.rows:
            if seg.lm_status != LMStatus.decoding or seg.slot != slot or self.slot_owner.get(slot) is not req:
                continue  # the row ended (or failed) on an earlier token: this one was computed ahead
            seg.pos += 1
            self._accept_token(req, seg, tokens[slot])
            if req.t_first_ready is None:
                self._note_first_ready(req)
        self._lap("tokens")

    def _time_step(self, now: float, ahead: bool = True) -> None:
        """Track the decode step period; gaps longer than an idle pause are not steps. The period of a step
        launched while the one before it ran (`ahead`: decoding went on between the two reads) is also
        summed under what the token-to-wave worker was running meanwhile (`step_beside`; those of 20 ms
        or more in `slow_steps_beside` too): the two share the GPU and the engine thread's interpreter,
        so this shows which of the worker's phases slow the LM down."""
        period = None if self._last_read_t is None else now - self._last_read_t
        if period is not None and period < 0.05:
            self._step_s = period if self._step_s is None else 0.8 * self._step_s + 0.2 * period
        if period is not None and ahead:
            beside = self._chunks.running if self._chunks is not None and self._in_flight is not None else "idle"
            for table, counted in ((self.step_beside, True), (self.slow_steps_beside, period >= 0.02)):
                if counted:
                    total, count = table.get(beside, (0.0, 0))
                    table[beside] = (total + period, count + 1)
            if period >= 0.02:
                for part, seconds in self._parts_since_read.items():
                    self.slow_step_parts[part] = self.slow_step_parts.get(part, 0.0) + seconds
        self._parts_since_read = {}
        self._last_read_t = now

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
        self._release_flow_slot_before_final(seg)
        req.lm_index += 1
        self._queue_lm(req)

    def _release_flow_slot_before_final(self, seg: Segment) -> None:
        """PERF: the official final pass reads no flow slot (FlowRunner.FinalPass), so once a segment's LM
        is done and its next chunk is that pass, with no other chunk of it on the worker or handed back,
        its slot goes back: a new stream need not wait while the final pass waits behind first chunks (at
        15 req/s on the H100 such passes waited seconds, holding the slots new streams waited for)."""
        if (seg.t2w is None or seg.lm_status != LMStatus.done or seg.planner.finished
                or getattr(self.t2w, "final_attention", "full") != "full"
                or not seg.planner.next_is_final(len(seg.tokens))):
            return
        if any(job.seg is seg for job in (self._in_flight or []) + self._returned):
            return  # released once that chunk is voiced (_job_done)
        self._t2w_later(self.t2w.release, seg.t2w)

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
        return seg.t2w is not None or self.t2w.can_start(seg.inputs, self._start_tokens(req, seg))

    @staticmethod
    def _start_tokens(req: RequestState, seg: Segment) -> int:
        """Target tokens a new stream's flow state must hold from its start: a streamed segment's first
        chunk, an offline segment's whole length (its one chunk is the official final call). A stream
        that goes on past its start grows: an eager state's caches grow, a pooled stream that outgrows
        its slot continues on the eager path. Not the segment's bound: with real weights the LM stops on
        its own long before 20 tokens per text token (spec/llm.md §4), and sizing by the bound sent every
        sentence of more than ~18 text tokens (and every text-streamed segment) past a 1024-frame slot to
        the eager path, with a multi-GB cache of its own."""
        expected = min(req.force_tokens or seg.max_len, 1024)
        if seg.planner.stream:
            return min(expected, seg.planner.first_chunk_tokens)
        return expected

    def _ready_chunks(self, skip: set[int], only: Callable[[RequestState], bool] | None = None) -> list:
        """(request, segment) of every segment with a chunk ready to voice, but those in `skip` (ids of
        segments whose chunk is planned already) and, with `only`, requests it refuses (checked first: it
        is meant to be cheaper than the readiness test); first chunks first, then by submission."""
        ready = []
        for req in self.requests.values():
            if only is not None and not only(req):
                continue
            seg = req.audio_segment
            if seg is None or req.cancelled or id(seg) in skip:
                continue
            if not seg.planner.has_plan(len(seg.tokens), seg.lm_status == LMStatus.done):
                continue
            if req.t_first_ready is None:  # whether or not a flow slot is free
                self._note_first_ready(req)
            if self._can_voice(req, seg):
                ready.append((req, seg))
        ready.sort(key=lambda j: (not j[0].is_first_chunk, j[0].t_submit))
        return ready

    @staticmethod
    def _note_first_ready(req: RequestState) -> None:
        """Stamp the moment the request's first chunk has all its tokens (StageTimes.first_chunk_ready_s):
        checked as each token is read, so a worker busy meanwhile does not hide how long the LM took."""
        seg = req.audio_segment
        if (req.is_first_chunk and seg is not None and not req.cancelled
                and seg.planner.has_plan(len(seg.tokens), seg.lm_status == LMStatus.done)):
            req.t_first_ready = time.perf_counter()
            req.times.first_chunk_ready_s = req.t_first_ready - req.t_submit

    def _token2wav(self) -> None:
        if self._in_flight is not None:
            self._maybe_preempt()
            return
        returned = [job for job in self._returned if job.req.request_id in self.requests and not job.req.cancelled]
        self._returned = []
        ready = self._ready_chunks({id(job.seg) for job in returned})
        if not ready and not returned:
            self._open_ahead()
            return
        unopened = sum(1 for job in returned if job.open_args is not None)
        ready = self._within_free_slots(ready, reserved=unopened)
        now = time.perf_counter()
        due = self._due_finals(now) if ready else set()
        # handed-back jobs were planned for a batch already: they go now, whatever else is ready
        if not returned and (not ready or not self._worth_a_batch(ready, now, due)
                             or self._first_chunks_due_soon(ready, now)):
            self._open_ahead()
            return
        ready = self._without_costly_finals(ready, now, due)
        ready = self._without_early_later_chunks(ready, now, due)
        if not ready and not returned:
            self._open_ahead()
            return
        if self._chunks is not None:
            # the rest waits for the next batch, plans untouched
            ready = ready[:max(0, self.max_chunk_batch - len(returned))]
        jobs = returned + [_Job(req, seg, seg.planner.next_plan(len(seg.tokens), seg.lm_status == LMStatus.done),
                                open_args=self._open_args(req, seg) if seg.t2w is None else None, state=seg.t2w,
                                first=req.is_first_chunk)
                           for req, seg in ready]
        for job in jobs:
            job.pausable = self.pause_final_passes and job.plan.is_final
            job.due = job.plan.is_final and id(job.req) in due
        phases = _phases(jobs, now, self.chunk_slack_s / 2, self.final_phase_streams)
        for job in jobs:
            if job.first:  # handed back and planned again: the last hand-over is the one that ran
                job.req.times.first_chunk_start_s = now - job.req.t_submit
        if self._chunks is not None:
            self._in_flight = jobs
            self._first_in_flight = {id(job.req) for job in jobs if job.req.is_first_chunk}
            self._chunks.submit(phases)
            return
        for i, phase in enumerate(phases):
            for start in range(0, len(phase), self.max_chunk_batch):
                batch = phase[start:start + self.max_chunk_batch]
                t0 = time.perf_counter()
                results, error = None, None
                try:
                    # riders of later phases join `batch` in place (failed with it if the run fails)
                    results = run_jobs(self.t2w, batch, self.lm_runner.device, phases, i, self.rider_streams)
                except Exception as e:
                    error = e
                now = time.perf_counter()
                self.t2w_busy_s += now - t0
                if error is None:
                    self._time_finals(batch, now - t0)
                self._chunks_done(batch, results, error, now)

    def _open_ahead(self) -> None:
        """PERF: while the worker is idle, open the streams of requests whose LM is decoding their first
        chunk's tokens (a pool slot and a copy of the voice's encoded prompt, ≈ 0.5 ms of copying per
        stream on the H100; for a voice not in memory, a flow pass over its prompt), so that work no longer
        delays their first chunk's batch. Pooled streams only, no more than the free slots (oldest
        request first); text streams open with their first chunk (their LM may wait for text). Streams of
        voices whose prompt state is at hand open in one phase; each voice to build (≈ 30 ms) is a phase of
        its own, so a chunk that turns urgent meanwhile waits for one build, not for a burst of them."""
        # called on every loop iteration without a batch to run: nothing to scan without a free slot
        if not self.open_ahead or self._chunks is None or not self.t2w.free_slots():
            return
        new = [(req, req.audio_segment) for req in self.requests.values() if self._opens_ahead(req)]
        new = self._within_free_slots(new, overflow=False)[:self.max_chunk_batch]
        if not new:
            return
        jobs = [_Job(req, seg, None, open_args=self._open_args(req, seg)) for req, seg in new]
        at_hand: list[_Job] = []
        builds: list[list[_Job]] = []
        for job in jobs:
            if self.t2w.has_prompt(job.req.voice_key, job.req.voice_cache):
                at_hand.append(job)
            else:
                builds.append([job])
        self._in_flight = jobs
        self._first_in_flight = set()
        self._chunks.submit(([at_hand] if at_hand else []) + builds)

    def _opens_ahead(self, req: RequestState) -> bool:
        seg = req.audio_segment
        return (seg is not None and seg.t2w is None and not req.cancelled and seg.bistream is None
                and seg.lm_status in (LMStatus.decoding, LMStatus.done)
                and self.t2w.needs_slot(seg.inputs, self._start_tokens(req, seg)))

    def _maybe_preempt(self) -> None:
        """PERF: a batch on the worker runs phase after phase (core._phases). When a first chunk, or a chunk
        of a client about to run dry, becomes ready after the batch was planned, the worker is asked to hand
        back the phases it has not started (later chunks, official final passes: hundreds of ms for many
        streams), so the new chunk waits for one phase, not for the whole batch; the handed-back jobs open
        the next batch, behind it. Not while the new first chunk would wait for others of its burst anyway
        (`_first_chunks_due_soon`)."""
        worker = self._chunks
        if not self.preempt or worker is None or worker.dry.is_set() or not self._in_flight:
            return
        now = time.perf_counter()
        dry_s = self.chunk_slack_s / 2
        # PERF: this runs at every engine-loop turn while a batch is out (each decode step): the cheap
        # urgency test comes before the readiness one
        urgent = self._ready_chunks({id(job.seg) for job in self._in_flight},
                                    only=lambda req: req.is_first_chunk or _buffered_audio_s(req, now) < dry_s)
        urgent = self._within_free_slots(urgent)
        if any(not req.is_first_chunk for req, _ in urgent):  # a client about to run dry: due passes pause too
            worker.dry.set()
            worker.preempt.set()
        elif urgent and not worker.preempt.is_set() and not self._first_chunks_due_soon(urgent, now):
            worker.preempt.set()

    def _worth_a_batch(self, ready: list, now: float, due: Container[int] = ()) -> bool:
        """PERF: a flow batch costs nearly the same for one chunk as for sixteen (it is launch-bound), so
        while the LM is still producing tokens, chunks whose client has more than `chunk_slack_s` of audio
        buffered wait to share a batch with an urgent one. Urgent: a first chunk, a chunk whose client
        is about to run dry, an official final pass that is due (`due`, from `_due_finals`: waiting, the
        passes due together ran out of time once no first chunk came to open a batch, at the end of a run),
        and, while new streams wait for a flow slot, a chunk of a stream whose LM is
        done (its end frees a slot). Nor do chunks wait when no other stream could join them: a lone
        stream's chunks run as soon as they are ready, so its last ones do not pile up behind its final
        token."""
        if self.chunk_slack_s <= 0 or not self._chunks_may_wait(ready):
            return True
        slots_short = self._flow_slots_short()
        for req, seg in ready:
            if _buffered_audio_s(req, now) < self.chunk_slack_s or id(req) in due:
                return True
            if slots_short and seg.lm_status == LMStatus.done:
                return True
        return False

    def _chunks_may_wait(self, ready: list) -> bool:
        """Could waiting make `ready` share a fuller batch? Only while the LM still makes tokens, the batch
        is not large already and another stream could bring a chunk to it."""
        return self._lm_decoding() and len(ready) < self.max_chunk_batch // 4 and self._others_could_join(ready)

    def _others_could_join(self, ready: list) -> bool:
        """Is there a request not in `ready` that still has audio to voice (so a chunk of it may soon be
        ready to share a batch)?"""
        taken = {id(req) for req, _ in ready}
        return any(id(req) not in taken and not req.cancelled and req.audio_segment is not None
                   for req in self.requests.values())

    def _first_chunks_due_soon(self, ready: list, now: float) -> bool:
        """PERF: in a burst the earliest stream's first chunk ran alone (≈ 40 ms of flow on the H100) and
        every other stream's first chunk, ready moments later, waited for it and then ran a batch of its
        own. So ready first chunks wait while another stream's first chunk is due within what is left
        of `first_chunk_wait_s` since the oldest of them became ready (due: its missing tokens times the
        measured decode step); then they run as one batch (sixteen first chunks cost ≈ 1.4 of one).
        Later chunks in the batch must have `chunk_slack_s` of audio buffered for it to wait."""
        if self.first_chunk_wait_s <= 0 or self._step_s is None:
            return False
        firsts = [req for req, _ in ready if req.is_first_chunk]
        # a later chunk in the batch may wait too, but only with audio to spare
        if not firsts or any(not req.is_first_chunk and _buffered_audio_s(req, now) < self.chunk_slack_s
                             for req, _ in ready):
            return False
        for req in firsts:  # set by _ready_chunks; a list built elsewhere counts from now
            if req.t_first_ready is None:
                req.t_first_ready = now
        left = self.first_chunk_wait_s - (now - min(req.t_first_ready for req in firsts))
        if left <= 0:
            return False
        waiting = {id(req) for req, _ in ready}
        for req in self.requests.values():
            seg = req.audio_segment
            if (id(req) in waiting or req.cancelled or not req.is_first_chunk or seg is None
                    or seg is not req.lm_segment or seg.lm_status != LMStatus.decoding):
                continue
            missing = seg.planner.tokens_needed() - len(seg.tokens)
            if missing > 0 and missing * self._step_s <= left:
                return True
        return False

    def _without_costly_finals(self, ready: list, now: float, due: set[int]) -> list:
        """PERF: an official final chunk is a full pass over the whole utterance (≈ 50 ms on the H100):
        a batch that voices a first chunk leaves out the finals that are not due (`_due_finals`: ids of
        requests), unless new streams wait for the flow slots those finals would free."""
        if self.chunk_slack_s <= 0 or getattr(self.t2w, "final_attention", "full") != "full":
            return ready
        if not any(req.is_first_chunk for req, _ in ready) or self._flow_slots_short():
            return ready
        return [(req, seg) for req, seg in ready
                if req.is_first_chunk or not seg.planner.next_is_final(len(seg.tokens)) or id(req) in due]

    def _without_early_later_chunks(self, ready: list, now: float, due: Container[int] = ()) -> list:
        """PERF: an ODE call costs about as much for one stream as for several (≈ 25 ms before its first
        stream on the H100: launch-bound), and at 15 req/s the batches that first chunks open took along the
        later chunks ready at that moment, one to three at a time. So while the LM decodes and other
        streams could join, a later (not final) chunk whose client has `later_chunk_hold_s` of audio or more
        buffered stays out of the batch, unless it shares a first chunk's ODE call (a rider, nearly free):
        it meets other streams' chunks in a later batch. Chunks that opened the batch (a client about to run
        dry, a stream whose end frees a slot others wait for) always go."""
        hold = max(self.later_chunk_hold_s, self.chunk_slack_s)
        if self.later_chunk_hold_s <= 0 or not self._chunks_may_wait(ready):
            return ready
        slots_short = self._flow_slots_short()
        rides = {self._ode_key(req, seg) for req, seg in ready if req.is_first_chunk}
        rides.discard(None)

        def goes(req: RequestState, seg: Segment) -> bool:
            if req.is_first_chunk or id(req) in due or _buffered_audio_s(req, now) < hold:
                return True
            if seg.planner.next_is_final(len(seg.tokens)) or (slots_short and seg.lm_status == LMStatus.done):
                return True
            return self._ode_key(req, seg) in rides

        return [(req, seg) for req, seg in ready if goes(req, seg)]

    def _ode_key(self, req: RequestState, seg: Segment) -> Any:
        """The ODE call this segment's next chunk would share (Token2WavRunner.flow_group), or None where it
        cannot tell (a stream not open yet, a runner without flow groups)."""
        group = getattr(self.t2w, "flow_group", None)
        if group is None or seg.t2w is None:
            return None
        plan = seg.planner.peek_plan(len(seg.tokens), seg.lm_status == LMStatus.done)
        return group(seg.t2w, plan) if plan is not None else None

    def _due_finals(self, now: float) -> set[int]:
        """PERF: ids of the requests whose official final pass may not wait for a first chunk's batch, and
        pauses only for a client about to run dry. Earliest deadline first: the waiting passes in the order
        their clients run dry, each costing the measured time of a pass (`_final_cost_s`); pass k is due when
        its client's audio left, less the cost of passes 1..k (they run before it), is under
        `final_slack_s`, and so are passes 1..k. Judged on its own audio left, each pass came due only when
        its client nearly ran dry: dozens of deferred passes (86 at 15 req/s on the H100) came due together,
        more work than their clients' audio covered, and made other streams' chunks late. Without
        pause_final_passes a pass is due when its own client has less than `chunk_slack_s` left (the rule
        measured as the default; the deadline test was measured with pausing only)."""
        waiting = sorted((_buffered_audio_s(req, now), id(req)) for req in self.requests.values()
                         if self._final_waits(req))
        if not self.pause_final_passes:  # passes never pause: each is due by its own audio left, as before
            return {key for left, key in waiting if left < self.chunk_slack_s}
        slack = max(self.chunk_slack_s, self.final_slack_s)
        cost = self._final_cost_s()
        due = 0
        for k, (left, _) in enumerate(waiting, start=1):
            if left - k * cost < slack:
                due = k
        return {key for _, key in waiting[:due]}

    def _final_waits(self, req: RequestState) -> bool:
        """Is the request's next chunk an official final pass that could run now (LM done, audio out)?"""
        seg = req.audio_segment
        return (seg is not None and not req.cancelled and not req.is_first_chunk and seg.lm_status == LMStatus.done
                and not seg.planner.finished and seg.planner.next_is_final(len(seg.tokens)))

    def _final_cost_s(self) -> float:
        """Measured worker seconds per official final pass (0 before one was measured)."""
        return self._final_busy_s / self._finals_done if self._finals_done > 0 else 0.0

    def _time_finals(self, jobs: list[_Job], busy_s: float) -> None:
        """Account a phase that came back: phases of official final passes (and a phase paused between
        Euler steps, which comes back with no jobs: it can only be one of final passes) count towards
        `_final_cost_s`. Decayed sums, so the estimate follows the batch sizes of the moment."""
        if jobs and not all(job.plan is not None and job.plan.is_final for job in jobs):
            return
        self._final_busy_s = 0.9 * self._final_busy_s + busy_s
        self._finals_done = 0.9 * self._finals_done + len(jobs)
        self.t2w_final_s += busy_s
        self.t2w_finals += len(jobs)
        if any(job.due for job in jobs):
            self.t2w_due_final_s += busy_s
            self.t2w_due_final_phases += 1

    def _flow_slots_short(self) -> bool:
        """Do more new streams wait to start than free slots and room beyond the pool can take?"""
        free = self.t2w.free_slots()
        if free is None:
            return False
        wanting = sum(1 for r in self.requests.values()
                      if not r.cancelled and r.audio_segment is not None and r.audio_segment.t2w is None)
        return wanting > free + self.t2w.overflow_room()

    def _within_free_slots(self, ready: list, reserved: int = 0, overflow: bool = True) -> list:
        """Open no more new streams in one batch than there are free flow slots and, with `overflow`, room
        for streams beyond the pool (`flow_overflow_streams`): each one beyond would fall to the eager path
        and its own multi-GB key/value cache (at 64 streams on the H100 that ran the GPU out of memory);
        the rest start in a later batch, oldest first. `reserved`: streams the batch's handed-back jobs
        will open."""
        free = self.t2w.free_slots()
        if free is None:
            return ready
        free = max(0, free + (self.t2w.overflow_room() if overflow else 0) - reserved)
        kept = []
        for req, seg in ready:
            if seg.t2w is None and self.t2w.needs_slot(seg.inputs, self._start_tokens(req, seg)):
                if free == 0:
                    continue
                free -= 1
            kept.append((req, seg))
        return kept

    def _open_args(self, req: RequestState, seg: Segment) -> dict:
        return dict(inputs=seg.inputs, voice_key=req.voice_key, key=(req.request_id, req.audio_index),
                    speed=req.speed, max_target_tokens=self._start_tokens(req, seg),
                    seed=req.sampling.seed + req.audio_index, stored=req.voice_cache)

    def _chunks_done(self, jobs: list[_Job], results: list | None, error: BaseException | None,
                     now: float, last: bool = True, returned: Sequence[_Job] = ()) -> None:
        """A batch, or one phase of it (`last`: the batch's last phase), came back from the worker or
        inline: emit its audio, or fail its requests alone (the phase failed: its requests fail, the
        others never were in it). Until the last phase the worker still uses the flow and HiFT.
        `returned`: the planned jobs of the phases a preempted worker did not start (they open the next
        batch)."""
        # handed-back open-only jobs are dropped: their streams open later, ahead again or with their first chunk
        self._returned.extend(job for job in returned if job.plan is not None)
        voiced = [job for job in jobs if job.plan is not None]  # the others only opened their stream
        if last or self._in_flight is None:
            self._in_flight = None
            self._first_in_flight = set()
            self.t2w_batches += bool(voiced)
        else:
            done = {id(job) for job in jobs}
            self._in_flight = [job for job in self._in_flight if id(job) not in done]
            self._first_in_flight -= {id(job.req) for job in jobs}
        self.t2w_chunks += len(voiced)
        for job in jobs:  # streams the batch opened belong to their segments now (or are given back)
            if job.open_args is not None and job.state is not None:
                if job.req.request_id in self.requests and not job.req.cancelled:
                    job.seg.t2w = job.state
                else:
                    self.t2w.release(job.state)
        if self._in_flight is None:
            later, self._after_batch = self._after_batch, []
            self._lap("message_chunks_done")
            for fn in later:
                fn()
            self._lap("after_batch")
        if error is not None:
            log.error("token-to-wave batch failed: %r", error)
            err = error if isinstance(error, Exception) else RuntimeError(repr(error))
            faults.release_device_memory(err, self.lm_runner.device)
            for job in jobs:
                if job.req.request_id in self.requests:
                    self._fail(job.req, err)
        else:
            timed = next((r for r in results if r is not None), None)
            if timed is not None:  # every job of a batch carries the batch's flow and vocoder times
                self.t2w_flow_s += timed[1]
                self.t2w_vocoder_s += timed[2]
            self._lap("message_chunks_done")
            for job, result in zip(jobs, results, strict=True):
                self._job_done(job, result, now)
            self._lap("emit_audio")
        if self._in_flight is None:
            calls, self._deferred_calls = self._deferred_calls, []
            for msg in calls:
                self._call(msg)

    def _job_done(self, job: _Job, result: tuple | None, now: float) -> None:
        req = job.req
        if req.request_id not in self.requests or req.cancelled:
            return
        if job.error is not None:
            log.error("token-to-wave start of %s failed: %r", req.request_id, job.error)
            self._fail(req, job.error)
            return
        if job.plan is None:  # opened ahead of its first chunk: nothing to voice yet
            return
        pcm, flow_s, vocoder_s = result
        if faults.is_finite_audio(pcm):  # the chunk is on the host already: checking it is cheap
            self._emit(req, job.seg, job.plan, pcm, flow_s, vocoder_s, now)
            if not job.plan.is_final:
                self._release_flow_slot_before_final(job.seg)
        else:
            self._fail(req, faults.non_finite("flow or vocoder"))

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
        for seg in req.segments:
            self._release_slot(seg)
            if seg.t2w is not None:  # its flow slot comes back after the batch on the worker, if any
                self._t2w_later(self.t2w.release, seg.t2w)
            seg.t2w = None
        self.requests.pop(req.request_id, None)
        if req in self.waiting:
            self.waiting.remove(req)


def _buffered_audio_s(req: RequestState, now: float) -> float:
    """Audio the client has received and not yet played, if it plays from its first chunk on (-inf
    before the first chunk)."""
    if req.is_first_chunk:
        return -math.inf
    return req.t_submit + req.times.first_audio_s + req.times.audio_s - now


def _phases(jobs: list[_Job], now: float, dry_s: float, final_streams: int = 0) -> list[list[_Job]]:
    """A batch's jobs in the order they are voiced and handed back: chunks of clients with less than `dry_s`
    of audio left, first chunks, later chunks, final chunks (those that are due, then those that may
    pause). PERF: each phase's audio goes out as soon as that phase is done, so a new request's first chunk
    never waits for the official final passes (a whole-utterance ODE each, ~300 ms for sixteen streams on
    the H100) or the later chunks in its batch;
    the phases would not have shared a flow or vocoder call anyway (different frame counts, cached or
    not). A client about to run dry goes first: its first audio went out early, at the end of a phase,
    so its next chunk may have waited for the rest of that batch. final_streams > 0: official final passes
    go in phases of at most that many streams (a chunk that preempts waits for one such phase)."""
    order: list[list[_Job]] = [[], [], [], [], []]
    for job in jobs:
        if job.req.is_first_chunk:
            order[1].append(job)
        elif _buffered_audio_s(job.req, now) < dry_s:
            order[0].append(job)
        elif job.plan.is_final:
            # due finals apart from those that may pause: one due pass would keep a whole phase from pausing
            order[3 if job.due or not job.pausable else 4].append(job)
        else:
            order[2].append(job)
    phases = [phase for phase in order[:3] if phase]
    for finals in order[3:]:
        step = final_streams if final_streams > 0 else max(len(finals), 1)
        phases += [finals[i:i + step] for i in range(0, len(finals), step)]
    return phases


def phase_kind(jobs: list[_Job]) -> str:
    """What a phase runs, for the decode-step statistics: "open" (streams opened ahead), "first" (first
    chunks, with any riders), "final" (official final passes) or "chunks" (later chunks)."""
    if all(job.plan is None for job in jobs):
        return "open"
    if any(job.first for job in jobs):
        return "first"
    if all(getattr(job.plan, "is_final", False) for job in jobs):
        return "final"
    return "chunks"


def _rider_pool(phases: list[list[_Job]], i: int, limit: int) -> list[_Job]:
    """Jobs that may ride along with phase i (EngineConfig.rider_streams: `limit` streams in the call): the
    next phase's, when phase i is one of first chunks."""
    if limit <= 0 or i + 1 >= len(phases) or not phases[i] or not all(job.first for job in phases[i]):
        return []
    return [job for job in phases[i + 1] if not job.first]


def _take_riders(phases: list[list[_Job]], i: int, riders: list[_Job]) -> None:
    """The riders leave phase i + 1 (dropped when it is empty then)."""
    taken = {id(job) for job in riders}
    phases[i + 1] = [job for job in phases[i + 1] if id(job) not in taken]
    if not phases[i + 1]:
        del phases[i + 1]


def _riders(t2w: Any, jobs: list[_Job], pool: list[_Job], limit: int) -> list[_Job]:
    """PERF: later chunks whose ODE has the shape of a first chunk's in this phase (same new frames: a
    stream's second chunk against a new request's first one) join its call instead of running one of
    their own after it; small ODE calls are launch-bound (16 streams cost ≈ 2 of one on the H100), so
    the first chunks wait little longer and the worker saves a call. Streams already open only; at most
    `limit` streams in the phase."""
    keys = {t2w.flow_group(job.state, job.plan) for job in jobs
            if job.error is None and job.state is not None and job.plan is not None}
    keys.discard(None)
    room = limit - len(jobs)
    if not keys or room <= 0:
        return []
    return [job for job in pool if job.open_args is None and job.state is not None
            and t2w.flow_group(job.state, job.plan) in keys][:room]


def run_jobs(t2w: Any, jobs: list[_Job], device: torch.device, phases: list[list[_Job]] | None = None, i: int = 0,
             rider_streams: int = 0, should_stop: Callable[[], bool] | None = None) -> list[tuple | None] | None:
    """Open the streams that start with this batch, then voice every job whose stream is open. With the
    batch's `phases` (`jobs` being phase i, or part of it), the jobs of phase i + 1 that can share its ODE
    calls (`_riders`) leave that phase and are appended to `jobs` before anything runs, so a caller
    that sees the run fail fails them with it. Returns each job's (pcm, flow_s, vocoder_s), riders
    included; None for a job that failed alone (its error is on the job) or only opened its stream (no plan).
    should_stop: passed to t2w.run, which may pause a phase of official final passes between Euler steps;
    then the whole result is None (nothing voiced: the jobs go on in a later batch)."""
    t2w.watch.start()
    for job in jobs:
        if job.open_args is not None:
            try:
                job.state = t2w.start(**job.open_args)
            except Exception as e:  # e.g. out of memory building the voice's prompt state
                faults.release_device_memory(e, device)
                job.error = e
    t2w.watch.lap("open")
    pool = _rider_pool(phases, i, rider_streams) if phases is not None else []
    riders = _riders(t2w, jobs, pool, rider_streams) if pool else []
    if riders:
        _take_riders(phases, i, riders)
        jobs.extend(riders)
    runnable = [job for job in jobs if job.error is None and job.plan is not None]
    if runnable:
        items = [(job.state, job.seg.tokens[:], job.plan) for job in runnable]
        results = t2w.run(items, should_stop=should_stop)
        if results is None:
            return None
    else:  # streams opened ahead of their first chunk (or none could open)
        results = []
        t2w.opened()
    by_job = {id(job): result for job, result in zip(runnable, results, strict=True)}
    return [by_job.get(id(job)) for job in jobs]


class _ChunkWorker:
    """The token-to-wave thread: runs one batch at a time on its own CUDA stream and posts the result
    to the engine's inbox. It touches no request state (the engine thread does); while a batch runs it
    is the only user of the flow, HiFT and their graphs."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.jobs: queue.Queue[list | None] = queue.Queue()
        self.preempt = threading.Event()  # set by the engine thread: stop after the running phase
        self.dry = threading.Event()  # ... and the urgent chunk is a client's about to run dry (set with it)
        self.running = "idle"  # the kind of phase on the GPU now (phase_kind), read by the engine's stats
        self.thread = threading.Thread(target=self._run, name="cosystream-token2wav", daemon=True)
        device = core.lm_runner.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def submit(self, phases: list[list[_Job]]) -> None:
        self.preempt.clear()  # a request to stop early is about the batch before this one
        self.dry.clear()
        self.jobs.put(phases)

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while (phases := self.jobs.get()) is not None:
            i = 0
            while i < len(phases):
                jobs = phases[i]
                self.running = phase_kind(jobs)
                results, error = None, None
                t0 = time.perf_counter()
                try:
                    results = self._compute(phases, i)  # riders of phase i + 1 join `jobs` in place
                except BaseException as e:  # reported with the phase; the engine thread decides
                    error = e
                now = time.perf_counter()
                rest = phases[i + 1:]
                paused = error is None and results is None  # final passes stopped between Euler steps
                stop = paused or (bool(rest) and self.preempt.is_set())
                # one message with the unstarted jobs: the engine must not plan before it has them back
                returned = [job for phase in ([jobs] if paused else []) + rest for job in phase] if stop else []
                done, results = ([], []) if paused else (jobs, results)
                self.core.inbox.put(_Message("chunks_done", (done, results, error, now, now - t0,
                                                             not rest or stop, returned)))
                if stop:
                    break
                i += 1
            self.running = "idle"

    def _compute(self, phases: list[list[_Job]], i: int) -> list | None:
        """Phase i's results, or None: a phase of official final passes, none of them due, paused (the
        engine asked to preempt) between two Euler steps (EngineConfig.pause_final_passes)."""
        device, limit = self.core.lm_runner.device, self.core.rider_streams
        should_stop = None
        if self.core.pause_final_passes and all(job.pausable for job in phases[i]):
            # due passes give way only to a client about to run dry, not to first chunks
            should_stop = self.dry.is_set if any(job.due for job in phases[i]) else self.preempt.is_set
        if self.stream is None:
            return run_jobs(self.core.t2w, phases[i], device, phases, i, limit, should_stop)
        # the batch may read what the engine thread wrote on its stream (prompt caches of new voices)
        self.stream.wait_stream(self.core.gpu_stream)
        with torch.cuda.stream(self.stream):
            return run_jobs(self.core.t2w, phases[i], device, phases, i, limit, should_stop)


__all__ = ["EngineCore", "RowSampling"]
