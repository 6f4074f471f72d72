"""The token-to-wave side of the engine thread: snapshots of every stream for the scheduler, and the
scheduler's decisions carried out (batches handed to the worker or run inline, preemption, streams
opened ahead, flow slots given back), audio emitted, deadline misses counted. A mixin of EngineCore:
engine thread only; it decides nothing itself (engine/scheduler.py does).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from cosystream.engine import faults, runners
from cosystream.engine.chunk_worker import ChunkJob, ChunksDone, ChunkWorker, phase_kind, run_jobs
from cosystream.engine.request import LMStatus, RequestState, Segment
from cosystream.engine.scheduler import EngineView, JobView, Plan, Preempt, Scheduler, StreamView, WorkerView
from cosystream.engine.trace import DecisionTrace
from cosystream.outputs import AudioChunk

if TYPE_CHECKING:
    from cosystream.engine.chunk_worker import Message

log = logging.getLogger("cosystream.engine")
# The view that admission reads is rebuilt at least this often while a batch runs on the worker (a
# stale view misses at most a few decode steps' tokens; streams submitted since are counted apart).
PUBLISH_EVERY_S = 0.01
_SAMPLE_RATE = 24000


class Voicing:
    """Ready tokens to audio, as the scheduler decides (mixin of EngineCore; engine thread only)."""

    t2w: runners.Token2WavRunner
    lm_runner: runners.SpeechLMRunner
    scheduler: Scheduler
    requests: dict[str, RequestState]
    max_chunk_batch: int
    open_ahead: bool
    _chunks: ChunkWorker | None
    _in_flight: list[ChunkJob] | None
    _first_in_flight: set[int]
    _returned: list[ChunkJob]
    _after_batch: list[Callable[[], None]]
    _deferred_calls: list[Message]
    trace: DecisionTrace | None

    def _init_voicing(self) -> None:
        self.published: EngineView | None = None  # the latest full view (admission reads it)
        self.added_total = 0  # requests the engine thread has taken in (views count them)
        self._published_at = -math.inf
        self._worker_free_at = 0.0  # the cost model's prediction for the batch on the worker
        self._phase_costs: list[float] = []  # ... of its phases not yet back (the first is running)
        self._phase_started = 0.0  # when its running phase began
        self._slots_after_batch = 0  # slots given back while the batch runs (their release waits for its end)
        self.misses: dict[tuple[str, str], tuple[int, float]] = {}  # (kind, stage) -> (count, seconds late)
        self.first_audio_predicted_s = 0.0  # sums over first chunks of admitted requests with a prediction
        self.first_audio_measured_s = 0.0
        self.first_audio_predictions = 0
        self.t2w_batches = self.t2w_chunks = self.t2w_finals = self.t2w_due_final_phases = self.t2w_handed_back = 0
        self.t2w_busy_s = self.t2w_flow_s = self.t2w_vocoder_s = self.t2w_final_s = self.t2w_due_final_s = 0.0

    # ------------------------------------------------------------------ snapshots
    def _deadline(self, req: RequestState) -> float:
        if req.is_first_chunk:
            return self.scheduler.first_deadline(req.t_submit)
        return self.scheduler.later_deadline(req.t_submit + req.times.first_audio_s, req.times.audio_s)

    def _view_of(self, req: RequestState, now: float, planned: set[int],
                 only: Callable[[bool, float], bool] | None = None) -> StreamView | None:
        seg = req.audio_segment
        if seg is None or req.cancelled:
            return None
        first = req.is_first_chunk
        deadline = self._deadline(req)
        if only is not None and not only(first, -math.inf if first else deadline - now):
            return None
        n, done = len(seg.tokens), seg.lm_status == LMStatus.done
        opened = seg.t2w is not None
        is_planned = id(seg) in planned
        has = not is_planned and seg.planner.has_plan(n, done)
        if has and req.t_first_ready is None:
            self._note_first_ready(req)
        start_tokens = self._start_tokens(req, seg) if not opened else 0
        next_final = seg.planner.next_is_final(n)
        lm_seg = req.lm_segment
        view = StreamView(
            key=id(req), arrival_s=req.t_submit, first=first, deadline_s=deadline, planned=is_planned,
            ready=has and (opened or self.t2w.can_start(seg.inputs, start_tokens)),
            lm_decoding=lm_seg is not None and lm_seg.lm_status == LMStatus.decoding,
            decoding_audio=seg is lm_seg and seg.lm_status == LMStatus.decoding,
            missing_tokens=max(0, seg.planner.tokens_needed() - n), next_final=next_final,
            final_waits=not first and done and not seg.planner.finished and next_final,
            lm_done=done, lm_done_s=seg.t_lm_done, opened=opened, first_ready_s=req.t_first_ready,
            needs_slot=not opened and self.t2w.needs_slot(seg.inputs, start_tokens),
            lm_pending=seg is lm_seg and seg.lm_status == LMStatus.pending, slot_since_s=seg.t_slot,
            row_since_s=lm_seg.t_row if lm_seg is not None and lm_seg.slot >= 0 else None,
            lm_tokens=len(lm_seg.tokens) if lm_seg is not None else 0, lm_expected_tokens=req.force_tokens)
        if view.ready and opened and not next_final:
            view.ode_key_of = lambda: self._ode_key(seg, n, done)
        view.opens_ahead = (view.needs_slot and seg.bistream is None and not is_planned
                            and seg.lm_status in (LMStatus.decoding, LMStatus.done))
        if view.opens_ahead or not opened:  # (admission counts the prompt passes of every stream to open)
            view.voice_at_hand = self.t2w.has_prompt(req.voice_key, req.voice_cache)
        return view

    def _view(self, now: float, planned: set[int], only: Callable[[bool, float], bool] | None = None,
              ) -> tuple[EngineView, dict[int, RequestState]]:
        streams, by_key = [], {}
        for req in self.requests.values():
            view = self._view_of(req, now, planned, only)
            if view is not None:
                streams.append(view)
                by_key[id(req)] = req
        worker = self._chunks
        free = self.t2w.free_slots()
        engine = EngineView(
            now=now, streams=streams, lm_decoding=self._lm_decoding(), free_flow_slots=free,
            flow_slots=None if free is None else self.t2w.flow_slots(),
            max_batch=self.max_chunk_batch,
            official_finals=self.t2w.final_attention == "full", open_ahead=self.open_ahead,
            worker=None if worker is None else WorkerView(
                busy=self._in_flight is not None, first_keys=frozenset(self._first_in_flight),
                preempt_asked=worker.preempt.is_set(), pause_asked=worker.pause.is_set(), dry_asked=worker.dry.is_set(),
                due_finals=any(job.due for job in self._in_flight or ()),
                started_s=now, predicted_s=max(0.0, self._worker_free_at - now) if self._in_flight else 0.0,
                phase_end_s=self._phase_started + self._phase_costs[0] if self._in_flight and self._phase_costs
                else None),
            slots_after_batch=self._slots_after_batch if free is not None else 0,
            free_lm_slots=len(self.free_slots), lm_slots=self.lm_runner.max_slots, lm_waiting=len(self.waiting),
            added=self.added_total)
        return engine, by_key

    def _ode_key(self, seg: Segment, n: int, done: bool) -> Hashable | None:
        plan = seg.planner.peek_plan(n, done)
        return self.t2w.flow_group(seg.t2w, plan) if plan is not None else None

    def _publish(self, view: EngineView) -> None:
        self.published = view
        self._published_at = view.now

    def _in_flight_segments(self) -> set[int]:
        return {id(job.seg) for job in self._in_flight or ()}

    # ------------------------------------------------------------------ decisions
    def _token2wav(self) -> None:
        now = time.perf_counter()
        if self._in_flight is not None:
            self._maybe_preempt(now)
            if now - self._published_at >= PUBLISH_EVERY_S:
                self._publish(self._view(now, self._in_flight_segments())[0])
            return
        returned = [job for job in self._returned if job.req.request_id in self.requests and not job.req.cancelled]
        self._returned = []
        view, by_key = self._view(now, {id(job.seg) for job in returned})
        self._publish(view)
        plan = self.scheduler.plan(view, [self._job_view(job, now) for job in returned])
        if self.trace is not None:
            self.trace.write(view, plan, len(returned))
        if plan.phases:
            self._run_batch(plan, returned, by_key, now)
            if self._chunks is None:  # ran inline: streams moved on (or ended) since the view
                self._publish(self._view(time.perf_counter(), set())[0])
        elif plan.opens:
            self._open_streams(plan.opens, by_key)

    def _job_view(self, job: ChunkJob, now: float) -> JobView:
        final = job.plan is not None and job.plan.is_final
        left = -math.inf if job.req.is_first_chunk else self._deadline(job.req) - now
        return JobView(id(job.req), job.first, final, left, opening=job.open_args is not None, pausable=final)

    def _run_batch(self, plan: Plan, returned: list[ChunkJob], by_key: dict[int, RequestState], now: float) -> None:
        jobs = {id(job.req): job for job in returned}
        phases: list[list[ChunkJob]] = []
        for phase in plan.phases:
            phases.append([])
            for jv in phase:
                job = jobs.get(jv.key)
                if job is None and jv.prompt_pass:  # opens ahead of its first chunk: a new voice's prompt pass
                    req = by_key[jv.key]
                    job = jobs[jv.key] = ChunkJob(req, req.audio_segment, None,
                                                  open_args=self._open_args(req, req.audio_segment),
                                                  builds_prompt=True)
                elif job is None:
                    req = by_key[jv.key]
                    seg = req.audio_segment
                    job = jobs[jv.key] = ChunkJob(
                        req, seg, seg.planner.next_plan(len(seg.tokens), seg.lm_status == LMStatus.done),
                        open_args=self._open_args(req, seg) if seg.t2w is None else None, state=seg.t2w,
                        first=req.is_first_chunk)
                job.pausable, job.due = jv.pausable, jv.due
                phases[-1].append(job)
        batch = [job for phase in phases for job in phase]
        for job in batch:
            if job.first:  # handed back and planned again: the last hand-over is the one that ran
                job.req.times.first_chunk_start_s = now - job.req.t_submit
        if self._chunks is not None:
            self._in_flight = batch
            self._first_in_flight = {id(job.req) for job in batch if job.req.is_first_chunk and job.plan is not None}
            self._phase_costs = [self._predict_s(phase) for phase in phases]
            self._phase_started = now
            self._worker_free_at = now + sum(self._phase_costs)
            self._chunks.submit(phases)
            return
        for i, phase in enumerate(phases):  # inline: riders of phase i + 1 join it (run_jobs)
            for start in range(0, len(phase), self.max_chunk_batch):
                part = phase[start:start + self.max_chunk_batch]
                kind, t0 = phase_kind(part), time.perf_counter()
                results, error, passes = None, None, []
                try:
                    results = run_jobs(self.t2w, part, phases, i)
                    passes = self.t2w.finished_prompt_passes()
                except Exception as e:
                    error = e
                end = time.perf_counter()
                self._chunks_done(ChunksDone(part, results, error, end, end - t0, True, kind=kind,
                                             prompt_passes=passes))

    def _predict_s(self, phase: list[ChunkJob]) -> float:
        """The cost model's seconds for one phase (phase_kind) of a batch; a phase that only opens streams costs
        its prompt passes (streams of voices at hand open for nothing)."""
        voiced = [job for job in phase if job.plan is not None]
        if not voiced:
            return self.scheduler.prompt_costs.passes_s(sum(job.builds_prompt for job in phase))
        return self.scheduler.cost.phase_s(phase_kind(voiced), len(voiced))

    def _open_streams(self, opens: list[list[int]], by_key: dict[int, RequestState]) -> None:
        """Hand the idle worker a batch that only opens streams (ahead of their first chunk)."""
        phases = [[ChunkJob(req, req.audio_segment, None, open_args=self._open_args(req, req.audio_segment),
                            builds_prompt=not self.t2w.has_prompt(req.voice_key, req.voice_cache))
                   for req in (by_key[key] for key in phase)] for phase in opens]
        self._in_flight = [job for phase in phases for job in phase]
        self._first_in_flight = set()
        self._phase_costs = [self._predict_s(phase) for phase in phases]
        self._phase_started = time.perf_counter()
        self._worker_free_at = self._phase_started + sum(self._phase_costs)
        self._chunks.submit(phases)

    def _maybe_preempt(self, now: float) -> None:
        worker = self._chunks
        if worker is None or worker.dry.is_set() or not self._in_flight:
            return
        view, _ = self._view(now, self._in_flight_segments(), only=self.scheduler.may_be_urgent)
        decision = self.scheduler.preempt(view)
        if decision is Preempt.none:
            return
        if decision is Preempt.dry:
            worker.dry.set()
        worker.pause.set()  # every stop request pauses a phase of final passes not due (dry: due ones too)
        worker.preempt.set()
        if self.trace is not None:
            self.trace.write_preempt(view, decision, worker.running, max(0, len(self._phase_costs) - 1))

    def _decode_paused(self) -> bool:
        if not self._first_in_flight:
            return False
        another = any(r.is_first_chunk and id(r) not in self._first_in_flight for r in self.slot_owner.values()
                      if r.lm_segment is not None and r.lm_segment.lm_status == LMStatus.decoding)
        return self.scheduler.decode_paused(True, another)

    def _wake_after_s(self, now: float) -> float | None:
        worker = self._chunks
        if worker is None or not self._in_flight or worker.dry.is_set():
            return None
        view, _ = self._view(now, self._in_flight_segments(), only=lambda first, left: not first)
        return self.scheduler.wake_after_s(view)

    # ------------------------------------------------------------------ streams
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
        chunk, an offline segment's whole length (its one chunk is the official final call), at most 1024.
        Not the LM's bound of 20 tokens per text token: the LM stops on its own long before it (spec/llm.md
        §4), and sizing by it would send most sentences past a slot to the eager path."""
        expected = min(req.force_tokens or seg.max_len, 1024)
        if seg.planner.stream:
            return min(expected, seg.planner.first_chunk_tokens)
        return expected

    @staticmethod
    def _note_first_ready(req: RequestState) -> None:
        """Stamp the moment the request's first chunk has all its tokens (StageTimes.first_chunk_ready_s):
        checked as each token is read, so a worker busy meanwhile does not hide how long the LM took."""
        seg = req.audio_segment
        if (req.is_first_chunk and seg is not None and not req.cancelled
                and seg.planner.has_plan(len(seg.tokens), seg.lm_status == LMStatus.done)):
            req.t_first_ready = time.perf_counter()
            req.times.first_chunk_ready_s = req.t_first_ready - req.t_submit

    def _release_flow_slot_before_final(self, seg: Segment) -> None:
        """When the official final pass reads no flow slot (CosyVoice2's), once a segment's LM is done and its
        next chunk is that pass (none of its chunks on the worker or handed back), its slot goes back: new
        streams need not wait while the pass waits behind first chunks."""
        if (seg.t2w is None or seg.lm_status != LMStatus.done or seg.planner.finished
                or self.t2w.final_attention != "full" or self.t2w.final_reads_slot
                or not seg.planner.next_is_final(len(seg.tokens))):
            return
        if any(job.seg is seg for job in (self._in_flight or []) + self._returned):
            return  # released once that chunk is voiced (_job_done)
        self._release_later(seg.t2w, self._slot_released(seg))

    def _release_later(self, state: object, on_back: Callable[[], None] | None = None) -> None:
        """Give a stream's slot back now, or once the worker's batch stops (the pool is the worker's while
        it runs); admission counts the slots coming back then (EngineView.slots_after_batch). `on_back`: called
        when the slot is back in the pool."""
        if self._in_flight is not None:
            self._slots_after_batch += 1

        def give_back() -> None:
            self.t2w.release(state)
            if on_back is not None:
                on_back()

        self._t2w_later(give_back)

    def _slot_released(self, seg: Segment) -> Callable[[], None]:
        """A stream is done with its flow slot: what teaches the cost model its hold and its tail after the
        LM's end, to be called when the slot is back in the pool (a new stream can only open then)."""
        since, lm_done = seg.t_slot, None if seg.text_stream else seg.t_lm_done  # (a text stream's LM ends with
        seg.t_slot = None  # its client)

        def observe() -> None:
            if since is not None:
                now = time.perf_counter()
                self.scheduler.cost.observe_slot_hold(now - since)
                if lm_done is not None:
                    self.scheduler.cost.observe_slot_tail(now - lm_done)

        return observe

    def _open_args(self, req: RequestState, seg: Segment) -> dict:
        return dict(inputs=seg.inputs, voice_key=req.voice_key, key=(req.request_id, req.audio_index),
                    speed=req.speed, max_target_tokens=self._start_tokens(req, seg),
                    seed=req.sampling.seed + req.audio_index, stored=req.voice_cache)

    # ------------------------------------------------------------------ results
    def _chunks_done(self, msg: ChunksDone) -> None:
        """A batch, or one phase of it (`msg.last`: the batch's last), came back from the worker or inline:
        emit its audio, or fail its requests alone. Until the last phase the worker still uses the flow and
        HiFT. `msg.returned`: planned jobs of phases a preempted worker did not start (they open the next
        batch); handed-back open-only jobs are dropped (their streams open later)."""
        jobs, now = msg.jobs, msg.now
        self.t2w_busy_s += msg.busy_s
        if self.trace is not None:
            self.trace.write_done(msg.kind, len(jobs), now, msg.busy_s, msg.prompt_passes)
        # new voices' prompt passes, however long after their phase they end (on CUDA they run beside the worker)
        for voices, seconds in msg.prompt_passes:
            self.scheduler.prompt_costs.observe_passes(voices, seconds)
        if msg.error is None:
            self._account_phase(msg)
        self._returned.extend(job for job in msg.returned if job.plan is not None)
        self.t2w_handed_back += len(msg.returned)
        voiced = [job for job in jobs if job.plan is not None]  # the others only opened their stream
        if msg.last or self._in_flight is None:
            self._in_flight = None
            self._first_in_flight = set()
            self.t2w_batches += bool(voiced)
        else:
            done = {id(job) for job in jobs}
            self._in_flight = [job for job in self._in_flight if id(job) not in done]
            self._first_in_flight -= {id(job.req) for job in jobs}
            self._phase_costs = self._phase_costs[1:]
            self._phase_started = now
            self._worker_free_at = now + sum(self._phase_costs)
        self.t2w_chunks += len(voiced)
        for job in jobs:  # streams the batch opened belong to their segments now (or are given back)
            if job.open_args is not None and job.state is not None:
                if job.req.request_id in self.requests and not job.req.cancelled:
                    job.seg.t2w = job.state
                    job.seg.t_slot = now if self.t2w.needs_slot(job.seg.inputs, self._start_tokens(job.req, job.seg)) \
                        else None
                else:
                    self.t2w.release(job.state)
        if self._in_flight is None:
            later, self._after_batch = self._after_batch, []
            self._slots_after_batch = 0
            self._lap("message_chunks_done")
            for fn in later:
                fn()
            self._lap("after_batch")
        if msg.error is not None:
            log.error("token-to-wave batch failed: %r", msg.error)
            err = msg.error if isinstance(msg.error, Exception) else RuntimeError(repr(msg.error))
            faults.release_device_memory(err, self.lm_runner.device)
            for job in jobs:
                if job.req.request_id in self.requests:
                    self._fail(job.req, err)
        else:
            timed = next((r for r in msg.results if r is not None), None)
            if timed is not None:  # every job of a batch carries the batch's flow and vocoder times
                self.t2w_flow_s += timed[1]
                self.t2w_vocoder_s += timed[2]
            self._lap("message_chunks_done")
            for job, result in zip(jobs, msg.results, strict=True):
                self._job_done(job, result, now)
            self._lap("emit_audio")
        if self._in_flight is None:
            calls, self._deferred_calls = self._deferred_calls, []
            for call in calls:
                self._call(call)

    def _account_phase(self, msg: ChunksDone) -> None:
        """Feed the cost model; phases of official final passes (a paused one comes back with no jobs) are
        also engine stats."""
        voiced = sum(1 for job in msg.jobs if job.plan is not None)
        if msg.kind == "open":  # streams opened ahead: their passes are counted as they end (_chunks_done)
            return
        self.scheduler.cost.observe_phase(msg.kind, voiced, msg.busy_s)
        if msg.kind == "final":
            self.t2w_final_s += msg.busy_s
            self.t2w_finals += len(msg.jobs)
            if any(job.due for job in msg.jobs):
                self.t2w_due_final_s += msg.busy_s
                self.t2w_due_final_phases += 1

    def _job_done(self, job: ChunkJob, result: runners.ChunkAudio | None, now: float) -> None:
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
            self._emit(req, job.seg, job.plan.is_final, pcm, flow_s, vocoder_s, now)
            if not job.plan.is_final:
                self._release_flow_slot_before_final(job.seg)
        else:
            self._fail(req, faults.non_finite("flow or vocoder"))

    def _emit(self, req: RequestState, seg: Segment, is_final: bool, pcm: np.ndarray, flow_s: float,
              vocoder_s: float, now: float) -> None:
        t = req.times
        if pcm.shape[0] == 0 and not is_final:  # audio withheld for the next chunk: the client has nothing yet
            return
        self._count_miss(req, is_final, now)
        if req.is_first_chunk:
            t.first_chunk_flow_s, t.first_chunk_vocoder_s = flow_s, vocoder_s
            t.first_audio_s = now - req.t_submit
            if req.predicted_first_audio_s is not None:
                self.first_audio_predicted_s += req.predicted_first_audio_s
                self.first_audio_measured_s += t.first_audio_s
                self.first_audio_predictions += 1
        t.audio_s += pcm.shape[0] / _SAMPLE_RATE
        last = is_final and req.audio_index == len(req.segments) - 1
        if is_final:
            t.num_tokens += len(seg.tokens)
            if not seg.text_stream:  # (a text stream's length is its client's)
                self.scheduler.cost.observe_lm_tokens(len(seg.tokens))
            self._slot_released(seg)()  # held to the end where final chunks run in the slot: back now
            seg.t2w = None
            req.audio_index += 1
        if last:
            t.total_s = now - req.t_submit
            self._unpublish(req)  # before its client hears of the end: admission must not count it after
        req.emit(AudioChunk(pcm=pcm, index=req.chunks_emitted, is_final=last, times=t if last else None,
                            request_id=req.request_id))
        req.chunks_emitted += 1
        if last:
            req.finished = True
            self._finish(req)

    def _count_miss(self, req: RequestState, is_final: bool, now: float) -> None:
        miss = self.scheduler.miss(first=req.is_first_chunk, final=is_final, deadline_s=self._deadline(req),
                                   delivered_s=now, tokens_ready_s=req.t_first_ready if req.is_first_chunk
                                   else None)
        if miss is not None:
            count, late = self.misses.get((miss.kind, miss.stage), (0, 0.0))
            self.misses[(miss.kind, miss.stage)] = (count + 1, late + miss.late_s)

    def _unpublish(self, req: RequestState) -> None:
        """Drop a request that ends from the published view (a new one is built at the next planning)."""
        view = self.published
        if view is not None and any(s.key == id(req) for s in view.streams):
            self.published = replace(view, streams=[s for s in view.streams if s.key != id(req)])

    def _finish(self, req: RequestState) -> None:
        self._unpublish(req)
        for seg in req.segments:
            self._release_slot(seg)
            if seg.t2w is not None:  # its flow slot comes back after the batch on the worker, if any
                if seg.t_slot is not None or self.t2w.final_reads_slot:  # (else given back before its final)
                    self._release_later(seg.t2w)
                else:
                    self._t2w_later(self.t2w.release, seg.t2w)
            seg.t2w = None
            seg.t_slot = None
        self.requests.pop(req.request_id, None)
        if req in self.waiting:
            self.waiting.remove(req)
