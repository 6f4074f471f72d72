"""The LM side of the engine thread: admitting segments into LM rows, prefill, launch-ahead decode steps,
reading their tokens, and text streaming in (bistream). A mixin of EngineCore: it runs on the engine
thread and shares the core's request bookkeeping.

A step is read one loop turn after it is launched, so the GPU computes step N+1 while the host reads
step N's tokens, plans chunks and admits (launch-ahead; a step's inputs never leave the GPU). A row that
ends at step N has already run step N+1: that token is dropped (its state is reset before the slot is
reused, and the keys/values it wrote lie past what any reader attends to). Rows fed by text streaming
decide on each token whether to run again, so while any decodes every step is read before the next.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from cosystream.engine import faults, runners
from cosystream.engine.bistream import BistreamState, Feed
from cosystream.engine.request import LMStatus, RequestState, Segment
from cosystream.transfers import ints_to_device

if TYPE_CHECKING:
    from cosystream.engine.scheduler import Scheduler

log = logging.getLogger("cosystream.engine")
_NEVER = 1 << 40  # a min_len that is never reached


@dataclass
class _Step:
    """A launched decode step: the rows it ran, as (slot, request, segment) when launched."""

    rows: list[tuple[int, RequestState, Segment]]
    ticket: Any  # the runner's handle of the launched step
    ahead: bool = False  # launched while the step before it was still in flight (decoding went on)




class DecodeLoop:
    """LM rows and decode steps (mixin of EngineCore; engine thread only)."""

    lm_runner: runners.SpeechLMRunner
    lm: runners.SpeechLMModel
    scheduler: Scheduler
    requests: dict[str, RequestState]
    waiting: deque[RequestState]
    free_slots: list[int]
    slot_owner: dict[int, RequestState]
    num_steps: int

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
        seg.t_row = t0
        self.slot_owner[slot] = req
        self._reset_row_sampling(req, seg)
        seg.token_filter = self.lm.token_filter()
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
        self.scheduler.cost.observe_prefill(elapsed)
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
        """Run a decode step (unless the scheduler pauses decoding) and read the tokens of the one before
        it (launch-ahead, see the module docstring)."""
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
        if period is not None:
            self.scheduler.cost.observe_step(period)
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
            self._keep_speech_token(seg, token)
        limit = req.force_tokens if req.force_tokens is not None else seg.max_len
        if is_stop or seg.generated >= limit or seg.pos >= self.lm_runner.max_len - 1:
            self._lm_done(req, seg)

    @staticmethod
    def _keep_speech_token(seg: Segment, token: int) -> None:
        """A generated speech token: counted, and voiced unless the family's filter drops it (the LM row
        is fed every token whatever the filter says)."""
        seg.generated += 1
        if seg.token_filter is None or seg.token_filter.keep(token):
            seg.tokens.append(token)

    def _lm_done(self, req: RequestState, seg: Segment) -> None:
        seg.lm_status = LMStatus.done
        seg.t_lm_done = time.perf_counter()
        if seg.t_row is not None and not seg.text_stream:  # a text stream's row waits for its client
            self.scheduler.cost.observe_lm_hold(time.perf_counter() - seg.t_row)
        self._release_slot(seg)
        self._release_flow_slot_before_final(seg)
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
        dev = lm.text_embedding.weight.device
        prefix, prompt_text, prompt_speech = lm.bistream_prompt(inp.prompt_text_ids, inp.llm_prompt_speech_tokens)
        sos, task_id = lm.special_rows()
        state = BistreamState(sos=sos, task_id=task_id, prompt_text=prompt_text, prompt_speech=prompt_speech,
                              fill_token=lm.fill, mix_ratio=lm.dims.mix_ratio, prefix=prefix)
        if seg.text_backlog:
            state.add_text(lm.text_embedding(ints_to_device(seg.text_backlog, dev)))
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
            self._keep_speech_token(seg, token)
        forced_done = req.force_tokens is not None and seg.generated >= req.force_tokens
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
        seg.bistream.add_text(self.lm.text_embedding(ints_to_device(text_ids, dev)))
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

