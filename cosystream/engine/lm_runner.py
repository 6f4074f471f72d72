"""LMRunner: owns the speech LM, its static KV cache and the decode step (CUDA-graphed per bucket).

Every stream holds one slot (a KV-cache row and a row of the per-row decode state). A decode step runs
rows [0, b) for the smallest captured bucket b that covers the highest active slot; rows that are not
decoding compute garbage that lands only beyond their own valid cache length and is ignored.
The whole step (embedding of the previous token, 24 layers, head, sampling, state update) is one
graph replay followed by one device-to-host copy of the new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cosystream.cuda_graphs import CAPTURE_LOCK, capture_stream, capturing
from cosystream.engine.faults import NON_FINITE_TOKEN, mark_non_finite
from cosystream.engine.graphs import GraphCache, maybe_compile
from cosystream.kernels import decode as decode_ops
from cosystream.kernels import prefetch, triton_usable
from cosystream.kernels import reference as reference_ops
from cosystream.models.qwen2 import KVCache, SpeechLM
from cosystream.models.sampling import MAX_TOP_K, SamplingBatch, sample_tokens
from cosystream.transfers import ints_to_device, to_device

_BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512)
_LEN_BUCKETS = (256, 512, 1024, 2048, 4096, 8192)
_PREFILL_ROWS = (1, 2, 4, 8, 16)  # prompts per prefill replay (batch buckets)
_MAX_PREFILL_ROWS = _PREFILL_ROWS[-1]
_PREFILL_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 1024, 1536, 2048)


@dataclass(frozen=True)
class StepTicket:
    """A launched decode step: where its tokens land on the host, and the event that says they have."""

    host: torch.Tensor
    done: torch.cuda.Event | None


@dataclass(frozen=True)
class RowSampling:
    """Sampling settings of one stream, resolved against the model defaults."""

    seed: int
    top_p: float
    top_k: int
    win_size: int
    tau_r: float
    min_len: int
    greedy: bool = False
    forced: int = -1  # emit this token every step (-1: sample)
    ban_special: bool = False  # benchmark mode: no stop class may be drawn before min_len


class LMRunner:
    def __init__(self, lm: SpeechLM, max_slots: int, max_len: int, use_graphs: bool = True,
                 compile: bool = False, fused_kernels: bool = True, l2_prefetch_mb: float | None = None) -> None:
        param = next(lm.parameters())
        self.lm, self.device, self.dtype = lm, param.device, param.dtype
        self.dims = lm.dims
        self.max_slots, self.max_len = max_slots, max_len
        self.cache = KVCache(self.dims, max_slots, max_len, self.device, self.dtype)
        self.window = max(lm.dims.win_size, 1)
        self.eos = lm.dims.eos_token
        self._alloc_state(max_slots)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self._forward = maybe_compile(lm.forward, compile)
        self._sample = maybe_compile(sample_tokens, compile)
        # The decode step goes through the fused-op path: Triton kernels on CUDA, their torch statements
        # elsewhere (the same structure runs in CI); fused_kernels=False keeps the unfused forward.
        self.fused = fused_kernels and not compile
        self.l2_prefetch_mb = l2_prefetch_mb  # the decode step's L2 prefetch window (None: the kernels' default)
        self.ops = decode_ops if triton_usable(self.device) else reference_ops
        # PERF: on CUDA everything after the head (sampling, the non-finite check, the row-state update)
        # is one Triton kernel instead of ~190 small ones (cosystream.kernels.sample)
        self.fused_sampler = self.fused and triton_usable(self.device)
        lm.rope_table(max_len, self.device)  # built outside any graph capture
        # the LM's graphs replay beside token-to-wave's (overlap): captured on a stream of their own
        self.capture_stream = capture_stream(self.device)
        self.prefill_graphs = GraphCache(self._prefill_core, self.device, self.use_graphs,
                                         stream=self.capture_stream)
        self.batch_buckets = [b for b in _BATCH_BUCKETS if b < max_slots] + [max_slots]
        self.len_buckets = [n for n in _LEN_BUCKETS if n < max_len] + [max_len]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._host_tokens = torch.zeros(2, max_slots, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._flip = 0
        self._done_events = [torch.cuda.Event() for _ in range(2)] if self.device.type == "cuda" else []

    def _alloc_state(self, n: int) -> None:
        z = dict(device=self.device)
        self.tokens = torch.zeros(n, dtype=torch.int64, **z)  # last emitted token (next input)
        self.positions = torch.zeros(n, dtype=torch.int64, **z)  # where the next input is written
        self.out = torch.zeros(n, dtype=torch.int64, **z)
        self.active = torch.zeros(n, dtype=torch.bool, **z)  # rows whose state a decode step advances
        self.all_rows = torch.ones(n, dtype=torch.bool, **z)  # a prefill records the first token of its rows
        self.sampling = SamplingBatch(
            seeds=torch.zeros(n, dtype=torch.int64, **z), steps=torch.zeros(n, dtype=torch.int64, **z),
            min_len=torch.zeros(n, dtype=torch.int64, **z), top_p=torch.ones(n, **z),
            top_k=torch.ones(n, dtype=torch.int64, **z), repeat_threshold=torch.ones(n, **z),
            window=torch.ones(n, dtype=torch.int64, **z),
            history=torch.full((n, self.window), -1, dtype=torch.int64, **z),
            forced=torch.full((n,), -1, dtype=torch.int64, **z), greedy=torch.zeros(n, dtype=torch.bool, **z),
            ban_special=torch.zeros(n, dtype=torch.bool, **z))

    def _rows(self, start: int, stop: int) -> SamplingBatch:
        s = self.sampling
        return SamplingBatch(*(getattr(s, f)[start:stop] for f in SamplingBatch.__dataclass_fields__))

    # ------------------------------------------------------------------ per-stream setup
    def set_row_sampling(self, slot: int, rs: RowSampling) -> None:
        s = self.sampling
        s.seeds[slot], s.steps[slot], s.min_len[slot] = rs.seed, 0, rs.min_len
        s.top_p[slot], s.top_k[slot] = rs.top_p, rs.top_k
        s.repeat_threshold[slot], s.window[slot] = rs.win_size * rs.tau_r, min(rs.win_size, self.window)
        s.history[slot] = -1
        s.forced[slot], s.greedy[slot], s.ban_special[slot] = rs.forced, rs.greedy, rs.ban_special

    @torch.inference_mode()
    def prefill(self, slot: int, embeds: torch.Tensor, start_pos: int = 0) -> int:
        """Feed embeds [n, d] at positions [start_pos, start_pos + n) of `slot`, sample the next token
        with the row's settings, and leave the row ready to decode. Returns the token (host int)."""
        n = embeds.shape[0]
        if start_pos + n >= self.max_len:
            raise ValueError(f"prompt of {start_pos + n} positions exceeds max_len {self.max_len}")
        if self.use_graphs and start_pos == 0:
            return self._prefill_graphed(slot, embeds)
        slots = ints_to_device([slot], self.device)
        x = to_device(embeds, self.device, self.dtype).unsqueeze(0)
        if start_pos == 0:
            h = self._fresh(x, slots)[:, -1]
        else:  # an extension (text streamed in after the prompt) attends over what the cache holds
            start = ints_to_device([start_pos], self.device)
            h = self._forward(x, start, self.cache, attn_len=start_pos + n, slots=slots)[:, -1]
        logp = self.lm.logp(h)
        token = self._sample(logp, self._rows(slot, slot + 1), self.eos)
        self._record(slice(slot, slot + 1), token, torch.ones(1, dtype=torch.bool, device=self.device))
        self.positions[slot] = start_pos + n
        return int(mark_non_finite(logp, token)[0])

    def _prefill_graphed(self, slot: int, embeds: torch.Tensor) -> int:
        return self._prefill_padded([(slot, embeds)])[0]

    @torch.inference_mode()
    def prefill_many(self, items: list[tuple[int, torch.Tensor]]) -> list[int]:
        """Prefill several new streams from position 0: items are (slot, embeds [n, d]). Returns each
        stream's first token (host ints), as `prefill` would.

        PERF: prompts of one padded length bucket run as one graph replay of up to _MAX_PREFILL_ROWS rows
        (16 prompts of a burst cost ≈ one prompt, not sixteen); the padding sits after each prompt, so
        causal attention never lets the prompt see it, and its keys land at positions the stream
        overwrites before reading them. Rows padding the batch to its bucket repeat the last prompt: they
        write the same values to the same places.
        """
        for _, embeds in items:
            if embeds.shape[0] >= self.max_len:
                raise ValueError(f"prompt of {embeds.shape[0]} positions exceeds max_len {self.max_len}")
        if not self.use_graphs:
            return [self.prefill(slot, embeds) for slot, embeds in items]
        return self._prefill_padded(items)

    def _prefill_padded(self, items: list[tuple[int, torch.Tensor]]) -> list[int]:
        tokens = [0] * len(items)
        by_length: dict[int, list[int]] = {}
        for i, (_, embeds) in enumerate(items):
            by_length.setdefault(self._prefill_length(embeds.shape[0]), []).append(i)
        for padded, members in by_length.items():
            for start in range(0, len(members), _MAX_PREFILL_ROWS):
                part = members[start:start + _MAX_PREFILL_ROWS]
                for i, token in zip(part, self._prefill_batch(padded, [items[i] for i in part]), strict=True):
                    tokens[i] = token
        return tokens

    def _prefill_length(self, n: int) -> int:
        return min(next(b for b in _PREFILL_BUCKETS + (self.max_len,) if b >= n), self.max_len)

    def _prefill_batch(self, padded: int, items: list[tuple[int, torch.Tensor]]) -> list[int]:
        count = len(items)
        rows = next(b for b in _PREFILL_ROWS if b >= count)
        items = items + [items[-1]] * (rows - count)
        x = torch.zeros(rows, padded, items[0][1].shape[1], device=self.device, dtype=self.dtype)
        for r, (_, embeds) in enumerate(items):
            x[r, :embeds.shape[0]] = to_device(embeds, self.device, self.dtype)
        slots = [slot for slot, _ in items]
        # the rows that sample: each slot once (padding rows repeat the last prompt), -1 for the others
        sampling = [slot if slot not in slots[:r] else -1 for r, slot in enumerate(slots)]
        slot_t, last_t, sample_t = torch.tensor(
            [slots, [embeds.shape[0] - 1 for _, embeds in items], sampling], device=self.device)
        key = (rows, padded)
        if key not in self.prefill_graphs.graphs:
            # capturing also runs the step (warm-up + replay): undo what that did to the rows' state
            saved = [t.clone() for t in self._state_tensors()]
            self.prefill_graphs.run(key, [x, slot_t, last_t, sample_t])
            for t, old in zip(self._state_tensors(), saved, strict=True):
                t.copy_(old)
        (token,) = self.prefill_graphs.run(key, [x, slot_t, last_t, sample_t])
        return token.tolist()[:count]

    def _prefill_core(self, x: torch.Tensor, slot: torch.Tensor, last: torch.Tensor, sample_rows: torch.Tensor
                      ) -> tuple[torch.Tensor]:
        """Graph body: prompts x [B, n, d] into cache rows `slot` [B], each row's first token drawn from its
        last position `last` [B] into the state of rows `sample_rows` (the slots, -1 where a row repeats
        one: padding). Returns each row's token (NON_FINITE_TOKEN for non-finite logits)."""
        rows, _, width = x.shape
        h = self._fresh(x, slot)
        h = h.gather(1, last.view(rows, 1, 1).expand(rows, 1, width)).squeeze(1)  # each row's last position
        if self.fused_sampler:
            return (self._first_tokens_fused(h, slot, last, sample_rows),)
        s = self.sampling
        picked = SamplingBatch(*(getattr(s, f).index_select(0, slot) for f in SamplingBatch.__dataclass_fields__))
        logp = self.lm.logp(h)
        token = self._sample(logp, picked, self.eos)
        self.tokens.index_copy_(0, slot, token)
        self.out.index_copy_(0, slot, token)
        s.steps.index_copy_(0, slot, picked.steps + 1)
        s.history.index_copy_(0, slot, torch.cat([picked.history[:, 1:], token.unsqueeze(1)], dim=1))
        self.positions.index_copy_(0, slot, last + 1)
        return (mark_non_finite(logp, token),)

    def _first_tokens_fused(self, h: torch.Tensor, slot: torch.Tensor, last: torch.Tensor,
                            sample_rows: torch.Tensor) -> torch.Tensor:
        """The prefill's tail as the decode step's: the head, then one kernel that samples each new row and
        records it (next input, step count, history, position = prompt length). PERF: the torch sampler
        and the row updates are ~150 small kernels in the prefill graph."""
        from cosystream.kernels import sample  # Triton is imported only where it runs

        head = self.lm.llm_decoder
        logits = self.ops.linear(h, head.weight, head.bias, partials=False)
        self.positions.index_copy_(0, slot, last)  # the kernel writes position + 1: the prompt's length
        s = self.sampling
        sample.sample_and_record(
            logits, s.seeds, s.steps, s.min_len, s.top_p, s.top_k, s.repeat_threshold, s.window, s.history,
            s.forced, s.greedy, s.ban_special, self.all_rows, self.tokens, self.positions, self.out, eos=self.eos,
            max_top_k=MAX_TOP_K, max_position=self.max_len - 1, non_finite_token=NON_FINITE_TOKEN, rows=sample_rows)
        return self.out.index_select(0, slot)

    def _fresh(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Hidden states of new prompts x [B, n, d] written from position 0 into cache rows `slots`."""
        if self.fused:
            return self.lm.prefill(x, slots, self.cache, self.ops)
        zero = torch.zeros(x.shape[0], device=self.device, dtype=torch.long)
        return self._forward(x, zero, self.cache, attn_len=x.shape[1], slots=slots)

    def _record(self, rows: slice, token: torch.Tensor, active: torch.Tensor) -> None:
        # Rows that are not decoding (free, parked for text) keep their state untouched.
        s = self.sampling
        self.out[rows] = token
        self.tokens[rows] = torch.where(active, token, self.tokens[rows])
        s.steps[rows] += active.long()
        rolled = torch.cat([s.history[rows][:, 1:], token.unsqueeze(1)], dim=1)
        s.history[rows] = torch.where(active.unsqueeze(1), rolled, s.history[rows])

    def set_active(self, slot: int, active: bool) -> None:
        self.active[slot] = active

    def set_min_len(self, slot: int, min_len: int) -> None:
        self.sampling.min_len[slot] = min_len

    def override_last_token(self, slot: int, token: int) -> None:
        """The host replaced a sampled token (bistream's forced FILL): keep the RAS window truthful."""
        self.sampling.history[slot, -1] = token
        self.tokens[slot] = token

    # ------------------------------------------------------------------ decode
    def bucket_for(self, num_rows: int, max_position: int) -> tuple[int, int]:
        b = next(b for b in self.batch_buckets if b >= num_rows)
        n = next(n for n in self.len_buckets if n > max_position)
        return b, n

    def _step(self, b: int, attn_len: int) -> None:
        emb = self.lm.speech_embedding(self.tokens[:b])
        if self.fused:
            window = self.l2_prefetch_mb if b <= prefetch.MAX_ROWS else 0.0
            h = self.lm.decode(emb, self.positions[:b], self.cache, attn_len, self.ops, window)
        else:
            h = self._forward(emb.unsqueeze(1), self.positions[:b], self.cache, attn_len=attn_len)[:, -1]
        if self.fused_sampler:
            head = self.lm.llm_decoder
            self._sample_and_record_fused(self.ops.linear(h, head.weight, head.bias, partials=False), b)
            return
        logp = self.lm.logp(h)
        token = self._sample(logp, self._rows(0, b), self.eos)
        active = self.active[:b]
        self._record(slice(0, b), token, active)
        self.out[:b] = mark_non_finite(logp, token)  # a row's fault reaches the host with its token
        # Inactive rows wrote garbage K/V at their next free position; it is overwritten before it is read.
        self.positions[:b] = torch.clamp(self.positions[:b] + active.long(), max=self.max_len - 1)

    def _sample_and_record_fused(self, logits: torch.Tensor, b: int) -> None:
        from cosystream.kernels import sample  # Triton is imported only where it runs

        s = self._rows(0, b)
        sample.sample_and_record(
            logits, s.seeds, s.steps, s.min_len, s.top_p, s.top_k, s.repeat_threshold, s.window, s.history,
            s.forced, s.greedy, s.ban_special, self.active[:b], self.tokens[:b], self.positions[:b], self.out[:b],
            eos=self.eos, max_top_k=MAX_TOP_K, max_position=self.max_len - 1, non_finite_token=NON_FINITE_TOKEN)

    @torch.inference_mode()
    def decode(self, num_rows: int, max_position: int) -> list[int]:
        """One step for rows [0, num_rows): returns each row's new token (host ints)."""
        return self.collect(self.launch(num_rows, max_position))

    @torch.inference_mode()
    def launch(self, num_rows: int, max_position: int) -> StepTicket:
        """Queue one step for rows [0, num_rows) (no row past `max_position`) and the copy of its tokens
        to the host; `collect` waits for them. PERF: the next step can be queued before this one's
        tokens are read (its inputs never leave the GPU), so the host's bookkeeping hides behind it."""
        b, attn_len = self.bucket_for(num_rows, max_position)
        if self.use_graphs:
            graph = self.graphs.get((b, attn_len)) or self._capture(b, attn_len)
            graph.replay()
        else:
            self._step(b, attn_len)
        self._flip ^= 1  # two host buffers: a step's tokens stay readable while the next one is queued
        host = self._host_tokens[self._flip, :num_rows]
        host.copy_(self.out[:num_rows], non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = self._done_events[self._flip]
            done.record()
        return StepTicket(host, done)

    @staticmethod
    def collect(ticket: StepTicket) -> list[int]:
        """The tokens of a launched step (waits for the GPU to reach it)."""
        if ticket.done is not None:
            ticket.done.synchronize()
        return ticket.host.tolist()

    def _capture(self, b: int, attn_len: int) -> torch.cuda.CUDAGraph:
        # Capturing runs the step twice: keep every row's small state; the K/V it writes lands at the
        # rows' next free positions, which real steps overwrite before anything reads them.
        saved = [t.clone() for t in self._state_tensors()]
        with CAPTURE_LOCK:
            graph = self._capture_unguarded(b, attn_len)
        for t, old in zip(self._state_tensors(), saved, strict=True):
            t.copy_(old)
        return graph

    def _state_tensors(self) -> list[torch.Tensor]:
        return [self.tokens, self.positions, self.out] + [getattr(self.sampling, f)
                                                          for f in SamplingBatch.__dataclass_fields__]

    def _capture_unguarded(self, b: int, attn_len: int) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(b, attn_len)  # warm-up outside the graph (allocator, kernels selection)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self._pool, self.capture_stream):
            self._step(b, attn_len)
        self._pool = graph.pool()
        self.graphs[(b, attn_len)] = graph
        return graph

    def capture_prefill(self, slot: int, max_positions: int = 512) -> int:
        """Capture the batched prefill graphs for prompts up to `max_positions` (server warm-up), working
        in `slot`, which must be free (its rows are overwritten). Returns the prefill graph count."""
        if not self.use_graphs:
            return 0
        width = self.lm.dims.hidden_size
        for padded in (n for n in _PREFILL_BUCKETS if n <= max_positions):
            for rows in _PREFILL_ROWS:
                if (rows, padded) not in self.prefill_graphs.graphs:
                    self._prefill_batch(padded, [(slot, torch.zeros(padded - 1, width, device=self.device))] * rows)
        return len(self.prefill_graphs.graphs)

    def capture_all(self, max_position: int | None = None) -> int:
        """Capture every (batch, length) bucket up front (server warm-up); returns the graph count."""
        if not self.use_graphs:
            return 0
        for n in self.len_buckets:
            if max_position is not None and n > max(max_position, self.len_buckets[0]):
                break
            for b in self.batch_buckets:
                if (b, n) not in self.graphs:
                    self._capture(b, n)
        return len(self.graphs)
