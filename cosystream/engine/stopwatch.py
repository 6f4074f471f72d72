"""Stopwatch: where a token-to-wave batch spends its time, stage by stage, without extra syncs.

Each `lap(stage)` closes the stage that ran since the previous lap: the host clock gives the time the
thread spent issuing it, and on CUDA an event recorded on the current stream gives the time the GPU
spent on it, read once the batch has synchronised anyway (its audio is copied to the host). Totals per
stage accumulate across batches and reach `/metrics` and `benchmarks/bench_engine.py` through the
engine's stats.
"""

from __future__ import annotations

import threading
import time

import torch


class Stopwatch:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host_s: dict[str, float] = {}
        self.gpu_s: dict[str, float] = {}
        self._laps: list[tuple[str, float, torch.cuda.Event | None]] = []
        self._lock = threading.Lock()  # totals are read by /metrics from other threads

    def start(self) -> None:
        self._laps = [("", time.perf_counter(), self._event())]

    def lap(self, stage: str) -> None:
        if self._laps:
            self._laps.append((stage, time.perf_counter(), self._event()))

    def settle(self) -> None:
        """Add the laps of the batch that just synchronised to the totals."""
        laps, self._laps = self._laps, []
        with self._lock:
            for (_, t0, e0), (stage, t1, e1) in zip(laps, laps[1:], strict=False):
                self.host_s[stage] = self.host_s.get(stage, 0.0) + (t1 - t0)
                gpu = e0.elapsed_time(e1) / 1e3 if e0 is not None and e1 is not None else t1 - t0
                self.gpu_s[stage] = self.gpu_s.get(stage, 0.0) + gpu

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = {f"token2wav_{stage}_host_seconds": s for stage, s in self.host_s.items()}
            out.update({f"token2wav_{stage}_gpu_seconds": s for stage, s in self.gpu_s.items()})
        return out

    def _event(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
