"""The scheduler's cost model: what the GPU's work takes on this device, measured.

The decode step (timed at warm-up, then every step), the prefill, the tokens a segment's LM generates and
how long a stream holds its LM row and its flow slot (from the streams the engine runs), and each kind of
token-to-wave phase as a fixed cost per call plus a cost per chunk (measured at warm-up on a GPU,
engine/calibration.py, then refitted from every phase the worker runs). Written by the engine thread;
admission (engine/scheduler.py) reads it from the caller's thread.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cosystream.engine.scheduler import StreamView

# Decode-step periods longer than this are idle gaps, not steps.
_MAX_STEP_S = 0.05
# Weight kept by the phase-cost fit's past at each new phase (≈ the last 30 phases of a kind count).
PHASE_FIT_DECAY = 0.97
# Share of a phase's cost that is per call rather than per chunk, while the fit has seen one phase size
# only: on the H100 one first chunk takes 25 ms and sixteen in one call 79 ms (docs/benchmarks.md, "Where
# one stream's first audio goes"), a fixed ≈ 21 ms. Measured phases of other sizes replace it.
PRIOR_FIXED_SHARE = 0.8
# Variance of the phase sizes (chunks²) the fit needs before it trusts its own slope.
_MIN_SIZE_VARIANCE = 0.25


class _Ewma:
    def __init__(self, weight: float) -> None:
        self.weight, self.value = weight, None

    def observe(self, x: float) -> None:
        if math.isfinite(x) and x >= 0:
            self.value = x if self.value is None else self.value + self.weight * (x - self.value)


class _PhaseLine:
    """seconds = fixed + per_chunk × chunks for one kind of worker phase: an exponentially weighted
    least-squares fit of the phases seen. A flow call (and its vocoder call) costs nearly as much for one
    chunk as for sixteen, so a per-chunk average measured at one batch size is wrong at every other.
    While every phase seen had about the same size, the split between the two terms is PRIOR_FIXED_SHARE."""

    def __init__(self, decay: float = PHASE_FIT_DECAY) -> None:
        self.decay = decay
        # the weighted sums (w, wn, wnn, wy, wny) as one tuple, replaced whole: admission reads them from another
        # thread than the one that observes, and must never see half of an update
        self.sums = (0.0, 0.0, 0.0, 0.0, 0.0)

    def observe(self, chunks: int, seconds: float) -> None:
        if chunks <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        d, n = self.decay, float(chunks)
        w, wn, wnn, wy, wny = self.sums
        self.sums = (d * w + 1, d * wn + n, d * wnn + n * n, d * wy + seconds, d * wny + n * seconds)

    @property
    def measured(self) -> bool:
        return self.sums[0] > 0

    def line(self) -> tuple[float, float]:
        """(fixed seconds per phase, seconds per chunk); (0, 0) before any phase."""
        w, wn, wnn, wy, wny = self.sums
        if w <= 0:
            return 0.0, 0.0
        mean_n, mean_y = wn / w, wy / w
        var_n = wnn / w - mean_n * mean_n
        if var_n >= _MIN_SIZE_VARIANCE:
            per = (wny / w - mean_n * mean_y) / var_n
            if per >= 0:
                fixed = mean_y - per * mean_n
                if fixed >= 0:
                    return fixed, per
                return 0.0, wny / wnn  # through the origin: no negative fixed cost
        # one size seen (or a fit that makes no physical sense): the prior split of the mean phase
        fixed = PRIOR_FIXED_SHARE * mean_y
        return fixed, (mean_y - fixed) / mean_n

    def seconds(self, chunks: int) -> float:
        fixed, per = self.line()
        return fixed + per * chunks if chunks > 0 else 0.0


class CostModel:
    """Measured costs of the GPU's work on this device. Written by the engine thread only (the admission
    path reads floats, which is safe in CPython)."""

    def __init__(self) -> None:
        self._step = _Ewma(0.2)
        self._prefill = _Ewma(0.2)
        self._lm_hold = _Ewma(0.1)  # seconds a segment holds its LM row
        self._lm_tokens = _Ewma(0.1)  # speech tokens a segment's LM generates
        self._slot_hold = _Ewma(0.1)  # seconds a stream holds its flow slot (open to release)
        self._slot_tail = _Ewma(0.1)  # seconds from a slot holder's LM done to its slot back
        self._phases: dict[str, _PhaseLine] = {}  # worker seconds per phase by kind and chunks in it
        self._finals = (0.0, 0.0)  # (worker seconds, passes) of official final passes, decayed; replaced whole

    @property
    def decode_step_s(self) -> float | None:
        return self._step.value

    def observe_step(self, period_s: float) -> None:
        if period_s < _MAX_STEP_S:
            self._step.observe(period_s)

    def observe_prefill(self, seconds: float) -> None:
        self._prefill.observe(seconds)

    def observe_lm_hold(self, seconds: float) -> None:
        self._lm_hold.observe(seconds)

    def observe_lm_tokens(self, tokens: int) -> None:
        self._lm_tokens.observe(float(tokens))

    def lm_left_s(self, stream: StreamView, now: float) -> float | None:
        """When the LM of a stream that holds a row is predicted done: its tokens still to come (of its forced
        length, else of the measured tokens per segment) × the decode step now, so holds stretch as the GPU
        loads; without those, the measured row hold after it took the row. None: nothing measured."""
        expected = stream.lm_expected_tokens or self._lm_tokens.value
        if expected is not None and self._step.value is not None:
            return now + max(0.0, expected - stream.lm_tokens) * self._step.value
        if self._lm_hold.value is not None and stream.row_since_s is not None:
            return max(now, stream.row_since_s + self._lm_hold.value)
        return None

    def observe_slot_hold(self, seconds: float) -> None:
        self._slot_hold.observe(seconds)

    def observe_slot_tail(self, seconds: float) -> None:
        self._slot_tail.observe(seconds)

    def slot_tail_s(self) -> float:
        """Seconds a flow slot stays held after its stream's LM is done: the chunks still to voice and the
        wait for the worker, measured (0 before one was), so it grows as the worker's queue does."""
        return self._slot_tail.value or 0.0

    def observe_phase(self, kind: str, jobs: int, seconds: float) -> None:
        """A worker phase of `jobs` chunks of one kind ("first", "chunks", "final") took `seconds`; a paused
        phase of final passes comes with jobs=0 (its time counts towards the passes that finish later)."""
        if kind == "final":
            busy, done = self._finals
            self._finals = (0.9 * busy + seconds, 0.9 * done + jobs)
            return
        if jobs > 0:
            self._phases.setdefault(kind, _PhaseLine()).observe(jobs, seconds)

    def final_pass_s(self) -> float:
        """Worker seconds per official final pass (0 before one was measured)."""
        busy, done = self._finals
        return busy / done if done > 0 else 0.0

    def phase_s(self, kind: str, chunks: int) -> float:
        """Predicted worker seconds of a phase of `chunks` chunks of `kind` ("first", "chunks", "final");
        an unmeasured chunk kind borrows the other's line (0 before either was measured)."""
        if kind == "final":
            return self.final_pass_s() * chunks
        fixed, per = self.phase_line(kind)
        return fixed + per * chunks if chunks > 0 else 0.0

    def phase_line(self, kind: str) -> tuple[float, float]:
        """(fixed seconds per phase, seconds per chunk) of a chunk kind: its own fit, or the other chunk kind's
        while its own has seen no phase; (0, 0) before either has. One reading of the fit (see _PhaseLine.sums).
        Official final passes: no fixed part, the measured pass per stream."""
        if kind == "final":
            return 0.0, self.final_pass_s()
        line = self._phases.get(kind)
        if line is None or not line.measured:
            line = self._phases.get("first" if kind == "chunks" else "chunks")
            if line is None:
                return 0.0, 0.0
        return line.line()

    def chunk_s(self, kind: str) -> float:
        """Worker seconds of one chunk voiced alone in a phase of `kind` (0 before one was measured)."""
        return self.phase_s(kind, 1)

    def prefill_s(self) -> float:
        return self._prefill.value or 0.0

    def lm_hold_s(self) -> float | None:
        return self._lm_hold.value

    def slot_hold_s(self) -> float | None:
        """Seconds a stream holds its flow slot; the LM row's hold stands in before one was measured."""
        return self._slot_hold.value if self._slot_hold.value is not None else self._lm_hold.value
