"""Warm-up: the token-to-wave phase costs the scheduler's admission predicts from, measured on this device.

A flow call (and its vocoder call) costs nearly as much for one chunk as for sixteen, so the cost model
keeps each kind of phase as a fixed cost per call plus a cost per chunk (scheduler.CostModel). Before any
request ran it knows neither; `measure_phases` opens streams of a neutral prompt (silence: the cost does not
depend on the values), voices their first chunk and the chunk after it in batches of one and of many, and
feeds each phase's time to the cost model as the worker's own phases are fed later. Runs on the engine
thread (through EngineCore.call) while nothing else uses the flow.
"""

from __future__ import annotations

import time

import torch

from cosystream.config import ChunkSchedule
from cosystream.engine import runners
from cosystream.engine.chunking import ChunkPlanner
from cosystream.engine.costs import CostModel
from cosystream.frontend.prompt import ModelInputs

CALIBRATION_PROMPT_TOKENS = 150  # the prompt length the warm-up captures graphs for
CALIBRATION_TOKENS = 250  # target tokens of a calibration stream (the standard utterance)


def neutral_inputs(prompt_tokens: int, mel_bins: int, speaker_dims: int) -> ModelInputs:
    """A zero-shot segment's inputs with a silent prompt of `prompt_tokens` speech tokens."""
    return ModelInputs(mode="zero_shot", text_ids=torch.zeros(0, dtype=torch.int32),
                       xvector=torch.zeros(speaker_dims), flow_prompt_speech_tokens=torch.zeros(
                           prompt_tokens, dtype=torch.int32), prompt_mel=torch.zeros(2 * prompt_tokens, mel_bins))


def measure_phases(t2w: runners.Token2WavRunner, cost: CostModel, inputs: ModelInputs, schedule: ChunkSchedule,
                   block: int, sizes: tuple[int, ...] = (1, 16), repeats: int = 2,
                   num_tokens: int = CALIBRATION_TOKENS) -> dict[tuple[str, int], float]:
    """Time phases of `n` first chunks and of the `n` chunks after them for each n in `sizes` (bounded by
    the free flow slots) in streams of `num_tokens` target tokens, the last of `repeats` runs (the first
    may capture graphs), and feed them to `cost`. Returns {(kind, n): seconds}."""
    free = t2w.free_slots()
    measured: dict[tuple[str, int], float] = {}
    prompt_len = int(inputs.flow_prompt_speech_tokens.shape[0])
    tokens = [0] * num_tokens
    for n in sorted({min(size, free) if free is not None else size for size in sizes} - {0}):
        for _ in range(repeats):
            states = [t2w.start(inputs, None, key=("calibration", i), max_target_tokens=num_tokens)
                      for i in range(n)]
            t2w.opened()
            planners = [ChunkPlanner(schedule, prompt_len, block=block) for _ in range(n)]
            try:
                for kind in ("first", "chunks"):
                    plans = [planner.next_plan(len(tokens), done=False) for planner in planners]
                    if any(plan is None or plan.is_final for plan in plans):
                        break
                    t0 = time.perf_counter()
                    t2w.run([(st, tokens, plan) for st, plan in zip(states, plans, strict=True)])
                    measured[(kind, n)] = time.perf_counter() - t0
            finally:
                for st in states:
                    t2w.release(st)
    for (kind, n), seconds in measured.items():
        cost.observe_phase(kind, n, seconds)
    return measured
