"""The peers shmchan is measured against: multiprocessing.Queue, faster-fifo, a naive keyed
dispatcher over mp.Queue, and a bare semaphore ping-pong (the wake-up floor)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import posix_ipc

from shmchan.bench.check import BatchCheck
from shmchan.bench.common import (
    CAPACITY,
    FFIFO,
    FILL,
    HDR,
    LAT,
    MPQ,
    NAIVE,
    SEMAPHORE,
    TIMEOUT,
    BenchError,
    bad_payload,
    unique,
)
from shmchan.bench.endpoints import Endpoint


class NaiveKeyedDispatcher:
    """The obvious keyed dispatcher: a backlog list scanned from the front for the first
    message none of whose keys is held.

    Messages are (keys, payload) pairs taken from `get(timeout)` (one pair, or with
    `recv_many` a list of pairs). A message's keys are held from hand-out until
    `release`. Cost per hand-out: O(backlog) -- the design shmchan's wait lines replace.
    """

    def __init__(self, get: Callable[[float], Any]) -> None:
        self._get = get
        self.backlog: list[tuple[tuple[Any, ...], Any]] = []
        self.held: set[Any] = set()

    def recv(self, timeout: float) -> tuple[tuple[Any, ...], Any]:
        held = self.held
        for i, m in enumerate(self.backlog):
            if held.isdisjoint(m[0]):
                del self.backlog[i]
                held.update(m[0])
                return m
        deadline = time.monotonic() + timeout
        while True:
            new: tuple[tuple[Any, ...], Any] = self._get(max(deadline - time.monotonic(), 0.0))
            if held.isdisjoint(new[0]):
                held.update(new[0])
                return new
            self.backlog.append(new)

    def recv_many(self, n: int, timeout: float) -> list[tuple[tuple[Any, ...], Any]]:
        deadline = time.monotonic() + timeout
        held = self.held
        while True:
            out: list[tuple[tuple[Any, ...], Any]] = []
            keep: list[tuple[tuple[Any, ...], Any]] = []
            for m in self.backlog:
                if len(out) < n and held.isdisjoint(m[0]):
                    held.update(m[0])
                    out.append(m)
                else:
                    keep.append(m)
            self.backlog = keep
            if out:
                return out
            self.backlog.extend(self._get(max(deadline - time.monotonic(), 0.0)))

    def release(self, m: tuple[tuple[Any, ...], Any]) -> None:
        self.held.difference_update(m[0])


class QueueEnd(Endpoint):
    """multiprocessing.Queue or faster-fifo: the consumer gets and verifies."""

    def __init__(self, system: str, ctx: Any, capacity: int = CAPACITY) -> None:
        self.system = system
        if system == FFIFO:
            import faster_fifo

            self.q = faster_fifo.Queue(max_size_bytes=capacity)
        else:
            self.q = ctx.Queue()

    def transport(self) -> Any:
        return self.q

    def consume(self, mode: str, n: int, nprod: int, batch: int, size: int) -> int:
        seen = [bytearray(n) for _ in range(nprod)]
        high = [-1] * nprod
        late = 0
        unpack = HDR.unpack_from
        mid = size // 2
        got, total = 0, n * nprod
        if mode == "batch":
            if self.system == FFIFO:
                get_many = self.q.get_many

                def get_batch() -> list[Any]:
                    return get_many(True, TIMEOUT, batch)  # type: ignore[no-any-return]

            else:
                get = self.q.get

                def get_batch() -> list[Any]:
                    return get(True, TIMEOUT)  # type: ignore[no-any-return]

            check = BatchCheck(self.system, n, nprod, size)
            while got < total:
                ms = get_batch()
                check.add(ms)
                got += len(ms)
            return check.finish()
        get1 = self.q.get
        while got < total:
            d = get1(True, TIMEOUT)
            i, p = unpack(d)
            if seen[p][i] or d[-1] != i & 0xFF or d[mid] != FILL or len(d) != size:
                raise bad_payload(self.system, d, size)
            seen[p][i] = 1
            if i < high[p]:
                late += 1
            else:
                high[p] = i
            got += 1
        return late

    def latencies(self, n: int, ack: Any) -> list[float]:
        out = []
        get, clock, unpack = self.q.get, time.perf_counter_ns, LAT.unpack_from
        for k in range(n):
            d = get(True, TIMEOUT)
            t1 = clock()
            t0, j = unpack(d)
            ack.release()
            if j != k:
                raise BenchError(f"{self.system}: ping {j} arrived, expected {k}")
            out.append((t1 - t0) / 1e3)
        return out

    def close(self) -> None:
        if self.system == MPQ:
            self.q.close()
            self.q.join_thread()


class NaiveEnd(Endpoint):
    """The naive keyed dispatcher over a multiprocessing.Queue, releasing every message."""

    system = NAIVE

    def __init__(self, ctx: Any) -> None:
        self.q = ctx.Queue()
        get = self.q.get
        self.disp = NaiveKeyedDispatcher(lambda t: get(True, t))

    def transport(self) -> Any:
        return self.q

    def consume(self, mode: str, n: int, nprod: int, batch: int, size: int) -> int:
        seen = [bytearray(n) for _ in range(nprod)]
        high = [-1] * nprod
        late = 0
        unpack = HDR.unpack_from
        mid = size // 2
        disp = self.disp
        got, total = 0, n * nprod
        if mode == "batch":
            check = BatchCheck(self.system, n, nprod, size)
            while got < total:
                ms = disp.recv_many(batch, TIMEOUT)
                check.add([m[1] for m in ms])
                for m in ms:
                    disp.release(m)
                got += len(ms)
            return check.finish()
        while got < total:
            m = disp.recv(TIMEOUT)
            d = m[1]
            i, p = unpack(d)
            if seen[p][i] or d[-1] != i & 0xFF or d[mid] != FILL or len(d) != size:
                raise bad_payload(self.system, d, size)
            seen[p][i] = 1
            if i < high[p]:
                late += 1
            else:
                high[p] = i
            disp.release(m)
            got += 1
        return late

    def close(self) -> None:
        self.q.close()
        self.q.join_thread()


class SemaphoreEnd(Endpoint):
    """Two bare posix_ipc semaphores and a shared timestamp: the wake-up floor."""

    system = SEMAPHORE

    def __init__(self, ctx: Any) -> None:
        self.names = ("/" + unique("ping"), "/" + unique("pong"))
        self.ping = posix_ipc.Semaphore(self.names[0], posix_ipc.O_CREX, mode=0o600)
        try:
            self.pong = posix_ipc.Semaphore(self.names[1], posix_ipc.O_CREX, mode=0o600)
        except BaseException:
            self.ping.unlink()
            raise
        self.stamp = ctx.RawArray("q", 2)

    def transport(self) -> Any:
        return (self.names[0], self.names[1], self.stamp)

    def latencies(self, n: int, ack: Any) -> list[float]:  # pong is its ack
        out = []
        acquire, release, clock, stamp = (
            self.ping.acquire,
            self.pong.release,
            time.perf_counter_ns,
            self.stamp,
        )
        for k in range(n):
            acquire(TIMEOUT)
            t1 = clock()
            t0, j = stamp[0], stamp[1]
            release()
            if j != k:
                raise BenchError(f"{self.system}: ping {j} arrived, expected {k}")
            out.append((t1 - t0) / 1e3)
        return out

    def close(self) -> None:
        for sem in (self.ping, self.pong):
            with contextlib.suppress(posix_ipc.ExistentialError):
                sem.unlink()
            sem.close()
