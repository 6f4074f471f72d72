"""Arrival schedules of the load generator: closed loop at fixed concurrency, open loop at a Poisson rate.

Transport-independent: a level drives a `SendFn(level, index) -> RequestRecord`, which the HTTP/WebSocket
clients (bench/clients.py) and the in-process engine benchmark (benchmarks/bench_engine.py) provide.
Every level is bounded in count (`max_requests`) and/or time (`duration_s`), and a stop event (Ctrl-C)
ends it at once: requests still in flight are cancelled and left out.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cosystream.bench.report import LevelSummary, RequestRecord, Timeline, summarize

SendFn = Callable[[str, int], Awaitable[RequestRecord]]
DEFAULT_OPEN_LOOP_S = 30.0  # an open level without a count or duration offers this many seconds of arrivals
MIN_REQUESTS_PER_LEVEL = 8
DEFAULT_RETRY_AFTER_S = 1.0  # a refusal without Retry-After: the server's own minimum (server/admission.py)


@dataclass(frozen=True)
class LevelPlan:
    """One load level: `value` streams in flight (closed loop) or requests per second (open loop)."""

    kind: str  # "concurrency" | "rate"
    value: float
    max_requests: int | None = None
    duration_s: float | None = None  # stop issuing new requests after this long

    def __post_init__(self) -> None:
        if self.kind not in ("concurrency", "rate"):
            raise ValueError(f"kind: 'concurrency' or 'rate', got {self.kind!r}")
        if self.value <= 0 or (self.kind == "concurrency" and self.value != int(self.value)):
            raise ValueError(f"{self.kind}: must be a positive {'integer' if self.kind == 'concurrency' else 'number'}")
        if self.max_requests is None and self.duration_s is None:
            raise ValueError("a level needs max_requests or duration_s (every level is bounded)")

    @property
    def label(self) -> str:
        return f"c={int(self.value)}" if self.kind == "concurrency" else f"rate={self.value:g}"


def build_plans(concurrency: Sequence[int] = (), rates: Sequence[float] = (), requests_per_level: int | None = None,
                duration_s: float | None = None) -> list[LevelPlan]:
    """Closed-loop levels first, then open-loop ones. Without a count or duration, a closed level runs
    4 requests per stream (at least 8) and an open level 30 s worth of arrivals (at least 8)."""
    plans = []
    for c in concurrency:
        count = requests_per_level
        if count is None and duration_s is None:
            count = max(MIN_REQUESTS_PER_LEVEL, 4 * c)
        plans.append(LevelPlan("concurrency", c, count, duration_s))
    for rate in rates:
        count = requests_per_level
        if count is None and duration_s is None:
            count = max(MIN_REQUESTS_PER_LEVEL, math.ceil(rate * DEFAULT_OPEN_LOOP_S))
        plans.append(LevelPlan("rate", rate, count, duration_s))
    return plans


async def run_timed(stream: Callable[[], Awaitable[None]], timeline: Timeline, timeout_s: float) -> RequestRecord:
    """Run one request's streaming coroutine under a time limit; any failure becomes the record's error.

    `stream` feeds `timeline.audio()` and may itself call `refuse()`/`fail()` (then its record is kept).
    """
    try:
        await asyncio.wait_for(stream(), timeout_s)
    except asyncio.TimeoutError:
        return timeline.record if timeline.closed else timeline.fail(f"timeout after {timeout_s:g} s")
    except Exception as exc:  # one request's failure is data, not the end of the run
        return timeline.record if timeline.closed else timeline.fail(f"{type(exc).__name__}: {exc}".rstrip(": "))
    return timeline.record if timeline.closed else timeline.finish()


async def run_closed(send: SendFn, plan: LevelPlan, stop: asyncio.Event) -> tuple[list[RequestRecord], bool]:
    """`plan.value` workers each send one request after another; a refused one waits the server's Retry-After
    first. Returns (records, interrupted)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + plan.duration_s if plan.duration_s is not None else math.inf
    limit = plan.max_requests if plan.max_requests is not None else math.inf
    counter = itertools.count()
    records: list[RequestRecord] = []

    async def worker() -> None:
        while not stop.is_set() and loop.time() < deadline:
            index = next(counter)
            if index >= limit:
                return
            record = await send(plan.label, index)
            records.append(record)
            if record.refused:
                await _stopped_within(stop, min(_retry_delay_s(record), deadline - loop.time()))

    workers = [asyncio.create_task(worker()) for _ in range(int(plan.value))]
    interrupted = await _wait_or_stop(workers, stop)
    return sorted(records, key=lambda r: r.index), interrupted


def _retry_delay_s(record: RequestRecord) -> float:
    """How long a refused stream waits before its next request: the server's Retry-After, as a client should (sent
    again at once, a level past admission's limit becomes thousands of refusals a second)."""
    return record.retry_after_s if record.retry_after_s is not None else DEFAULT_RETRY_AFTER_S


async def run_open(send: SendFn, plan: LevelPlan, stop: asyncio.Event,
                   seed: int = 0) -> tuple[list[RequestRecord], bool]:
    """Send at Poisson arrival times (rate `plan.value`/s) whatever is in flight; returns (records, interrupted)."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)  # the same arrival times on every run of a seed
    t0 = loop.time()
    deadline = t0 + plan.duration_s if plan.duration_s is not None else math.inf
    limit = plan.max_requests if plan.max_requests is not None else math.inf
    tasks: list[asyncio.Task[RequestRecord]] = []
    t_next = t0
    while len(tasks) < limit and t_next < deadline:
        if await _stopped_within(stop, t_next - loop.time()):
            break
        tasks.append(asyncio.create_task(send(plan.label, len(tasks))))
        t_next += rng.expovariate(plan.value)
    interrupted = await _wait_or_stop(tasks, stop) or stop.is_set()
    records = [t.result() for t in tasks if t.done() and not t.cancelled() and t.exception() is None]
    return records, interrupted


async def run_level(send: SendFn, plan: LevelPlan, stop: asyncio.Event,
                    seed: int = 0) -> tuple[list[RequestRecord], bool]:
    if plan.kind == "concurrency":
        return await run_closed(send, plan, stop)
    return await run_open(send, plan, stop, seed)


LevelFn = Callable[[LevelPlan, int], Awaitable[tuple[list[RequestRecord], bool]]]  # (plan, seed) -> records
AfterLevelFn = Callable[[list[RequestRecord]], Awaitable[object]]


async def run_benchmark(send: SendFn, plans: Sequence[LevelPlan], stop: asyncio.Event, warmup_requests: int = 0,
                        seed: int = 0, log: Callable[[str], None] = print, level_fn: LevelFn | None = None,
                        after_level: AfterLevelFn | None = None, first_audio_deadline_s: float | None = None,
                        ) -> tuple[list[RequestRecord], list[LevelSummary]]:
    """Warm up, then run the levels in order; returns every record (warm-up included) and one summary per level.
    `level_fn` runs a level instead of `send` on this loop (bench/procs.py: in client processes); `after_level`
    gets each level's records once the level is over, before the next starts (e.g. to read the server's
    stage times: nothing it does is timed). `first_audio_deadline_s`: first audio later than this counts as a
    deadline miss in the summaries (with the playback underruns)."""
    records = await run_warmup(send, warmup_requests, stop)
    if records:
        failed = [r for r in records if not r.ok]
        log(f"warm-up: {len(records)} requests, {len(failed)} failed"
            + (f" (first: {failed[0].error or f'refused, HTTP {failed[0].status}'})" if failed else ""))
    summaries = []
    for level_idx, plan in enumerate(plans):
        if stop.is_set():
            break
        if level_fn is not None:
            level_records, interrupted = await level_fn(plan, seed + level_idx)
        else:
            level_records, interrupted = await run_level(send, plan, stop, seed + level_idx)
        if after_level is not None:
            await after_level(level_records)
        summary = summarize(level_records, plan.label, plan.kind, plan.value, interrupted, first_audio_deadline_s)
        records += level_records
        summaries.append(summary)
        log(_level_line(summary))
    return records, summaries


def _level_line(s: LevelSummary) -> str:
    p50 = f"{s.first_audio_s['p50'] * 1000:.0f} ms" if s.first_audio_s else "-"
    return (f"{s.level}: {s.num_ok}/{s.num_requests} ok, {s.num_errors} errors, {s.num_refused} refused, "
            f"first audio p50 {p50}, {s.aggregate_rtf:.2f}x realtime in all, goodput {s.goodput:.2f} audio s/s, "
            f"{s.deadline_misses} deadline misses ({s.first_audio_misses} first audio), "
            f"{s.underrun_requests} with underruns"
            + (f", {s.num_wrong_length} with audio length != forced length" if s.num_wrong_length else "")
            + (" (interrupted)" if s.interrupted else ""))


async def run_warmup(send: SendFn, num_requests: int, stop: asyncio.Event) -> list[RequestRecord]:
    """One request after another, before the levels: compiles, caches and connections get warm."""
    records = []
    for index in range(num_requests):
        task = asyncio.create_task(send("warmup", index))
        if await _wait_or_stop([task], stop):
            break
        records.append(task.result())
    return records


async def _stopped_within(stop: asyncio.Event, delay_s: float) -> bool:
    """Sleep `delay_s` unless the stop event comes first; True if it did."""
    if stop.is_set():
        return True
    if delay_s <= 0:
        return False
    try:
        await asyncio.wait_for(stop.wait(), delay_s)
    except asyncio.TimeoutError:
        return False
    return True


async def _wait_or_stop(tasks: Sequence[asyncio.Task], stop: asyncio.Event) -> bool:
    """Wait for `tasks`; if `stop` is set first, cancel what is still running. True if stopped early."""
    if not tasks:
        return stop.is_set()
    # return_exceptions: a cancelled child must not turn into an error of the whole level
    everything = asyncio.gather(*tasks, return_exceptions=True)
    stopper = asyncio.ensure_future(stop.wait())
    finished = False
    try:
        await asyncio.wait([everything, stopper], return_when=asyncio.FIRST_COMPLETED)
        finished = everything.done()
    finally:
        stopper.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(everything, return_exceptions=True)
    if finished:
        for result in everything.result():
            if isinstance(result, Exception):
                raise result  # a bug in a send function: failed requests come back as records
    return not finished


def run_event_loop(coro: Any) -> Any:
    """Run `coro` on uvloop where it is installed (it is not a dependency): the client's own per-chunk work
    is part of every latency it measures, so the lighter loop is used when there is one."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
