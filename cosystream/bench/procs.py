"""Client processes of the load generator (`cosystream bench --procs N`).

One Python process parses every response of every stream on one event loop, so the client's own work for
the other streams is part of each latency it measures (at 16 streams whose audio arrives in the same
millisecond, the last one's chunk waits for the fifteen before it); real listeners do not share a loop. With
--procs N each level's streams (closed loop) or arrivals (open loop: N Poisson processes of rate/N, which
together are one of the full rate) are split over N processes that start the level together (a barrier) and
measure against one clock (`time.perf_counter` is the system's monotonic clock on Linux and macOS, the same
in every process); the parent merges their records into one level. On the lent H100 machine, 16 streams over
HTTP gave the same median first audio from one process and from four (docs/benchmarks.md): use it to check
that the client is not part of what a level measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import signal
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any

from cosystream.bench.clients import RequestSpec, make_client
from cosystream.bench.loadgen import LevelPlan, run_event_loop, run_level
from cosystream.bench.report import RequestRecord

START_TIMEOUT_S = 120.0  # spawning the processes and importing the client stack


@dataclass(frozen=True)
class ClientJob:
    """What one client process runs: its share of one level."""

    url: str
    target: str
    spec: RequestSpec
    timeout_s: float
    origin_s: float
    plan: LevelPlan
    seed: int


def split_plan(plan: LevelPlan, procs: int) -> list[LevelPlan]:
    """`plan` as up to `procs` shares that add up to it: streams (closed loop) or rate (open loop), and the
    request count, spread as evenly as integers allow; a share with nothing to do is left out."""
    if procs < 1:
        raise ValueError(f"procs: must be >= 1, got {procs}")
    if plan.kind == "concurrency":
        streams = _spread(int(plan.value), procs)
        counts = _spread_like(plan.max_requests, streams)
        return [replace(plan, value=s, max_requests=n) for s, n in zip(streams, counts, strict=True)
                if s > 0 and (n is None or n > 0)]
    counts = _spread(plan.max_requests, procs) if plan.max_requests is not None else [None] * procs
    return [replace(plan, value=plan.value / procs, max_requests=n) for n in counts if n is None or n > 0]


def _spread(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _spread_like(total: int | None, weights: list[int]) -> list[int | None]:
    """`total` in proportion to `weights` (largest remainders), None stays None."""
    if total is None:
        return [None] * len(weights)
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)[:total - sum(counts)]:
        counts[i] += 1
    return counts


async def run_level_in_processes(job: ClientJob, procs: int, stop: asyncio.Event) -> tuple[list[RequestRecord], bool]:
    """Run one level split over `procs` client processes; returns the merged records (numbered by send time)
    and whether the level was stopped early. Setting `stop` stops every process's share."""
    shares = split_plan(job.plan, procs)
    ctx = mp.get_context("spawn")  # a fresh interpreter: no copied event loop or sockets
    barrier = ctx.Barrier(len(shares) + 1)
    pipes = [ctx.Pipe() for _ in shares]  # (ours, theirs): "stop" goes down, the share's result comes up
    workers = [ctx.Process(target=_client_main, args=(replace(job, plan=share, seed=job.seed * 1000 + i),
                                                      barrier, theirs, i), daemon=True)
               for i, (share, (_, theirs)) in enumerate(zip(shares, pipes, strict=True))]
    for w in workers:
        w.start()
    for _, theirs in pipes:
        theirs.close()  # the child holds its end: end of file on ours means it died
    ours = [mine for mine, _ in pipes]
    loop = asyncio.get_running_loop()
    relay = asyncio.ensure_future(stop.wait())
    relay.add_done_callback(lambda _: _tell_stop(ours))
    try:
        await loop.run_in_executor(None, barrier.wait, START_TIMEOUT_S)
        parts = await loop.run_in_executor(None, _collect, ours)
    finally:
        relay.cancel()
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.terminate()
        for conn in ours:
            conn.close()
    records: list[RequestRecord] = []
    interrupted = False
    for part in parts:
        if isinstance(part, BaseException):
            raise part
        share_records, share_interrupted = part
        records += share_records
        interrupted = interrupted or share_interrupted
    records.sort(key=lambda r: r.start_s)
    for index, record in enumerate(records):  # one level again: its label, numbered by send time
        record.level, record.index = job.plan.label, index
    return records, interrupted or stop.is_set()


def _tell_stop(conns: list[Connection]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):  # that share is over already
            conn.send("stop")


def _collect(conns: list[Connection]) -> list:
    """Every process's (records, interrupted), or the exception it sent; a process that closed its pipe
    without sending (it died) becomes a RuntimeError."""
    parts = []
    pending = list(conns)
    while pending:
        for conn in wait(pending):
            try:
                parts.append(conn.recv())
            except EOFError:
                parts.append(RuntimeError("a load-generator process died without results"))
            pending.remove(conn)
    return parts


def _client_main(job: ClientJob, barrier: Any, conn: Connection, index: int) -> None:
    """A client process: its share of the level on its own event loop, after the barrier."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which sends "stop"
    try:
        result: Any = run_event_loop(_run_share(job, barrier, conn))
    except BaseException as exc:  # reported to the parent, which raises it
        result = RuntimeError(f"load-generator process {index}: {type(exc).__name__}: {exc}")
    conn.send(result)
    conn.close()


async def _run_share(job: ClientJob, barrier: Any, conn: Connection) -> tuple[list[RequestRecord], bool]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(conn.fileno(), stop.set)  # the parent's "stop" (or its end of file) ends the share
    client = make_client(job.url, job.target, job.spec, job.timeout_s, job.origin_s)
    try:
        await loop.run_in_executor(None, barrier.wait, START_TIMEOUT_S)
        return await run_level(client.send, job.plan, stop, job.seed)
    finally:
        loop.remove_reader(conn.fileno())
        await client.aclose()
