"""The state of a run and the throughput harness every throughput workload uses."""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import shmchan
from shmchan.bench.common import (
    CAPACITY,
    COPY,
    MIB,
    NAIVE,
    SEMAPHORE,
    SHMCHAN,
    TIMEOUT,
    ZEROQ,
    ZMQ,
    BenchError,
    Sizes,
    no_gc,
    warmup_count,
)
from shmchan.bench.endpoints import Endpoint, ShmchanEnd
from shmchan.bench.fastpeers import ZeroqEnd, ZmqEnd
from shmchan.bench.peers import NaiveEnd, QueueEnd, SemaphoreEnd
from shmchan.bench.producers import Job, Producers
from shmchan.bench.progress import Progress
from shmchan.bench.report import Result


@dataclass
class Run:
    sizes: Sizes
    systems: list[str]  # peers and shmchan available for channel workloads
    ctx: Any
    progress: Progress
    results: list[Result] = field(default_factory=list)
    quick: bool = False  # a --quick run: groups with their own sizes pick the small ones


def endpoint(run: Run, system: str, mode: str, capacity: int = CAPACITY) -> Endpoint:
    if system == SHMCHAN:
        return ShmchanEnd(capacity)
    if system == NAIVE:
        return NaiveEnd(run.ctx)
    if system == SEMAPHORE:
        return SemaphoreEnd(run.ctx)
    if system == ZEROQ:
        return ZeroqEnd(mode, run.sizes.batch, capacity)
    if system == ZMQ:
        return ZmqEnd(mode, run.sizes.batch, capacity)
    return QueueEnd(system, run.ctx, capacity)


def throughput(
    run: Run,
    *,
    workload: str,
    label: str,
    mode: str,
    systems: list[str],
    nprod: int,
    per_producer: int,
    batch: int,
    size: int,
    unit: str,
    notes: dict[str, str] | None = None,
    ceiling: Callable[[int], float] | None = None,
    warmup: int | None = None,
    capacity: int = CAPACITY,
    after: Callable[[dict[str, Endpoint]], dict[str, str]] | None = None,
) -> None:
    """Run one throughput workload on every system, repetitions interleaved."""
    notes = notes or {}
    samples: dict[str, list[float]] = {s: [] for s in systems}
    late: dict[str, int] = {s: 0 for s in systems}
    copy_samples: list[float] = []
    scale = size / MIB if unit == "MiB/s" else 1.0
    with contextlib.ExitStack() as stack:
        ends: dict[str, Endpoint] = {}
        groups: dict[str, Producers] = {}
        for s in systems:
            end = endpoint(run, s, mode, capacity)
            stack.callback(end.close)
            ends[s] = end
        for s in systems:
            jobs = [
                (Job(s, mode, p, per_producer, batch), ends[s].transport()) for p in range(nprod)
            ]
            group = Producers(run.ctx, s, jobs)
            stack.callback(group.close)
            groups[s] = group
        for s in systems:
            groups[s].wait_ready()
        run.progress.step(f"{label}: started")
        for rep in range(-1, run.sizes.reps):
            n = (warmup or warmup_count(per_producer, batch)) if rep < 0 else per_producer
            total = n * nprod
            for s in systems:
                group, end = groups[s], ends[s]
                with no_gc():
                    t0 = time.perf_counter()
                    group.go(n)
                    try:
                        inversions = end.consume(mode, n, nprod, batch, size)
                    except IndexError:
                        raise BenchError(f"{s}: a message with an unknown index arrived") from None
                    except (queue.Empty, shmchan.Empty):
                        why = group.failure()
                        raise BenchError(
                            f"{s}: nothing arrived for {TIMEOUT:g} s during {label}"
                            + (f"\n{why}" if why else "")
                        ) from None
                    elapsed = time.perf_counter() - t0
                group.wait_done()
                late[s] += inversions
                if rep >= 0:
                    samples[s].append(total / elapsed * scale)
                run.progress.step(f"{label}: {s}")
            if ceiling is not None:
                rate = ceiling(n)
                if rep >= 0:
                    copy_samples.append(rate)
                run.progress.step(f"{label}: {COPY}")
        if after is not None:  # notes from the endpoints' own counters, before they close
            notes = {**notes, **after(ends)}
    for s in systems:
        run.results.append(
            Result(
                workload,
                label,
                s,
                unit,
                True,
                samples[s],
                note=notes.get(s, ""),
                out_of_order=late[s],
                checked=(
                    per_producer * run.sizes.reps + (warmup or warmup_count(per_producer, batch))
                )
                * nprod,
            )
        )
    if ceiling is not None:
        run.results.append(
            Result(
                workload,
                label,
                COPY,
                unit,
                True,
                copy_samples,
                reference=True,
                note="one process copying the same bytes into a shared-memory buffer",
            )
        )
