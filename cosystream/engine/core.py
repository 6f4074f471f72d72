"""EngineCore: the one thread that owns the GPU. Requests in through a queue, audio chunks out.

Each loop iteration: take new messages (blocking only when idle, and then no longer than the scheduler
says), admit waiting segments into free LM rows (prefill), launch one batched decode step for every
decoding stream and read the previous step's tokens (engine/decode_loop.py), then carry out the
scheduler's decision about the chunks that became ready (engine/voicing.py, engine/scheduler.py), whose
batches run on the token-to-wave worker thread (engine/chunk_worker.py). This module holds the threads,
the queue and the GPU streams; it makes no scheduling decision.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from dataclasses import fields, is_dataclass
from typing import Any

import torch

from cosystream.config import EngineConfig
from cosystream.engine import faults, runners
from cosystream.engine.chunk_worker import (
    Abort,
    Add,
    Call,
    ChunkJob,
    ChunksDone,
    ChunkWorker,
    Message,
    Stop,
    Text,
    TextEnd,
)
from cosystream.engine.decode_loop import DecodeLoop, _Step
from cosystream.engine.lm_runner import RowSampling
from cosystream.engine.prompt_load import PromptBacklog
from cosystream.engine.request import LMStatus, RequestState
from cosystream.engine.scheduler import Rule, Scheduler, Verdict
from cosystream.engine.trace import DecisionTrace
from cosystream.engine.voicing import Voicing
from cosystream.errors import EngineDead

log = logging.getLogger("cosystream.engine")
_KINDS = {Add: "add", Abort: "abort", Call: "call", Text: "text", TextEnd: "text_end", ChunksDone: "chunks_done"}
# Chunks in one token-to-wave batch: the flow's and HiFT's largest captured batch bucket.
MAX_CHUNK_BATCH = 64


def _holds_cuda_tensors(msg: Message) -> bool:
    """Does a message from another thread carry CUDA tensors (a request's inputs, a call's arguments)?"""
    if isinstance(msg, Add):
        return any(_holds_cuda(seg.inputs) for seg in msg.req.segments) or _holds_cuda(msg.req.voice_cache)
    if isinstance(msg, Call):
        return _holds_cuda(msg.args)
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


class EngineCore(DecodeLoop, Voicing):
    def __init__(self, lm_runner: runners.SpeechLMRunner, token2wav: runners.Token2WavRunner,
                 lm: runners.SpeechLMModel, config: EngineConfig, scheduler: Scheduler | None = None) -> None:
        self.trace = DecisionTrace.from_env()
        self.lm_runner = lm_runner
        self.t2w = token2wav
        self.lm = lm
        self.scheduler = scheduler or Scheduler(budget_s=config.first_audio_budget_s)
        self.max_chunk_batch = MAX_CHUNK_BATCH
        self.open_ahead = config.open_ahead
        # decode step periods (seconds, steps) by the worker's phase meanwhile (ChunkWorker.running)
        self.step_beside: dict[str, tuple[float, int]] = {}
        self.slow_steps_beside: dict[str, tuple[float, int]] = {}  # ... of 20 ms or more
        # where the engine thread's time went in those slow steps: waiting for the step on the GPU ("gpu"),
        # waiting for messages ("inbox"; "drain": deciding whether to), handling each kind, admitting,
        # prefilling, launching the step, taking its tokens, planning token-to-wave ("voicing")
        self.slow_step_parts: dict[str, float] = {}
        self._parts_since_read: dict[str, float] = {}
        self._lap_mark = time.perf_counter()
        self._last_read_t: float | None = None
        self.inbox: queue.Queue[Message] = queue.Queue()
        self.requests: dict[str, RequestState] = {}
        self.waiting: deque[RequestState] = deque()  # requests whose LM segment needs a slot
        self.free_slots = list(range(lm_runner.max_slots))
        self.slot_owner: dict[int, RequestState] = {}
        self.num_steps = 0
        self.lm_busy_s = 0.0  # admitting (prefill) and decode steps, on the engine thread
        self.admitted = 0  # admission decisions (admit()): the streams admitted ...
        self.refused_by = dict.fromkeys(Rule, 0)  # ... and those refused, by the rule that refused them
        self._init_voicing()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="cosystream-engine", daemon=True)
        device = lm_runner.device
        overlap = config.overlap
        # LM steps run on a high-priority stream, so a decode step's small kernels are scheduled ahead of a
        # flow batch's when both wait for the SMs.
        self.gpu_stream = (torch.cuda.Stream(device, priority=-1) if overlap and device.type == "cuda"
                           else None)
        # Token-to-wave batches run on a second thread and CUDA stream, so LM decode steps go on while a
        # flow/HiFT batch computes. One batch is in flight at a time; the engine thread plans every batch.
        self._chunks: ChunkWorker | None = ChunkWorker(self) if overlap else None
        self._in_flight: list[ChunkJob] | None = None  # the jobs of the batch on the worker
        self._first_in_flight: set[int] = set()  # ids of requests whose first chunk is on the worker
        # Token-to-wave work the engine thread must not do while a batch runs on the worker (its graphs
        # and pool would be used from two threads at once): done when the batch comes back.
        self._after_batch: list[Any] = []  # callables
        self._deferred_calls: list[Call] = []
        # planned jobs of a batch the worker handed back before running them (preempted): the next batch
        # voices them, with the urgent chunks that preempted them
        self._returned: list[ChunkJob] = []
        self._step_ahead: _Step | None = None  # a launched decode step whose tokens are not read yet

    # ------------------------------------------------------------------ thread-safe API
    def start(self) -> None:
        self._thread.start()
        if self._chunks is not None:
            self._chunks.start()

    def stop(self) -> None:
        self.inbox.put(Stop())
        self._thread.join(timeout=30)
        if self._chunks is not None:
            self._chunks.stop()
        if self.trace is not None:
            self.trace.close()

    def admit(self, first_chunk_tokens: int, pending: int = 0, prompts: PromptBacklog | None = None) -> Verdict:
        """Would a stream arriving now get its first audio within the budget, with every running stream
        still on time (Scheduler.admit on the latest view)? Any thread; it reads a published snapshot and
        takes well under a millisecond. `pending`: streams admitted that the engine has not taken in yet;
        `prompts`: the prompt analysis as the stream finds it (PromptBatcher.backlog)."""
        view = self.published
        if view is not None:
            pending = max(0, pending - view.added)
        verdict = self.scheduler.admit(view, time.perf_counter(), first_chunk_tokens, pending, prompts)
        if verdict.rule is None:
            self.admitted += 1
        else:
            self.refused_by[verdict.rule] += 1
        return verdict

    def submit(self, req: RequestState) -> None:
        self._check_alive()
        self.inbox.put(Add(req))

    def abort(self, request_id: str) -> None:
        self.inbox.put(Abort(request_id))

    def add_text(self, request_id: str, text_ids: list[int]) -> None:
        """Text streaming in: the next text ids of a bistream request."""
        self.inbox.put(Text(request_id, text_ids))

    def end_text(self, request_id: str) -> None:
        self.inbox.put(TextEnd(request_id))

    def call(self, fn, *args, timeout_s: float = 600.0) -> Any:
        """Run fn(*args) on the engine thread (GPU jobs such as voice caches) and wait for it."""
        self._check_alive()
        msg = Call(fn, args)
        self.inbox.put(msg)
        while not msg.done.wait(timeout=1.0):
            self._check_alive()
            timeout_s -= 1.0
            if timeout_s <= 0:
                raise EngineDead("engine did not answer in time")
        if "error" in msg.box:
            raise msg.box["error"]
        return msg.box.get("result")

    def capture_prefill(self) -> int:
        """Warm-up (run it through `call`): the batched prefill graphs, captured in a free LM row."""
        return self.lm_runner.capture_prefill(max(self.free_slots)) if self.free_slots else 0

    def measure_decode_step(self, repeats: int = 5) -> float | None:
        """Warm-up (run it through `call`, with no stream running): time the decode step of every LM row
        (rows not decoding do not advance) and seed the cost model with it."""
        if self.requests or not self.free_slots:
            return None
        rows, position = self.lm_runner.max_slots, min(self.lm_runner.max_len - 1, 512)
        self.lm_runner.decode(rows, position)  # a first replay may still capture
        t0 = time.perf_counter()
        for _ in range(repeats):
            self.lm_runner.decode(rows, position)
        step_s = (time.perf_counter() - t0) / repeats
        self.scheduler.cost.observe_step(step_s)
        return step_s

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
               "token2wav_due_final_phases": float(self.t2w_due_final_phases),
               "token2wav_handed_back": float(self.t2w_handed_back),
               "admission_admitted": float(self.admitted), "admission_refused": float(sum(self.refused_by.values())),
               **{f"admission_refused_{rule.value}": float(n) for rule, n in self.refused_by.items()},
               "first_audio_predicted_seconds": self.first_audio_predicted_s,
               "first_audio_measured_seconds": self.first_audio_measured_s,
               "first_audio_predictions": float(self.first_audio_predictions)}
        for (kind, stage), (count, late_s) in list(self.misses.items()):
            out[f"deadline_misses_{kind}_{stage}"] = float(count)
            out[f"deadline_miss_seconds_{kind}_{stage}"] = late_s
        for name, table in (("decode_step", self.step_beside), ("decode_slow_step", self.slow_steps_beside)):
            for beside, (total, count) in list(table.items()):
                out[f"{name}_seconds_beside_{beside}"] = total
                out[f"{name}s_beside_{beside}"] = float(count)
        for part, seconds in list(self.slow_step_parts.items()):
            out[f"decode_slow_step_seconds_in_{part}"] = seconds
        view = self.published
        if view is not None:  # what admission's debt rule reads (Scheduler.worker_debt_s)
            out["worker_debt_seconds"] = self.scheduler.worker_debt_s(view, time.perf_counter())
        if math.isfinite(self.scheduler.worker_debt_limit_s):
            out["worker_debt_limit_seconds"] = self.scheduler.worker_debt_limit_s
        out.update(self.t2w.watch.stats())  # per-stage host and GPU seconds of the token-to-wave batches
        out.update(self.t2w.slot_gauges())
        device = self.lm_runner.device
        if device.type == "cuda":
            out["gpu_memory_allocated_bytes"] = float(torch.cuda.memory_allocated(device))
            out["gpu_memory_reserved_bytes"] = float(torch.cuda.memory_reserved(device))
            out["gpu_memory_total_bytes"] = float(torch.cuda.get_device_properties(device).total_memory)
        return out

    @property
    def batch_in_flight(self) -> bool:
        """Does token-to-wave work of the worker's batch remain (running, or waiting for it to come back)?"""
        return self._in_flight is not None or bool(self._after_batch)

    @property
    def handed_back(self) -> int:
        """Planned jobs a preempted worker handed back that no batch has voiced yet."""
        return len(self._returned)

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
        # while a batch is on the worker, its ChunksDone message wakes the loop
        return self._in_flight is None and any(self._has_audio_work(r) for r in self.requests.values())

    def _lm_decoding(self) -> bool:
        return any(r.lm_segment is not None and r.lm_segment.lm_status == LMStatus.decoding
                   for r in self.slot_owner.values())

    def _drain(self) -> bool:
        """Handle every queued message; block for one only when there is nothing else to do, and then no
        longer than the scheduler's wake-up (a client waiting behind the worker about to run dry)."""
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
            if isinstance(msg, Stop):
                return False
            if self.gpu_stream is not None and _holds_cuda_tensors(msg):
                # what the sender's thread queued on the default stream for these tensors comes first; only
                # then, as the wait costs the engine thread ≈ 18 ms beside final passes on an H100
                self.gpu_stream.wait_stream(torch.cuda.default_stream(self.gpu_stream.device))
                self._lap("wait_default_stream")
            self._handle(msg)
            self._lap(f"message_{_KINDS[type(msg)]}")

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, Add):
            self.requests[msg.req.request_id] = msg.req
            self.added_total += 1
            self._queue_lm(msg.req)
        elif isinstance(msg, Abort):
            req = self.requests.get(msg.request_id)
            if req is not None:
                req.emit(faults.aborted())  # a reader that did not ask for the abort stops waiting
                req.cancelled = True
                self._finish(req)
        elif isinstance(msg, Call):
            if self._in_flight is not None:  # a call may use the flow/HiFT the worker is running
                self._deferred_calls.append(msg)
            else:
                self._call(msg)
        elif isinstance(msg, Text):
            self._on_text(msg.request_id, msg.text_ids)
        elif isinstance(msg, TextEnd):
            self._on_text_end(msg.request_id)
        elif isinstance(msg, ChunksDone):
            self._chunks_done(msg)

    @staticmethod
    def _call(msg: Call) -> None:
        try:
            msg.box["result"] = msg.fn(*msg.args)
        except Exception as e:  # reported to the caller, the engine goes on
            msg.box["error"] = e
        msg.done.set()


__all__ = ["EngineCore", "RowSampling"]
