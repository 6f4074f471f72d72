"""What a new recording costs before its first audio, for admission: its analysis and the flow's pass over it.

A request that brings a recording the engine has not analysed waits for the prompt analysis (speech tokens,
x-vector, prompt mel; engine/prompt_batcher.py runs it in batches, one batch at a time) before its LM can
start, and its stream's opening runs the flow over the new prompt (a prompt pass, worker time that delays
every chunk behind it). `PromptCosts` measures both as a fixed cost per batch plus a cost per prompt;
`PromptBacklog` is what waits for the analysis when a newcomer arrives; `analysis_ends` predicts when each
recording in line is analysed. Written by the analysis thread and the engine thread, read by admission
(floats: safe in CPython).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from cosystream.engine.costs import _PhaseLine


@dataclass(frozen=True, slots=True)
class PromptBacklog:
    """The prompt analysis as a newcomer finds it (times from time.perf_counter)."""

    new_recording: bool = False  # the newcomer brings a recording the engine has not analysed
    queued: int = 0  # recordings of earlier requests waiting for the analysis
    running: int = 0  # ... in the batch analysed now
    running_since_s: float | None = None  # when that batch started
    max_batch: int = 16  # recordings per analysis batch

    @property
    def waiting(self) -> int:
        """Recordings in line for the analysis, the newcomer's included."""
        return self.running + self.queued + int(self.new_recording)


class PromptCosts:
    """Measured seconds of a prompt-analysis batch and of a phase of prompt passes, each fixed + per prompt.
    Unmeasured: 0 (admission then predicts as before either was seen)."""

    def __init__(self) -> None:
        self._analysis = _PhaseLine()
        self._passes = _PhaseLine()
        self._lock = threading.Lock()  # two writers: the analysis thread and the engine thread

    def observe_analysis(self, prompts: int, seconds: float) -> None:
        with self._lock:
            self._analysis.observe(prompts, seconds)

    def observe_passes(self, prompts: int, seconds: float) -> None:
        with self._lock:
            self._passes.observe(prompts, seconds)

    def analysis_s(self, prompts: int) -> float:
        return self._analysis.seconds(prompts)

    def passes_s(self, prompts: int) -> float:
        return self._passes.seconds(prompts)


def analysis_ends(backlog: PromptBacklog, costs: PromptCosts, now: float) -> list[float]:
    """When each recording in line is analysed: the running batch's, then the queued ones and the newcomer's
    (last), in batches of `max_batch` run one after another as the batcher forms them."""
    ends: list[float] = []
    start = now
    if backlog.running > 0:
        since = now if backlog.running_since_s is None else backlog.running_since_s
        start = max(now, since + costs.analysis_s(backlog.running))
        ends += [start] * backlog.running
    line = backlog.queued + int(backlog.new_recording)
    size = max(1, backlog.max_batch)
    for first in range(0, line, size):
        count = min(size, line - first)
        start += costs.analysis_s(count)
        ends += [start] * count
    return ends
