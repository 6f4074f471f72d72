"""Stopwatch: where a token-to-wave batch spends its time, stage by stage, without extra syncs.

Each `lap(stage)` closes the stage that ran since the previous lap: the host clock gives the time the
thread spent issuing it, and on CUDA an event recorded on the current stream gives the time the GPU
spent on it, read once the batch has synchronised anyway (its audio is copied to the host). Totals per
stage accumulate across batches and reach `/metrics` and `benchmarks/bench_engine.py` through the
engine's stats. A lap may carry a `tag` (e.g. a graph's batch and frame counts): the calls and GPU seconds
of each tag are totalled too, so the stats say which shapes the time went to.
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
        self.tag_calls: dict[str, int] = {}
        self.tag_gpu_s: dict[str, float] = {}
        self._laps: list[tuple[str, float, torch.cuda.Event | None, str | None]] = []
        self._lock = threading.Lock()  # totals are read by /metrics from other threads

    def start(self) -> None:
        self._laps = [("", time.perf_counter(), self._event(), None)]

    def lap(self, stage: str, tag: str | None = None) -> None:
        if self._laps:
            self._laps.append((stage, time.perf_counter(), self._event(), tag))

    def count(self, tag: str) -> None:
        """One more call of `tag`, timed by no lap of its own."""
        with self._lock:
            self.tag_calls[tag] = self.tag_calls.get(tag, 0) + 1

    def settle(self) -> None:
        """Add the laps of the batch that just synchronised to the totals. An event the batch's sync did not
        cover (recorded on another CUDA stream, e.g. by work that ran beside the batch) is waited for here:
        reading an unfinished event's time raises, and a stage time must never fail a batch."""
        laps, self._laps = self._laps, []
        for _, _, event, _ in laps:
            if event is not None and not event.query():
                event.synchronize()
        with self._lock:
            for (_, t0, e0, _), (stage, t1, e1, tag) in zip(laps, laps[1:], strict=False):
                self.host_s[stage] = self.host_s.get(stage, 0.0) + (t1 - t0)
                gpu = e0.elapsed_time(e1) / 1e3 if e0 is not None and e1 is not None else t1 - t0
                self.gpu_s[stage] = self.gpu_s.get(stage, 0.0) + gpu
                if tag is not None:
                    self.tag_calls[tag] = self.tag_calls.get(tag, 0) + 1
                    self.tag_gpu_s[tag] = self.tag_gpu_s.get(tag, 0.0) + gpu

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = {f"token2wav_{stage}_host_seconds": s for stage, s in self.host_s.items()}
            out.update({f"token2wav_{stage}_gpu_seconds": s for stage, s in self.gpu_s.items()})
            for tag, calls in self.tag_calls.items():
                out[f"token2wav_calls_{tag}"] = float(calls)
                if tag in self.tag_gpu_s:
                    out[f"token2wav_calls_{tag}_seconds"] = self.tag_gpu_s[tag]
        return out

    def _event(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
