"""Latency of the first free-key message sent right after a parked backlog.

One handle is held on key "hot". A spawned producer sends N messages on "hot" with
`send_many` while the receiver sleeps in `recv`, then at once one message on a free key,
stamped with CLOCK_MONOTONIC (one clock for every process on the machine). The figure is
the time from that send to the receiver holding the message: the receiver must have
looked at the whole backlog as it came in (parking it, csrc/window.c), not after. The
window (max_messages) is smaller than the backlog, in both orders.
"""

from __future__ import annotations

import contextlib
import struct
import time
import uuid
from typing import Any

import shmchan
from shmchan.bench.common import SHMCHAN, TIMEOUT, BenchError, Sizes
from shmchan.bench.harness import Run
from shmchan.bench.registry import register
from shmchan.bench.report import Result, Target

WINDOW = 16384  # max_messages: smaller than every backlog measured
STAMP = struct.Struct("<q")  # the free-key message: its send time, CLOCK_MONOTONIC ns
RECORD_BYTES = 96  # upper bound of one parked record (1-byte payload, key "hot")
CHUNK = 4096  # messages per send_many


def _backlogs(quick: bool) -> tuple[int, ...]:
    return (20_000, 100_000) if quick else (100_000, 1_000_000)


def _produce(name: str, n: int, go: Any, done: Any) -> None:
    """Child: on `go`, send n messages on "hot", then the stamped free-key message."""
    with shmchan.Sender.open(name) as tx:
        chunk = [(b"h", ("hot",))] * CHUNK
        if not go.wait(TIMEOUT):
            return
        for start in range(0, n, CHUNK):
            tx.send_many(chunk[: min(CHUNK, n - start)], TIMEOUT)
        tx.send(STAMP.pack(time.clock_gettime_ns(time.CLOCK_MONOTONIC)), "free", TIMEOUT)
    done.set()


def _one(run: Run, order: str, n: int) -> float:
    """One repetition on a fresh channel: µs from the free-key send to its receipt."""
    name = f"bench-parked-{uuid.uuid4().hex[:8]}"
    ch = shmchan.Channel.create(
        name, capacity=(n + 1024) * RECORD_BYTES, order=order, max_messages=WINDOW
    )
    with contextlib.ExitStack() as stack:
        stack.callback(shmchan.unlink, name)
        stack.callback(ch.close)
        rx = ch.receiver()
        stack.callback(rx.close)
        with ch.sender() as tx:
            tx.send(b"held", "hot", TIMEOUT)
        held = rx.recv(TIMEOUT)
        stack.callback(held.release)
        go, done = run.ctx.Event(), run.ctx.Event()
        child = run.ctx.Process(target=_produce, args=(name, n, go, done), daemon=True)
        child.start()

        def reap() -> None:
            child.join(TIMEOUT)
            if child.is_alive():
                child.kill()
                child.join()

        stack.callback(reap)
        time.sleep(0.2)  # let the child attach and wait, so the receiver is asleep first
        go.set()
        h = rx.recv(TIMEOUT)  # asleep while the backlog comes in
        got = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        with h:
            if h.keys != ("free",) or len(h.payload) != STAMP.size:
                raise BenchError(f"shmchan ({order}): expected the free-key message, got {h!r}")
            sent: int = STAMP.unpack(h.payload)[0]
        if not done.wait(TIMEOUT):
            raise BenchError(f"shmchan ({order}): the producer did not finish")
        if ch.stats().queued != n:
            raise BenchError(f"shmchan ({order}): the parked backlog did not stay parked")
        return float(got - sent) / 1e3


def _run(run: Run) -> None:
    for n in _backlogs(run.quick):
        for order in ("fifo", "eager"):
            samples = []
            for rep in range(-1, run.sizes.reps):
                us = _one(run, order, n)
                if rep >= 0:
                    samples.append(max(us, 0.01))
                run.progress.step(f"first free-key after {n:,} parked ({order}): rep {rep + 1}")
            run.results.append(
                Result(
                    f"parked_first_{order}_{n}",
                    f"first free-key msg after {n:,} parked, {order}",
                    SHMCHAN,
                    "us",
                    False,
                    samples,
                    note=f"backlog sent while the receiver sleeps; window {WINDOW:,}",
                )
            )


def _targets(results: list[Result]) -> list[Target]:
    out = []
    for r in results:
        if r.workload.startswith("parked_first_"):
            out.append(
                Target(
                    f"{r.label}: median us",
                    r.median,
                    1000.0,
                    "<=",
                    "first free-key message after a backlog sent while the receiver sleeps",
                )
            )
    return out


def _steps(sizes: Sizes, nsys: int) -> int:
    return 2 * 2 * (sizes.reps + 1)


register("parked_latency", _run, steps=_steps, order=45, default=False, targets=_targets)
