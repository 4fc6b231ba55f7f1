"""Dispatch cost of a free-key message with and without a backlog parked on a held key."""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from typing import Any

from shmchan.bench.common import (
    CAPACITY,
    HDR,
    NAIVE,
    PAYLOAD,
    SHMCHAN,
    TIMEOUT,
    BenchError,
    Sizes,
    bad_payload,
    no_gc,
    payload,
    warmup_count,
)
from shmchan.bench.endpoints import ShmchanEnd
from shmchan.bench.harness import Run
from shmchan.bench.peers import NaiveKeyedDispatcher
from shmchan.bench.registry import register
from shmchan.bench.report import Result


def _dispatch_shmchan(end: ShmchanEnd, tx: Any, payloads: list[bytes], n: int) -> float:
    """µs per send -> recv -> release of a message on a free key, in this process."""
    send, recv, unpack = tx.send, end.rx.recv, HDR.unpack_from
    with no_gc():
        t0 = time.perf_counter()
        for i in range(n):
            send(payloads[i], i, TIMEOUT)
            h = recv(TIMEOUT)
            d = h.payload
            if unpack(d)[0] != i or d[-1] != i & 0xFF:
                raise bad_payload(SHMCHAN, d, PAYLOAD)
            h.release()
        elapsed = time.perf_counter() - t0
    return elapsed / n * 1e6


def _dispatch_naive(
    disp: NaiveKeyedDispatcher, intake: deque[Any], items: list[Any], n: int
) -> float:
    unpack = HDR.unpack_from
    append = intake.append
    with no_gc():
        t0 = time.perf_counter()
        for i in range(n):
            append(items[i])
            m = disp.recv(TIMEOUT)
            d = m[1]
            if unpack(d)[0] != i or d[-1] != i & 0xFF:
                raise bad_payload(NAIVE, d, PAYLOAD)
            disp.release(m)
        elapsed = time.perf_counter() - t0
    return elapsed / n * 1e6


def _park(run: Run, end: ShmchanEnd, tx: Any, parked: int) -> Any:
    """Hold a handle on "hot" and get `parked` messages on "hot" parked by the receiver."""
    hot_payload = payload(0, 0)
    tx.send(hot_payload, "hot", TIMEOUT)
    hot = end.rx.recv(TIMEOUT)
    chunk = [(hot_payload, "hot")] * 1000
    for start in range(0, parked, 1000):
        tx.send_many(chunk[: min(1000, parked - start)], TIMEOUT)
    # One poll looks at everything sent before it (csrc/handles.c shm_recv): after it,
    # the backlog is parked behind the held key.
    if end.rx.try_recv() is not None:
        raise BenchError("shmchan: a message on a held key was handed out")
    st = end.ch.stats()
    if st.queued != parked:
        raise BenchError(f"shmchan: {st.queued} queued, {parked} parked")
    return hot


def _run_parked(run: Run) -> None:
    sz = run.sizes
    n, n_naive = sz.dispatch_messages, sz.naive_dispatch_messages
    max_messages = 1 << max(18, math.ceil(math.log2(sz.parked + 1024)))
    per_rec = 256  # upper bound of one 64 B record with one key
    capacity = max(CAPACITY, (sz.parked + (sz.reps + 1) * n + 1024) * per_rec)
    payloads = [payload(i, 0) for i in range(max(n, n_naive))]
    free_label = "dispatch, no backlog"
    parked_label = f"dispatch, {sz.parked:,} parked on a held key"
    samples: dict[tuple[str, str], list[float]] = {
        (w, s): [] for w in ("dispatch_free", "dispatch_parked") for s in (SHMCHAN, NAIVE)
    }
    with contextlib.ExitStack() as stack:
        free = ShmchanEnd(capacity, max_messages)
        stack.callback(free.close)
        busy = ShmchanEnd(capacity, max_messages)
        stack.callback(busy.close)
        tx_free, tx_busy = free.ch.sender(), busy.ch.sender()
        hot = _park(run, busy, tx_busy, sz.parked)
        stack.callback(hot.release)

        items = [((i,), payloads[i]) for i in range(n_naive)]
        intake_free: deque[Any] = deque()
        intake_busy: deque[Any] = deque()
        naive_free = NaiveKeyedDispatcher(lambda t: intake_free.popleft())
        naive_busy = NaiveKeyedDispatcher(lambda t: intake_busy.popleft())
        naive_busy.held.add("hot")
        naive_busy.backlog = [(("hot",), payloads[0])] * sz.parked
        run.progress.step(f"{parked_label}: parked")

        for rep in range(-1, sz.reps):
            k = warmup_count(n) if rep < 0 else n
            kn = warmup_count(n_naive) if rep < 0 else n_naive
            for workload, shm_end, tx, disp, intake in (
                ("dispatch_free", free, tx_free, naive_free, intake_free),
                ("dispatch_parked", busy, tx_busy, naive_busy, intake_busy),
            ):
                cost = _dispatch_shmchan(shm_end, tx, payloads, k)
                naive_cost = _dispatch_naive(disp, intake, items, kn)
                if rep >= 0:
                    samples[(workload, SHMCHAN)].append(cost)
                    samples[(workload, NAIVE)].append(naive_cost)
                run.progress.step(f"{parked_label}: rep {rep + 1}")
        if len(naive_busy.backlog) != sz.parked or busy.ch.stats().queued != sz.parked:
            raise BenchError("the parked backlog changed while it should have waited")
    for workload, label in (("dispatch_free", free_label), ("dispatch_parked", parked_label)):
        run.results.append(
            Result(
                workload,
                label,
                SHMCHAN,
                "us/msg",
                False,
                samples[(workload, SHMCHAN)],
                note="send -> recv -> release, one process",
            )
        )
        run.results.append(
            Result(
                workload,
                label,
                NAIVE,
                "us/msg",
                False,
                samples[(workload, NAIVE)],
                note="in-process intake (no transport cost): scheduling only",
            )
        )


def _steps(sizes: Sizes, nsys: int) -> int:
    return 1 + (sizes.reps + 1) * 2


register("parked", _run_parked, steps=_steps, order=40)
