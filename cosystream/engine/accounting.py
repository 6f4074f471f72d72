"""Resource accounting of a running engine: what a request holds while it lives, read back to check leaks.

Slots (LM rows, flow-pool slots), live and queued requests, cached voice state, threads, asyncio tasks and
GPU memory. `take_accounts` reads the engine thread's bookkeeping on that thread, after every message sent
before it (its inbox is FIFO), so a check that follows an abort sees the abort's effect. `gauges` is the
cheap approximate form merged into AsyncEngine.stats() (and so into /metrics).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class EngineAccounts:
    """A snapshot of what the engine holds. Counts are plain ints; GPU bytes are 0 off CUDA."""

    num_requests: int  # requests the engine thread still tracks
    num_waiting: int  # requests queued for an LM slot
    num_lm_slots: int
    num_free_lm_slots: int
    num_flow_slots: int  # flow-pool slots (0 without a pool: CPU)
    num_free_flow_slots: int
    num_voice_prompts: int  # registered voices' prompt features held in memory
    num_voice_caches: int  # encoded flow prompts held (stored copies + on the device)
    num_threads: int  # threads of the whole process
    num_tasks: int  # asyncio tasks of the loop given to take_accounts (0 without one)
    gpu_allocated_bytes: int

    @property
    def is_idle(self) -> bool:
        """No request anywhere in the engine and every slot free."""
        return (self.num_requests == 0 and self.num_waiting == 0 and self.num_free_lm_slots == self.num_lm_slots
                and self.num_free_flow_slots == self.num_flow_slots)

    def growth(self, baseline: EngineAccounts, gpu_slack_bytes: int = 0) -> dict[str, tuple[int, int]]:
        """{field: (baseline, now)} for everything held beyond the baseline: empty when nothing leaked."""
        out = {}
        for key, now in asdict(self).items():
            then = getattr(baseline, key)
            if key.startswith("num_free"):
                held = now < then  # fewer free slots: someone still holds one
            elif key in ("num_lm_slots", "num_flow_slots"):
                continue  # sizes, fixed at start
            else:
                held = now > then + (gpu_slack_bytes if key == "gpu_allocated_bytes" else 0)
            if held:
                out[key] = (then, now)
        return out


def _core_counts(engine: Any) -> dict[str, int]:
    """Runs on the engine thread: its own bookkeeping, consistent with itself."""
    core, t2w = engine.core, engine.token2wav
    pool = t2w.pool
    return {"num_requests": len(core.requests), "num_waiting": len(core.waiting),
            "num_lm_slots": core.lm_runner.max_slots, "num_free_lm_slots": len(set(core.free_slots)),
            "num_flow_slots": pool.scratch if pool is not None else 0,
            "num_free_flow_slots": len(set(pool.free)) if pool is not None else 0,
            "num_device_voice_caches": len(t2w.voice_caches)}


def take_accounts(engine: Any, loop: asyncio.AbstractEventLoop | None = None) -> EngineAccounts:
    """Exact accounts of an AsyncEngine. Blocks until the engine thread answers: call it from a plain thread
    (or through run_in_executor), never on the event loop the engine serves."""
    counts = engine.core.call(_core_counts, engine)
    device = engine.core.lm_runner.device
    return EngineAccounts(
        num_requests=counts["num_requests"], num_waiting=counts["num_waiting"],
        num_lm_slots=counts["num_lm_slots"], num_free_lm_slots=counts["num_free_lm_slots"],
        num_flow_slots=counts["num_flow_slots"], num_free_flow_slots=counts["num_free_flow_slots"],
        num_voice_prompts=len(engine._voice_prompts),
        num_voice_caches=len(engine._voice_caches) + counts["num_device_voice_caches"],
        num_threads=threading.active_count(),
        num_tasks=len(asyncio.all_tasks(loop)) if loop is not None else 0,
        gpu_allocated_bytes=int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0)


def gauges(engine: Any) -> dict[str, float]:
    """The same counts read without waiting for the engine thread (approximate by design: for /metrics)."""
    pool = engine.token2wav.pool
    return {"num_flow_slots": float(pool.scratch if pool is not None else 0),
            "num_free_flow_slots": float(len(pool.free) if pool is not None else 0),
            "num_lm_slots": float(engine.core.lm_runner.max_slots),
            "num_voice_prompts": float(len(engine._voice_prompts)),
            "num_voice_caches": float(len(engine._voice_caches) + len(engine.token2wav.voice_caches)),
            "num_threads": float(threading.active_count())}
