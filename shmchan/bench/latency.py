"""Idle wake-up latency: a ping to a sleeping consumer, against a bare semaphore."""

from __future__ import annotations

import contextlib
import math
import queue
import statistics
from typing import Any

import posix_ipc

import shmchan
from shmchan.bench.common import (
    FFIFO,
    MPQ,
    SEMAPHORE,
    SHMCHAN,
    TIMEOUT,
    ZEROQ,
    ZMQ,
    BenchError,
    Sizes,
    no_gc,
    unique,
    warmup_count,
)
from shmchan.bench.endpoints import Endpoint
from shmchan.bench.harness import Run, endpoint
from shmchan.bench.producers import Job, Producers
from shmchan.bench.registry import register
from shmchan.bench.report import Result, Target, median_ratio

CHUNK = 50  # pings a system takes in one turn


def _run_latency(run: Run) -> None:
    sz = run.sizes
    systems = [SHMCHAN, SEMAPHORE] + [s for s in (MPQ, FFIFO, ZEROQ, ZMQ) if s in run.systems]
    medians: dict[str, list[float]] = {s: [] for s in systems}
    p99s: dict[str, list[float]] = {s: [] for s in systems}
    label = "idle wake-up latency"
    with contextlib.ExitStack() as stack:
        ends: dict[str, Endpoint] = {}
        groups: dict[str, Producers] = {}
        acks: dict[str, Any] = {}
        for s in systems:
            end = endpoint(run, s, "latency")
            stack.callback(end.close)
            ends[s] = end
            ack = acks[s] = posix_ipc.Semaphore("/" + unique("ack"), posix_ipc.O_CREX, mode=0o600)
            stack.callback(ack.unlink)
            job = Job(s, "latency", 0, sz.latency_samples, gap=sz.latency_gap, ack=ack.name)
            group = Producers(run.ctx, s, [(job, end.transport())])
            stack.callback(group.close)
            groups[s] = group
        for s in systems:
            groups[s].wait_ready()
        run.progress.step(f"{label}: started")
        for rep in range(-1, sz.reps):
            n = warmup_count(sz.latency_samples) if rep < 0 else sz.latency_samples
            # The systems take turns, CHUNK pings at a time, each turn in a rotated order:
            # a noisy stretch of the machine (a tail is a few samples) falls on all of
            # them alike instead of on whichever ran through it.
            lats: dict[str, list[float]] = {s: [] for s in systems}
            for turn, start in enumerate(range(0, n, CHUNK)):
                k = min(CHUNK, n - start)
                for s in systems[turn % len(systems) :] + systems[: turn % len(systems)]:
                    groups[s].go(k)
                    try:
                        with no_gc():
                            lats[s] += ends[s].latencies(k, acks[s])
                    except (queue.Empty, shmchan.Empty, posix_ipc.BusyError):
                        why = groups[s].failure()
                        raise BenchError(
                            f"{s}: no ping for {TIMEOUT:g} s" + (f"\n{why}" if why else "")
                        ) from None
                    groups[s].wait_done()
            for s in systems:
                lat = sorted(lats[s])
                if rep >= 0:
                    medians[s].append(statistics.median(lat))
                    p99s[s].append(lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)])
                run.progress.step(f"{label}: {s}")
    notes = {
        SHMCHAN: "send -> recv, consumer asleep; ping-pong like the floor",
        SEMAPHORE: "post -> wait of a bare posix_ipc semaphore",
        ZEROQ: "get(timeout) polls with short sleeps",
    }
    for workload, stat, values in (
        ("latency_median", "median", medians),
        ("latency_p99", "p99", p99s),
    ):
        for s in systems:
            run.results.append(
                Result(
                    workload,
                    f"{label}, {stat}",
                    s,
                    "us",
                    False,
                    values[s],
                    reference=s == SEMAPHORE,
                    note=notes.get(s, ""),
                    checked=sz.latency_samples * sz.reps + warmup_count(sz.latency_samples),
                )
            )


def _steps(sizes: Sizes, nsys: int) -> int:
    return 1 + (sizes.reps + 1) * nsys  # every system but the naive one, and the floor


def _targets(results: list[Result]) -> list[Target]:
    return [
        Target(
            "idle wake-up p99: shmchan / semaphore",
            median_ratio(results, ("latency_p99", SHMCHAN), ("latency_p99", SEMAPHORE)),
            2.0,
            "<=",
            "send->recv of an idle consumer vs a bare posix_ipc semaphore ping-pong, p99",
        )
    ]


register("latency", _run_latency, steps=_steps, order=50, targets=_targets)
