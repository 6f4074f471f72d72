"""Whole-utterance passes of the flow pool: the official final call and the recomputed streaming call.

These passes run from frame 0 over prompt + every target token and attend to their own keys
(`PooledKV.own_keys`) with causal-conv tails from zero, so they read no pool slot: a stream gives its slot
back as soon as only its final pass is left, and a stream longer than its slot still gets every chunk
graphed. The official final call (full attention, finalizing encoder) runs as a `FinalPass`: one encoder
graph, then one graph replay per Euler step, so a batch of them can pause between steps and go on later.
Streams padded to one length (a multiple of LEN_BUCKET frames) share a replay, at most REPLAY_ROWS of them.

`WholePasses` is a part of `FlowRunner` (engine/flow_runner.py): it uses the runner's flow, pool, graph
caches, fused ops and step times.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cosystream.cuda_graphs import bucket
from cosystream.engine.graphs import REPLAY_ROWS, GraphCache
from cosystream.models.estimator import PooledKV, StepTimes
from cosystream.models.flow import UPSAMPLE
from cosystream.models.flow_stream import PromptCache

if TYPE_CHECKING:
    from types import ModuleType

    from cosystream.engine.stopwatch import Stopwatch
    from cosystream.models.cfm import CausalConditionalCFM
    from cosystream.models.flow import Flow

LEN_BUCKET = 128  # frames are rounded up to a multiple of this (fewer graphs, little waste)


@dataclass
class FinalPass:
    """Official final passes of a batch of streams (one padded length) in progress: the ODE state and the
    estimator's CFG inputs, owned here, so the pass can stop after any Euler step and go on later while
    other batches replay the same graphs. It reads no pool slot (own keys, conv tails from zero)."""

    key: tuple[int, int]  # (batch bucket, padded frames): the graphs it replays
    x: torch.Tensor  # [rows, 80, padded] float32
    mu: torch.Tensor  # [2·rows, 80, padded], CFG rows, model dtype
    spks: torch.Tensor  # [2·rows, 80]
    cond: torch.Tensor  # [2·rows, 80, padded]
    frames: torch.Tensor  # [rows] each row's frames (device)
    lengths: list[int]  # the same, on the host
    num_steps: int
    step: int = 0

    @property
    def done(self) -> bool:
        return self.step >= self.num_steps

    def mel(self, row: int) -> torch.Tensor:
        """Row's mel [80, frames] (prompt frames included); valid once done."""
        return self.x[row, :, :self.lengths[row]]


class WholePasses:
    """The whole-utterance passes of a `FlowRunner`."""

    # the runner's, set in FlowRunner.__init__
    flow: Flow
    cfm: CausalConditionalCFM
    device: torch.device
    dtype: torch.dtype
    kv: torch.Tensor
    chunk: int
    attention_ops: ModuleType
    solver_ops: ModuleType | None
    step_times: list[StepTimes] | None
    final_times: tuple[torch.Tensor, torch.Tensor] | None
    step_index: torch.Tensor
    t_steps: torch.Tensor
    dt_steps: torch.Tensor
    final_encoder_graphs: GraphCache
    final_step_graphs: GraphCache
    recompute_graphs: GraphCache
    watch: Stopwatch
    _step: Callable[..., torch.Tensor]

    def capture_full(self, num_frames: int, batch: int = 1) -> None:
        """Capture the final pass's graphs (its encoder; one Euler step) for `batch` streams of `num_frames`
        (prompt included); padding rows only."""
        rows, padded = bucket(batch), self._full_length(num_frames)
        if not self.final_step_graphs.enabled or (rows, padded) in self.final_step_graphs.graphs:
            return
        self.final_step(self.begin_final(padded, [], rows=rows))

    def _full_length(self, num_frames: int) -> int:
        """Frames a final pass is padded to (even: whole tokens). Not capped by the slot: the pass attends
        to its own keys, so a stream that outgrew its slot still gets its final call graphed and batched."""
        return -(-num_frames // LEN_BUCKET) * LEN_BUCKET

    @torch.inference_mode()
    def full_pass(self, prompt: PromptCache, target_ids: torch.Tensor) -> torch.Tensor | None:
        """The official final call (full attention, zero look-ahead) over prompt + every target token.
        Returns mel [80, F] (prompt frames included), or None when it is longer than the official noise
        table (the caller then runs it eagerly)."""
        return self.full_passes([(prompt, target_ids)])[0]

    @torch.inference_mode()
    def full_passes(self, items: Sequence[tuple[PromptCache, torch.Tensor]]) -> list[torch.Tensor | None]:
        """Final calls of several streams, items (prompt, target ids), run to the end (`begin_finals`)."""
        begun = self.begin_finals(items)
        out: list[torch.Tensor | None] = []
        for item in begun:
            if item is None:
                out.append(None)
                continue
            final, row = item
            self.finish_final(final)
            out.append(final.mel(row))
        return out

    @torch.inference_mode()
    def begin_finals(self, items: Sequence[tuple[PromptCache, torch.Tensor]]) -> list[tuple[FinalPass, int] | None]:
        """Start the official final calls of several streams, items (prompt, target ids): streams padded to
        the same length share a FinalPass (its encoder has run, no Euler step yet). Returns each item's
        (pass, row), or None for a stream longer than the official noise table."""
        out: list[tuple[FinalPass, int] | None] = [None] * len(items)
        frames = [UPSAMPLE * (prompt.prompt_tokens.shape[0] + ids.shape[0]) for prompt, ids in items]
        fits = [i for i, n in enumerate(frames) if n <= self.cfm.rand_noise.shape[-1]]
        for padded, members in self._by_padded_length(fits, frames):
            final = self.begin_final(padded, [items[i] for i in members])
            for row, i in enumerate(members):
                out[i] = (final, row)
        self.watch.lap("final_setup")
        return out

    def begin_final(self, padded: int, items: Sequence[tuple[PromptCache, torch.Tensor]],
                    rows: int | None = None) -> FinalPass:
        """PERF: the finalizing encoder of every stream (padded to the batch's length, masked) as one graph
        replay per (batch bucket, padded length); rows past the items (at least `rows`) are padding."""
        rows = bucket(max(len(items), rows or 1))
        ids = torch.zeros(rows, padded // UPSAMPLE, dtype=torch.long, device=self.device)
        valid = torch.full((rows,), padded // UPSAMPLE, device=self.device, dtype=torch.long)
        lengths = []
        for j, (prompt, target) in enumerate(items):
            all_ids = _all_ids(prompt, target)
            ids[j, :all_ids.shape[0]] = all_ids
            valid[j] = all_ids.shape[0]
            lengths.append(UPSAMPLE * all_ids.shape[0])
        z, cond, spks = self._whole_pass_inputs(
            padded, rows, [(prompt, n) for (prompt, _), n in zip(items, lengths, strict=True)])
        mu, spks, cond = self.final_encoder_graphs.run((rows, padded), [ids, valid, spks, cond])
        # graph outputs are overwritten by the next replay of this shape: the pass keeps its own
        return FinalPass((rows, padded), z, mu.clone(), spks.clone(), cond.clone(), UPSAMPLE * valid, lengths,
                         self.cfm.num_steps)

    @torch.inference_mode()
    def final_step(self, final: FinalPass) -> None:
        """One Euler step of a final pass (one graph replay)."""
        (x,) = self.final_step_graphs.run(final.key, [final.x, final.mu, final.spks, final.cond, final.frames,
                                                     self.step_index[final.step:final.step + 1]])
        final.x.copy_(x)
        final.step += 1

    @torch.inference_mode()
    def finish_final(self, final: FinalPass) -> None:
        """The Euler steps a final pass has left."""
        # every stream of a batched pass asks for it; the first runs it: only that one counts as a call
        tag = None if final.done else f"final_{len(final.lengths)}x{final.key[1]}"
        while not final.done:
            self.final_step(final)
        self.watch.lap("final_pass", tag=tag)

    def _final_encode_core(self, ids, valid, spks, cond) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The official final call's finalizing encoder, and its inputs as the estimator's CFG rows."""
        return self.cfm.cfg_inputs(self.flow.encode_padded(ids, valid), spks, cond)

    def _final_step_core(self, x, mu, spks, cond, frames, step) -> tuple[torch.Tensor]:
        """Euler step `step` ([1] int64) of the official final call: full attention over each row's first
        `frames` frames (padding frames come after them: the causal convs never carry them backwards).
        With the fused ODE tail the estimator's final projection, the CFG mix and the update are one op."""
        fused = self.solver_ops
        velocity = self._whole_pass_velocity(frames, x.shape[-1], chunk=0, project=fused is None,
                                             times=lambda _: self._final_step_times(step))
        t = self.t_steps.index_select(0, step).expand(2 * x.shape[0]) if self.final_times is None else None
        out = velocity(0, self.cfm.cfg_rows(x), mu, spks, cond, t)
        dt = self.dt_steps.index_select(0, step)
        if fused is None:
            return (self.cfm.euler_step(x, out, dt[0]),)
        proj = self.cfm.estimator.final_proj
        return (fused.project_cfg_euler(out, proj.weight, proj.bias, x, dt, self.cfm.cfg_rate)[0],)

    def _final_step_times(self, step: torch.Tensor) -> StepTimes | None:
        """The StepTimes of Euler step `step` ([1] int64, on the device) from `final_times` (None without
        constant step times: the estimator then embeds t row by row)."""
        if self.final_times is None:
            return None
        t_emb, resnet = self.final_times
        resnet_step = resnet.index_select(0, step)
        return StepTimes(t_emb.index_select(0, step), tuple(resnet_step.split(self.cfm.estimator.dims.channels, dim=1)))

    def _by_padded_length(self, indices: Sequence[int], frames: Sequence[int]) -> list[tuple[int, list[int]]]:
        """Whole-utterance passes grouped by the length they are padded to, at most REPLAY_ROWS streams
        per group (one graph replay each: a larger batch bucket would capture a graph mid-traffic)."""
        groups: dict[int, list[int]] = {}
        for i in indices:
            groups.setdefault(self._full_length(frames[i]), []).append(i)
        return [(padded, members[k:k + REPLAY_ROWS]) for padded, members in groups.items()
                for k in range(0, len(members), REPLAY_ROWS)]

    def _whole_pass_inputs(self, padded: int, rows: int, items: Sequence[tuple[PromptCache, int]]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(z, cond, spks) of a padded batch of `rows` whole-utterance passes from frame 0; items are
        (prompt, frames); rows past the items are padding."""
        bins, dev = self.cfm.num_bins, self.device
        z = torch.zeros(rows, bins, padded, device=dev)
        cond = torch.zeros(rows, bins, padded, device=dev, dtype=self.dtype)
        spks = torch.zeros(rows, bins, device=dev, dtype=self.dtype)
        for j, (prompt, frames) in enumerate(items):
            z[j, :, :frames] = self.cfm.noise(0, frames)[0].to(dev)
            cond[j, :, :prompt.prompt_mel.shape[0]] = prompt.prompt_mel.T
            spks[j] = prompt.spks
        return z, cond, spks

    def recompute(self, prompt: PromptCache, target_ids: torch.Tensor, finalize: bool) -> torch.Tensor:
        """`recompute_many` for one stream."""
        return self.recompute_many([(prompt, target_ids, finalize)])[0]

    @torch.inference_mode()
    def recompute_many(self, items: Sequence[tuple[PromptCache, torch.Tensor, bool]]) -> list[torch.Tensor]:
        """The official streaming call (spec/streaming.md §2: chunk masks) over prompt + target ids, every
        frame recomputed as the official code does at each chunk: for streams whose next chunk would
        outgrow their slots. No keys are kept and no slot
        is read, so it needs no memory beyond the pass's own, and it costs one graphed pass of the
        stream's length (encoder and ODE) instead of the eager path's Python launches. items: (prompt,
        target ids, finalize); finalize=False: the last 3 target ids are look-ahead. Streams padded to
        one length share one graph replay. Returns mel [80, F] each (prompt frames included)."""
        lookahead = self.flow.dims.pre_lookahead_len
        frames = [UPSAMPLE * (prompt.prompt_tokens.shape[0] + ids.shape[0] - (0 if finalize else lookahead))
                  for prompt, ids, finalize in items]
        out: list[torch.Tensor | None] = [None] * len(items)
        for padded, members in self._by_padded_length(range(len(items)), frames):
            mels = self._recompute_batch(padded, [items[i] for i in members])
            for i, mel in zip(members, mels, strict=True):
                out[i] = mel
        self.watch.lap("recompute")
        return out  # type: ignore[return-value]

    def _recompute_batch(self, padded: int, items: Sequence[tuple[PromptCache, torch.Tensor, bool]]
                         ) -> list[torch.Tensor]:
        """PERF: the streaming encoder of every stream (padded, masked to its own tokens) and the ODE as one
        graph replay per (batch bucket, padded length); run eagerly per stream, the encoder alone costs
        ≈ 40 ms of Python launches per long stream on the H100's host."""
        lookahead = self.flow.dims.pre_lookahead_len
        rows = bucket(len(items))
        ids = torch.zeros(rows, padded // UPSAMPLE + lookahead, dtype=torch.long, device=self.device)
        valid = torch.full((rows,), ids.shape[1], device=self.device, dtype=torch.long)
        positions = torch.full((rows,), padded // UPSAMPLE, device=self.device, dtype=torch.long)
        lengths = []
        for j, (prompt, target, finalize) in enumerate(items):
            all_ids = _all_ids(prompt, target)
            num_positions = all_ids.shape[0] - (0 if finalize else lookahead)
            ids[j, :all_ids.shape[0]] = all_ids
            valid[j] = all_ids.shape[0]
            positions[j] = num_positions
            lengths.append(UPSAMPLE * num_positions)  # from the host's int: reading positions back would sync
        z, cond, spks = self._whole_pass_inputs(
            padded, rows, [(prompt, n) for (prompt, _, _), n in zip(items, lengths, strict=True)])
        self.watch.lap("recompute_setup")
        (x,) = self.recompute_graphs.run((rows, padded), [ids, valid, positions, z, spks, cond])
        return [x[j, :, :n].clone() for j, n in enumerate(lengths)]

    def _recompute_core(self, ids, valid, positions, z, spks, cond) -> tuple[torch.Tensor]:
        """A streaming pass from frame 0 over each row's first 2·positions frames: the chunk-masked encoder
        (tokens past a row's positions up to valid are its look-ahead), then chunk-masked attention to its
        own keys (padding frames come after a row's frames)."""
        mu = self.flow.encode_padded(ids, valid, streaming=True, positions=positions)[:, :, :z.shape[-1]]
        velocity = self._whole_pass_velocity(
            UPSAMPLE * positions, z.shape[-1], self.chunk, project=self.solver_ops is None,
            times=lambda k: self.step_times[k] if self.step_times is not None else None)
        return (self.cfm.solve(z, mu, spks, cond, velocity, fused=self.solver_ops),)

    def _whole_pass_velocity(self, frames: torch.Tensor, num_frames: int, chunk: int, project: bool,
                             times: Callable[[int], StepTimes | None]):
        """The estimator's velocity for a whole-utterance pass from frame 0 of rows [B] each `frames` long
        (graph body): attention over its own keys (chunk masks when chunk > 0), causal-conv tails from zero
        at every Euler step (the official left padding). It touches no pool slot. project=False: it returns
        the hidden state for a fused ODE tail; times(k): Euler step k's StepTimes (None: from t)."""
        est = self.cfm.estimator
        rows = 2 * frames.shape[0]
        write_pos = torch.arange(num_frames, device=frames.device).repeat(rows, 1)
        limits = frames.repeat_interleave(2)
        own = torch.arange(rows, device=frames.device)  # row r attends to its own keys (PooledKV.own_keys)

        def velocity(k: int, x, mu_in, spks_in, cond_in, t):
            conv = torch.zeros(rows, est.conv_state_channels, 2, device=x.device, dtype=self.dtype)
            keys = PooledKV(self.kv[0], own, write_pos, limits, chunk, num_frames, self.attention_ops, own_keys=True)
            return self._step(x, mu_in, spks_in, cond_in, t, [keys], conv, write_pos, [], times=times(k),
                              project=project)

        return velocity


def _all_ids(prompt: PromptCache, target_ids: torch.Tensor) -> torch.Tensor:
    """Prompt + target speech token ids [P + N] (int64, on the prompt's device)."""
    return torch.cat([prompt.prompt_tokens, target_ids.to(prompt.prompt_tokens.device, torch.long)])
