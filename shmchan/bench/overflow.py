"""Overflow to disk: a burst far larger than the channel, taken while the consumer sleeps.

A 1 MiB channel created with overflow=DIR takes `Sizes.overflow_burst` bytes (1 GiB in a
full run, 32 MiB with --quick) of 64 KiB messages on 16 keys from one sender with
timeout=0, so a single Full fails the run: the ring fills at once and the rest goes to
the overflow file. Then a receiver takes every message back and releases it, checking
that each arrives once and in the order it was sent. Beside it, the same bytes written
to a plain file in the same directory in 64 KiB writes and read back: the file system's
own speed (page cache included), the ceiling of both phases.
"""

from __future__ import annotations

import os
import struct
import tempfile
import time
import uuid

import shmchan
from shmchan.bench.common import BenchError, Sizes
from shmchan.bench.harness import Run
from shmchan.bench.registry import register
from shmchan.bench.report import Result

MIB = 1 << 20
MESSAGE = 64 << 10
CHANNEL = 1 << 20
KEYS = 16


def _reps(run: Run) -> int:
    return min(run.sizes.reps, 3)  # each repetition writes the whole burst to disk


def _payload(i: int, body: bytes) -> bytes:
    return struct.pack("<Q", i) + body + struct.pack("<Q", i)


def _one_pass(n: int, directory: str) -> tuple[float, float, float, float]:
    """MiB/s of: the burst into the channel, its drain, a plain file's write, its read."""
    body = (bytes(range(256)) * (MESSAGE // 256))[: MESSAGE - 16]
    name = f"bench_overflow_{uuid.uuid4().hex[:10]}"
    ch = shmchan.Channel.create(name, capacity=CHANNEL, overflow=directory)
    try:
        tx = ch.sender()
        t0 = time.perf_counter()
        for i in range(n):
            try:
                tx.send(_payload(i, body), keys=(i % KEYS,), timeout=0)
            except shmchan.Full as e:
                raise BenchError(
                    f"overflow bench: message {i} of the burst was refused: {e}"
                ) from None
        burst = time.perf_counter() - t0
        if ch.stats().overflow_messages == 0:
            raise BenchError("overflow bench: nothing went to the overflow file")
        with ch.receiver() as rx:
            t0 = time.perf_counter()
            for i in range(n):
                h = rx.recv(timeout=30)
                data = h.data
                if len(data) != MESSAGE or struct.unpack_from("<Q", data)[0] != i:
                    raise BenchError(f"overflow bench: message {i} came back wrong or late")
                del data
                h.release()
            drain = time.perf_counter() - t0
            try:
                rx.recv(timeout=0.05)
                raise BenchError("overflow bench: a message came twice")
            except shmchan.Empty:
                pass
    finally:
        ch.close()
        shmchan.unlink(name)
    plain = os.path.join(directory, f"{name}.plain")
    chunk = _payload(0, body)
    fd = os.open(plain, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(fd, chunk)
        write = time.perf_counter() - t0
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.perf_counter()
        while os.read(fd, MESSAGE):
            pass
        read = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(plain)
    mib = n * MESSAGE / MIB
    return mib / burst, mib / drain, mib / write, mib / read


def _run_overflow(run: Run) -> None:
    n = max(1, run.sizes.overflow_burst // MESSAGE)
    rows: dict[str, list[float]] = {"burst": [], "drain": [], "write": [], "read": []}
    with tempfile.TemporaryDirectory(prefix="shmchan-bench-overflow-", dir="/var/tmp") as d:
        for _ in range(_reps(run)):
            for key, rate in zip(rows, _one_pass(n, d), strict=True):
                rows[key].append(rate)
            run.progress.step("overflow: one repetition")
    size = f"{run.sizes.overflow_burst / MIB:.0f} MiB"
    label_in = f"overflow: {size} burst into a 1 MiB channel, consumer asleep"
    label_out = f"overflow: the {size} drained (recv + release, order checked)"
    checked = n * _reps(run)
    run.results += [
        Result(
            "overflow_burst",
            label_in,
            "shmchan overflow=",
            "MiB/s",
            True,
            rows["burst"],
            note="send timeout=0: no Full; 64 KiB messages",
            checked=checked,
        ),
        Result(
            "overflow_burst",
            label_in,
            "plain file write",
            "MiB/s",
            True,
            rows["write"],
            reference=True,
            note="the same bytes, 64 KiB os.write calls",
        ),
        Result(
            "overflow_drain",
            label_out,
            "shmchan overflow=",
            "MiB/s",
            True,
            rows["drain"],
            note="file -> ring -> recv -> release",
            checked=checked,
        ),
        Result(
            "overflow_drain",
            label_out,
            "plain file read",
            "MiB/s",
            True,
            rows["read"],
            reference=True,
            note="the same bytes, 64 KiB os.read calls",
        ),
    ]


def _steps(sizes: Sizes, nsys: int) -> int:
    return min(sizes.reps, 3)


register("overflow", _run_overflow, steps=_steps, order=75, default=False)
