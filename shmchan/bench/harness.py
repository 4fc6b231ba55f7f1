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
    JOIN_TIMEOUT,
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


class Spinner:
    """One more process on the machine, spinning on a CPU while asked to (`spin`) and
    parked on an event otherwise (`park`): the busy machine of the contention rows."""

    def __init__(self, ctx: Any) -> None:
        self.on = ctx.Event()
        self.quit = ctx.Event()
        self.spinning = ctx.RawValue("i", 0)  # the spinner's word that it spins (1) or not
        self.proc = ctx.Process(target=_spin, args=(self.on, self.quit, self.spinning), daemon=True)
        self.proc.start()

    def _until(self, state: int) -> None:
        deadline = time.monotonic() + TIMEOUT
        while self.spinning.value != state:
            if not self.proc.is_alive() or time.monotonic() > deadline:
                raise BenchError("the spinning process did not answer")
            time.sleep(0.0002)

    def spin(self) -> None:
        self.on.set()
        self._until(1)

    def park(self) -> None:
        self.on.clear()
        self._until(0)

    def close(self) -> None:
        self.quit.set()
        self.on.set()
        self.proc.join(JOIN_TIMEOUT)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(JOIN_TIMEOUT)


def _spin(on: Any, stop: Any, spinning: Any) -> None:
    """The spinner's loop: pure interpreter work, no system calls while spinning, checking
    its switch every ~20 000 iterations (well under a millisecond)."""
    while not stop.is_set():
        on.wait()
        spinning.value = 1
        while on.is_set() and not stop.is_set():
            for _ in range(20_000):
                pass
        spinning.value = 0


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
    spinner: Spinner | None = None,
    gap: float = 0.0,
) -> None:
    """Run one throughput workload on every system, repetitions interleaved.

    With a `spinner`, every repetition of every system runs twice, quiet and with the
    spinner spinning (in alternating order), and three row sets come out: the quiet rows
    (`workload`), the busy ones (`workload`_busy) and, per repetition, busy over quiet in
    percent (`workload`_retained). A `gap` paces the producers of mode "msg": each works
    (busy-waits) that many seconds after every send."""
    notes = notes or {}
    samples: dict[str, list[float]] = {s: [] for s in systems}
    busy: dict[str, list[float]] = {s: [] for s in systems}
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
                (Job(s, mode, p, per_producer, batch, gap), ends[s].transport())
                for p in range(nprod)
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
                loads = (False,) if spinner is None else (rep % 2 == 1, rep % 2 == 0)
                for loaded in loads:
                    if loaded and spinner is not None:
                        spinner.spin()
                    try:
                        with no_gc():
                            t0 = time.perf_counter()
                            group.go(n)
                            try:
                                inversions = end.consume(mode, n, nprod, batch, size)
                            except IndexError:
                                raise BenchError(
                                    f"{s}: a message with an unknown index arrived"
                                ) from None
                            except (queue.Empty, shmchan.Empty):
                                why = group.failure()
                                raise BenchError(
                                    f"{s}: nothing arrived for {TIMEOUT:g} s during {label}"
                                    + (f"\n{why}" if why else "")
                                ) from None
                            elapsed = time.perf_counter() - t0
                        group.wait_done()
                    finally:
                        if loaded and spinner is not None:
                            spinner.park()
                    late[s] += inversions
                    if rep >= 0:
                        (busy if loaded else samples)[s].append(total / elapsed * scale)
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
                label if spinner is None else label + ", quiet",
                s,
                unit,
                True,
                samples[s],
                note=notes.get(s, ""),
                out_of_order=late[s],
                checked=(
                    per_producer * run.sizes.reps + (warmup or warmup_count(per_producer, batch))
                )
                * nprod
                * (1 if spinner is None else 2),
            )
        )
    if spinner is not None:
        for s in systems:
            retained = [100.0 * b / q for b, q in zip(busy[s], samples[s], strict=True)]
            for suffix, what, unit_, values in (
                ("_busy", ", one spinning process", unit, busy[s]),
                ("_retained", ", share kept with one spinning process", "%", retained),
            ):
                run.results.append(
                    Result(
                        workload + suffix,
                        label + what,
                        s,
                        unit_,
                        True,
                        values,
                        note=notes.get(s, ""),
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
