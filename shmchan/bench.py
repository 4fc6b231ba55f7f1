"""`python -m shmchan bench`: shmchan side by side with its peers, in one run.

Every workload runs, in one process tree and one run, through shmchan and through its
peers on the same machine: `multiprocessing.Queue`, `faster-fifo` (optional, skipped
with a note when it is not installed) and a naive keyed dispatcher -- the obvious design
that scans its whole backlog for the first message whose keys are free, which is what
shmchan's per-key wait lines exist to beat. The run ends with a table of absolute
figures, each row's ratio to the best peer, and the performance targets of
DESIGN.md / issue #4 with the measured ratio and whether it is met.

How the numbers are taken (so they can be trusted and reproduced):

* Producers are spawned processes that build their payloads, attach, and report ready
  before any clock starts; process start-up is never timed. The consumer is this
  process. A repetition starts when the producers are told to go and ends when the
  consumer has received, verified and released the last message.
* Each figure is the median of several repetitions (min and max shown); one smaller
  warm-up repetition per system comes first and is discarded. Repetitions of the
  systems are interleaved (rep 1 of every system, then rep 2, ...) so slow drift of the
  machine hits every system alike.
* Every payload carries its message index and producer number (struct-packed) and a
  check byte; the consumer checks them, and per-producer order, on every message.
  shmchan and the naive dispatcher release every message. shmchan's consumer reads
  64 B payloads with `h.payload` (a bytes object, as the peers hand out) and 1 MiB
  payloads with the zero-copy `h.data`.
* The cyclic garbage collector is paused during timed sections, for every system alike.
* Latencies use `time.perf_counter_ns()`, which on Linux is CLOCK_MONOTONIC: one
  clock for all processes of the machine.

Nothing here is a hard-coded number: a target that was not measured in this run is
reported as "not measured", never assumed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import math
import mmap
import multiprocessing
import os
import platform
import queue
import statistics
import struct
import subprocess
import sys
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import posix_ipc

import shmchan

__all__ = ["main", "run", "NaiveKeyedDispatcher", "BenchError"]

SCHEMA = "shmchan-bench/1"

# ---------------------------------------------------------------------------------------
# sizes of a run
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """How much work each workload does in one repetition."""

    reps: int
    messages: int  # 64 B messages per repetition, all producers together
    batch: int  # send_many / recv_many batch size
    batched_messages: int
    mib_messages: int  # 1 MiB messages per repetition
    parked: int  # messages parked on the held hot key
    dispatch_messages: int  # free-key messages timed per repetition (shmchan)
    naive_dispatch_messages: int  # the same for the naive dispatcher (it is O(backlog))
    latency_samples: int  # pings per repetition
    latency_gap: float  # seconds between pings: long enough for the consumer to sleep
    producers: tuple[int, ...]


FULL = Sizes(
    reps=5,
    messages=100_000,
    batch=256,
    batched_messages=256 * 1000,
    mib_messages=1000,
    parked=100_000,
    dispatch_messages=20_000,
    naive_dispatch_messages=200,
    latency_samples=400,
    latency_gap=0.001,
    producers=(1, 2, 4),
)
QUICK = Sizes(
    reps=3,
    messages=8_000,
    batch=256,
    batched_messages=256 * 40,
    mib_messages=60,
    parked=100_000,
    dispatch_messages=2_000,
    naive_dispatch_messages=20,
    latency_samples=50,
    latency_gap=0.001,
    producers=(1, 2, 4),
)

WORKLOADS = ("unbatched", "batched", "1mib", "parked", "latency")

SHMCHAN = "shmchan"
MPQ = "mp.Queue"
FFIFO = "faster-fifo"
NAIVE = "naive keyed"
COPY = "memcpy ceiling"
SEMAPHORE = "semaphore ping-pong"

PAYLOAD = 64
MIB = 1 << 20
KEY_SPACE = 1024  # message i carries the key i % KEY_SPACE
CAPACITY = 64 << 20  # channel bytes (and faster-fifo's buffer): room to run ahead
TIMEOUT = 30.0  # seconds any single blocking call may take before the run is failed
READY_TIMEOUT = 120.0  # spawned producers must be up by then
JOIN_TIMEOUT = 10.0

_HDR = struct.Struct("<QI")  # message index, producer number: the first 12 bytes
_LAT = struct.Struct("<qQ")  # send time (perf_counter_ns), ping number
_FILL = 0xA5  # every other byte of a payload but the last
_LAT_PAD = bytes([_FILL]) * (PAYLOAD - _LAT.size)


class BenchError(Exception):
    """The benchmark could not run to the end (a peer failed, a payload was wrong, ...)."""


# ---------------------------------------------------------------------------------------
# payloads
# ---------------------------------------------------------------------------------------


def _payload(i: int, producer: int, size: int = PAYLOAD) -> bytes:
    """Index and producer, then _FILL, then the check byte i % 256."""
    return _HDR.pack(i, producer) + bytes([_FILL]) * (size - _HDR.size - 1) + bytes([i & 0xFF])


def _bad(system: str, data: Any, size: int) -> BenchError:
    try:
        i, p = _HDR.unpack_from(data)
        got = f"message {i} of producer {p}"
    except struct.error:
        got = "an unreadable message"
    return BenchError(
        f"{system}: payload check failed: {got}, length {len(data)} (expected {size}): "
        "corrupt, duplicated or unknown"
    )


class _BatchCheck:
    """The payload check of the batched workloads, the same for every system: every byte
    of every message, each message exactly once, order inversions counted per producer.

    It runs vectorized (numpy) over chunks of a few thousand messages: at millions of
    messages per second a per-message check in Python would cost more than the fastest
    transports themselves. Without numpy it checks message by message instead."""

    CHUNK = 4096

    def __init__(self, system: str, n: int, nprod: int, size: int) -> None:
        self.system, self.n, self.nprod, self.size = system, n, nprod, size
        self.high = [-1] * nprod
        self.late = 0
        self.count = 0
        self.pending: list[bytes] = []
        try:
            import numpy
        except ImportError:
            numpy = None  # type: ignore[assignment]
        if size % 8 or size < 24:
            numpy = None  # type: ignore[assignment]  # the word layout below needs these
        self.np: Any = numpy
        self.seen: list[bytearray] = []
        self.seen_np: Any = None
        if numpy is not None:
            self.seen_np = numpy.zeros(n * nprod, dtype=numpy.bool_)
        else:
            self.seen = [bytearray(n) for _ in range(nprod)]

    def add(self, ds: list[bytes]) -> None:
        self.pending += ds
        if len(self.pending) >= self.CHUNK:
            self._check()

    def finish(self) -> int:
        """Check what is pending, then that every message came; returns the inversions."""
        self._check()
        if self.np is not None:
            self.count = int(self.np.count_nonzero(self.seen_np))
        if self.count != self.n * self.nprod:  # a duplicate within a chunk lands here
            raise BenchError(
                f"{self.system}: {self.n * self.nprod - self.count} messages missing or "
                "delivered twice"
            )
        return self.late

    def _check(self) -> None:
        ds, self.pending = self.pending, []
        if not ds:
            return
        if self.np is None:
            self._check_each(ds)
        else:
            self._check_vectorized(ds)

    def _check_each(self, ds: list[bytes]) -> None:
        seen, high, size, unpack, mid = self.seen, self.high, self.size, _HDR.unpack_from, 24
        for d in ds:
            i, p = unpack(d)
            if seen[p][i] or d[-1] != i & 0xFF or d[mid] != _FILL or len(d) != size:
                raise _bad(self.system, d, size)
            seen[p][i] = 1
            if i < high[p]:
                self.late += 1
            else:
                high[p] = i
        self.count += len(ds)

    def _check_vectorized(self, ds: list[bytes]) -> None:
        np, size, k = self.np, self.size, len(ds)
        blob = b"".join(ds)
        if len(blob) != k * size:
            raise _bad(self.system, next(d for d in ds if len(d) != size), size)
        # A payload as little-endian words: [index] [producer | 4 fill] [8 fill] ...
        # [7 fill | check byte]; see _payload.
        u64 = np.uint64
        fill = u64(int.from_bytes(bytes([_FILL]) * 8, "little"))
        w = np.frombuffer(blob, dtype="<u8").reshape(k, size // 8)
        idx, prod = w[:, 0], w[:, 1] & u64(0xFFFFFFFF)
        ok = (prod < self.nprod) & (idx < self.n)
        ok &= (w[:, 1] >> u64(32)) == (fill >> u64(32))
        ok &= (w[:, 2:-1] == fill).all(axis=1)
        ok &= (w[:, -1] & u64(0x00FFFFFFFFFFFFFF)) == (fill >> u64(8))
        ok &= (w[:, -1] >> u64(56)) == (idx & u64(0xFF))
        if not ok.all():
            raise _bad(self.system, ds[int(np.argmin(ok))], size)
        flat = (prod * u64(self.n) + idx).astype(np.int64)
        if self.seen_np[flat].any():
            raise _bad(self.system, ds[int(np.argmax(self.seen_np[flat]))], size)
        self.seen_np[flat] = True
        for p in range(self.nprod):
            sub = (idx if self.nprod == 1 else idx[prod == p]).astype(np.int64)
            if sub.size:
                before = np.maximum.accumulate(np.concatenate(([self.high[p]], sub)))[:-1]
                self.late += int((sub < before).sum())
                self.high[p] = max(self.high[p], int(sub.max()))


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


# ---------------------------------------------------------------------------------------
# producers (spawned processes)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    system: str
    mode: str  # "msg", "batch", "mib", "latency"
    producer: int
    count: int  # most messages one repetition may ask for
    batch: int = 1
    gap: float = 0.0
    ack: str = ""  # latency: a semaphore the consumer posts once it has each ping


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _producer_main(conn: Connection, job: _Job, transport: Any) -> None:
    """Spawned producer: build payloads, say ready, then send `n` messages per request."""
    try:
        send = _make_producer(job, transport)
        conn.send(("ready", os.getpid()))
        while True:
            n = conn.recv()
            if n is None:
                break
            with _no_gc():
                send(n)
            conn.send(("done", None))
    except BaseException:  # report everything, KeyboardInterrupt included, then exit
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))


def _make_producer(job: _Job, transport: Any) -> Callable[[int], None]:
    sysname, mode, p = job.system, job.mode, job.producer
    if sysname == SEMAPHORE:
        return _semaphore_pinger(job, transport)
    if sysname == SHMCHAN:
        tx = transport
        if mode == "latency":

            def put(obj: Any, i: int) -> None:
                tx.send(obj, i % KEY_SPACE, TIMEOUT)

        elif mode == "batch":

            def put(obj: Any, i: int) -> None:
                tx.send_many(obj, TIMEOUT)

        else:

            def put(obj: Any, i: int) -> None:
                tx.send(obj, i % KEY_SPACE, TIMEOUT)

    elif sysname == FFIFO:
        q = transport
        if mode == "batch":

            def put(obj: Any, i: int) -> None:
                q.put_many(obj, True, TIMEOUT)

        else:

            def put(obj: Any, i: int) -> None:
                q.put(obj, True, TIMEOUT)

    elif sysname in (MPQ, NAIVE):
        q = transport
        if mode == "mib":
            # mp.Queue pickles in a feeder thread after put() returns: give it bytes
            # that the next message will not overwrite.
            def put(obj: Any, i: int) -> None:
                q.put(bytes(obj), True, TIMEOUT)

        else:

            def put(obj: Any, i: int) -> None:
                q.put(obj, True, TIMEOUT)

    else:
        raise BenchError(f"unknown system {sysname!r}")

    if mode == "latency":
        gap = job.gap

        # Ping-pong, the floor's shape: after each ping the producer blocks until the
        # consumer has it (not timed), so both sides are idle when the next one goes.
        ack = posix_ipc.Semaphore(job.ack)

        def send_latency(n: int) -> None:
            sleep, clock, pack, wait = time.sleep, time.perf_counter_ns, _LAT.pack, ack.acquire
            for k in range(n):
                sleep(gap)
                put(pack(clock(), k) + _LAT_PAD, k)
                wait(TIMEOUT)

        return send_latency

    if mode == "mib":
        buf = bytearray([_FILL]) * MIB

        def send_mib(n: int) -> None:
            pack_into = _HDR.pack_into
            for i in range(n):
                pack_into(buf, 0, i, p)
                buf[-1] = i & 0xFF
                put(buf, i)

        return send_mib

    payloads = [_payload(i, p) for i in range(job.count)]
    if sysname == NAIVE:
        items: list[Any] = [((i % KEY_SPACE,), payloads[i]) for i in range(job.count)]
    elif sysname == SHMCHAN and mode == "batch":
        items = [(payloads[i], i % KEY_SPACE) for i in range(job.count)]
    else:
        items = payloads

    if mode == "batch":
        b = job.batch
        batches = [items[i : i + b] for i in range(0, job.count, b)]

        def send_batches(n: int) -> None:
            for j in range(n // b):
                put(batches[j], j)

        return send_batches

    def send_each(n: int) -> None:
        for i in range(n):
            put(items[i], i)

    return send_each


def _semaphore_pinger(job: _Job, transport: Any) -> Callable[[int], None]:
    ping_name, pong_name, stamp = transport
    ping = posix_ipc.Semaphore(ping_name)
    pong = posix_ipc.Semaphore(pong_name)
    gap = job.gap

    def run(n: int) -> None:
        sleep, clock = time.sleep, time.perf_counter_ns
        for k in range(n):
            sleep(gap)
            stamp[0] = clock()
            stamp[1] = k
            ping.release()
            pong.acquire(TIMEOUT)

    return run


class _Group:
    """One system's producer processes: started together, told to go together."""

    def __init__(self, ctx: Any, system: str, jobs: Sequence[tuple[_Job, Any]]) -> None:
        self.system = system
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        try:
            for job, transport in jobs:
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=_producer_main,
                    args=(theirs, job, transport),
                    name=f"shmchan-bench-{system}-{job.producer}",
                    daemon=True,
                )
                self.conns.append(mine)
                try:
                    proc.start()
                finally:
                    theirs.close()
                self.procs.append(proc)
        except BaseException:
            self.close()
            raise

    def _answer(self, i: int, want: str, timeout: float) -> Any:
        conn, proc = self.conns[i], self.procs[i]
        try:
            if not conn.poll(timeout):
                raise BenchError(f"{self.system} producer {i}: no answer within {timeout:g} s")
            tag, value = conn.recv()
        except (EOFError, OSError):
            proc.join(1)
            raise BenchError(
                f"{self.system} producer {i} exited unexpectedly (exit code {proc.exitcode})"
            ) from None
        if tag == "error":
            raise BenchError(f"{self.system} producer {i} failed:\n{value}")
        if tag != want:
            raise BenchError(f"{self.system} producer {i}: expected {want!r}, got {tag!r}")
        return value

    def wait_ready(self) -> None:
        for i in range(len(self.conns)):
            self._answer(i, "ready", READY_TIMEOUT)

    def go(self, n: int) -> None:
        for conn in self.conns:
            conn.send(n)

    def wait_done(self) -> None:
        for i in range(len(self.conns)):
            self._answer(i, "done", TIMEOUT)

    def failure(self) -> str:
        """A producer's error report, if one has sent any (for a consumer that timed out)."""
        for i, conn in enumerate(self.conns):
            with contextlib.suppress(Exception):
                if conn.poll(0):
                    tag, value = conn.recv()
                    if tag == "error":
                        return f"{self.system} producer {i} failed:\n{value}"
            if not self.procs[i].is_alive():
                return f"{self.system} producer {i} exited (exit code {self.procs[i].exitcode})"
        return ""

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.send(None)
        for proc in self.procs:
            proc.join(JOIN_TIMEOUT)
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_TIMEOUT)
        for conn in self.conns:
            conn.close()


# ---------------------------------------------------------------------------------------
# consumers (this process)
# ---------------------------------------------------------------------------------------


def _unique(tag: str) -> str:
    return f"bench-{os.getpid()}-{tag}-{uuid.uuid4().hex[:8]}"


class _Endpoint:
    """One system's receiving end for a workload, and what its producers need."""

    system = ""

    def transport(self) -> Any:
        raise NotImplementedError

    def consume(self, mode: str, n: int, nprod: int, batch: int, size: int) -> int:
        """Receive, check and release n messages from each of nprod producers; every
        message must arrive exactly once and intact. Returns how many arrived after a
        later message of the same producer (order inversions, counted, not fatal)."""
        raise NotImplementedError

    def latencies(self, n: int, ack: Any) -> list[float]:
        """n pings' wake-up latencies in microseconds; posts `ack` once it has each."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class _ShmchanEnd(_Endpoint):
    system = SHMCHAN

    def __init__(self, capacity: int = CAPACITY, max_messages: int | None = None) -> None:
        self.name = _unique("ch")
        self.ch = shmchan.Channel.create(self.name, capacity, max_messages=max_messages)
        try:
            self.rx = self.ch.receiver()
        except BaseException:
            self.ch.close()
            shmchan.unlink(self.name)
            raise

    def transport(self) -> Any:
        return self.ch.sender()

    def consume(self, mode: str, n: int, nprod: int, batch: int, size: int) -> int:
        seen = [bytearray(n) for _ in range(nprod)]
        high = [-1] * nprod
        late = 0
        unpack = _HDR.unpack_from
        mid = size // 2
        got, total = 0, n * nprod
        # The peers hand out bytes objects: the like-for-like call is h.payload (a copy).
        # The zero-copy view h.data is what 1 MiB payloads are read with.
        zero_copy = mode == "mib"
        if mode == "batch":
            recv_many, release_many = self.rx.recv_many, self.rx.release_many
            check = _BatchCheck(self.system, n, nprod, size)
            while got < total:
                hs = recv_many(batch, TIMEOUT)
                check.add([h.payload for h in hs])
                release_many(hs)  # the batch API: one C call for the whole batch
                got += len(hs)
            return check.finish()
        recv = self.rx.recv
        while got < total:
            h = recv(TIMEOUT)
            d = h.data if zero_copy else h.payload
            i, p = unpack(d)
            if seen[p][i] or d[-1] != i & 0xFF or d[mid] != _FILL or len(d) != size:
                raise _bad(self.system, d, size)
            seen[p][i] = 1
            if i < high[p]:
                late += 1
            else:
                high[p] = i
            h.release()
            got += 1
        return late

    def latencies(self, n: int, ack: Any) -> list[float]:
        out = []
        recv, clock, unpack = self.rx.recv, time.perf_counter_ns, _LAT.unpack_from
        for k in range(n):
            h = recv(TIMEOUT)
            t1 = clock()
            t0, j = unpack(h.data)
            h.release()
            ack.release()
            if j != k:
                raise BenchError(f"{self.system}: ping {j} arrived, expected {k}")
            out.append((t1 - t0) / 1e3)
        return out

    def close(self) -> None:
        try:
            self.rx.close()
            self.ch.close()
        finally:
            shmchan.unlink(self.name)


class _QueueEnd(_Endpoint):
    """multiprocessing.Queue or faster-fifo: the consumer gets and verifies."""

    def __init__(self, system: str, ctx: Any) -> None:
        self.system = system
        if system == FFIFO:
            import faster_fifo

            self.q = faster_fifo.Queue(max_size_bytes=CAPACITY)
        else:
            self.q = ctx.Queue()

    def transport(self) -> Any:
        return self.q

    def consume(self, mode: str, n: int, nprod: int, batch: int, size: int) -> int:
        seen = [bytearray(n) for _ in range(nprod)]
        high = [-1] * nprod
        late = 0
        unpack = _HDR.unpack_from
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

            check = _BatchCheck(self.system, n, nprod, size)
            while got < total:
                ms = get_batch()
                check.add(ms)
                got += len(ms)
            return check.finish()
        get1 = self.q.get
        while got < total:
            d = get1(True, TIMEOUT)
            i, p = unpack(d)
            if seen[p][i] or d[-1] != i & 0xFF or d[mid] != _FILL or len(d) != size:
                raise _bad(self.system, d, size)
            seen[p][i] = 1
            if i < high[p]:
                late += 1
            else:
                high[p] = i
            got += 1
        return late

    def latencies(self, n: int, ack: Any) -> list[float]:
        out = []
        get, clock, unpack = self.q.get, time.perf_counter_ns, _LAT.unpack_from
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


class _NaiveEnd(_Endpoint):
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
        unpack = _HDR.unpack_from
        mid = size // 2
        disp = self.disp
        got, total = 0, n * nprod
        if mode == "batch":
            check = _BatchCheck(self.system, n, nprod, size)
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
            if seen[p][i] or d[-1] != i & 0xFF or d[mid] != _FILL or len(d) != size:
                raise _bad(self.system, d, size)
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


class _SemaphoreEnd(_Endpoint):
    """Two bare posix_ipc semaphores and a shared timestamp: the wake-up floor."""

    system = SEMAPHORE

    def __init__(self, ctx: Any) -> None:
        self.names = ("/" + _unique("ping"), "/" + _unique("pong"))
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


# ---------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------


@dataclass
class Result:
    """One row: one system's figure for one workload, over the repetitions."""

    workload: str  # machine-readable workload key, e.g. "unbatched_p1"
    label: str  # what a reader sees, e.g. "64 B unbatched, 1 producer"
    system: str
    unit: str  # "msg/s", "MiB/s", "us", "us/msg"
    higher_is_better: bool
    samples: list[float]  # one per repetition
    reference: bool = False  # a ceiling or floor, not a peer
    note: str = ""
    vs_best_peer: float | None = None
    out_of_order: int = 0  # messages received after a later one of the same producer
    checked: int = 0  # messages whose payload, exactly-once delivery and order were checked

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def as_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "label": self.label,
            "system": self.system,
            "unit": self.unit,
            "higher_is_better": self.higher_is_better,
            "median": self.median,
            "min": self.min,
            "max": self.max,
            "samples": self.samples,
            "reference": self.reference,
            "vs_best_peer": self.vs_best_peer,
            "note": self.note,
            "checked": self.checked,
            "out_of_order": self.out_of_order,
        }


def _goodness(r: Result, value: float) -> float:
    return value if r.higher_is_better else 1.0 / value


def _rank(results: list[Result]) -> None:
    """Set vs_best_peer: each row's median relative to the best peer's, > 1 = better."""
    by_workload: dict[str, list[Result]] = {}
    for r in results:
        by_workload.setdefault(r.workload, []).append(r)
    for rows in by_workload.values():
        peers = [r for r in rows if r.system != SHMCHAN and not r.reference]
        if not peers:
            continue
        best = max(_goodness(r, r.median) for r in peers)
        for r in rows:
            if not r.reference:
                r.vs_best_peer = _goodness(r, r.median) / best


@dataclass
class Target:
    name: str
    measured: float | None
    target: float
    comparison: str  # ">=" or "<="
    detail: str
    source: str = "issue #4"

    @property
    def met(self) -> bool | None:
        if self.measured is None:
            return None
        if self.comparison == ">=":
            return self.measured >= self.target
        return self.measured <= self.target

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "measured": self.measured,
            "target": self.target,
            "comparison": self.comparison,
            "met": self.met,
            "detail": self.detail,
            "source": self.source,
        }


def _find(results: list[Result], workload: str, system: str) -> Result | None:
    for r in results:
        if r.workload == workload and r.system == system:
            return r
    return None


def _targets(results: list[Result]) -> list[Target]:
    def med(workload: str, system: str) -> float | None:
        r = _find(results, workload, system)
        return None if r is None else r.median

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    out = []
    peers = [v for v in (med("unbatched_p1", MPQ), med("unbatched_p1", FFIFO)) if v is not None]
    best_peer = max(peers) if peers else None
    which = {
        2: "mp.Queue and faster-fifo",
        1: "mp.Queue (faster-fifo missing)",
        0: "mp.Queue and faster-fifo",
    }[len(peers)]
    out.append(
        Target(
            "64 B unbatched: shmchan / best peer",
            ratio(med("unbatched_p1", SHMCHAN), best_peer),
            5.0,
            ">=",
            f"send/recv/release vs the best of {which}, 1 producer",
        )
    )
    out.append(
        Target(
            "64 B batched: shmchan / mp.Queue",
            ratio(med("batched", SHMCHAN), med("unbatched_p1", MPQ)),
            20.0,
            ">=",
            "send_many/recv_many vs mp.Queue put/get (it has no batch API)",
        )
    )
    shm_batched = med("batched", SHMCHAN)
    out.append(
        Target(
            "64 B batched: shmchan msg/s",
            shm_batched,
            2e6,
            ">=",
            "absolute rate with send_many/recv_many",
            source="DESIGN.md",
        )
    )
    out.append(
        Target(
            "1 MiB: shmchan / memcpy ceiling",
            ratio(med("1mib", SHMCHAN), med("1mib", COPY)),
            0.5,
            ">=",
            "bandwidth vs a plain copy into shared memory, same run",
        )
    )
    out.append(
        Target(
            "100k parked: cost / no backlog",
            ratio(med("dispatch_parked", SHMCHAN), med("dispatch_free", SHMCHAN)),
            1.2,
            "<=",
            "send->recv->release of a free-key message, 100k parked on a held key vs none",
        )
    )
    out.append(
        Target(
            "idle wake-up median: shmchan / semaphore",
            ratio(med("latency_median", SHMCHAN), med("latency_median", SEMAPHORE)),
            2.0,
            "<=",
            "send->recv of an idle consumer vs a bare posix_ipc semaphore ping-pong",
        )
    )
    return out


# ---------------------------------------------------------------------------------------
# progress
# ---------------------------------------------------------------------------------------


class _Progress:
    """tqdm on stderr when it is installed and stderr is a terminal; else a plain line."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled = enabled
        self.total = total
        self.done = 0
        self.bar: Any = None
        self._last = 0.0
        self._start = time.monotonic()
        if enabled and importlib.util.find_spec("tqdm") is not None:
            import tqdm  # type: ignore[import-untyped,unused-ignore]  # optional; no stubs

            tqdm.tqdm.monitor_interval = 0  # no monitor thread next to timed loops
            self.bar = tqdm.tqdm(
                total=total,
                file=sys.stderr,
                unit="step",
                delay=2.0,
                leave=False,
                dynamic_ncols=True,
            )

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description_str(what, refresh=False)
            self.bar.update(1)
            return
        now = time.monotonic()
        if now - self._start > 2.0 and now - self._last > 0.5:
            self._last = now
            sys.stderr.write(f"\r[{self.done}/{self.total}] {what[:60]:<60}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and time.monotonic() - self._start > 2.0:
            sys.stderr.write("\r" + " " * 80 + "\r")
            sys.stderr.flush()


# ---------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------


@dataclass
class _Run:
    sizes: Sizes
    systems: list[str]  # peers and shmchan available for channel workloads
    ctx: Any
    progress: _Progress
    results: list[Result] = field(default_factory=list)


def _warmup(n: int, unit: int = 1) -> int:
    return max(unit, (n // 10) // unit * unit)


def _endpoint(run: _Run, system: str, mode: str) -> _Endpoint:
    if system == SHMCHAN:
        return _ShmchanEnd()
    if system == NAIVE:
        return _NaiveEnd(run.ctx)
    if system == SEMAPHORE:
        return _SemaphoreEnd(run.ctx)
    return _QueueEnd(system, run.ctx)


def _throughput(
    run: _Run,
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
) -> None:
    """Run one throughput workload on every system, repetitions interleaved."""
    notes = notes or {}
    samples: dict[str, list[float]] = {s: [] for s in systems}
    late: dict[str, int] = {s: 0 for s in systems}
    copy_samples: list[float] = []
    scale = size / MIB if unit == "MiB/s" else 1.0
    with contextlib.ExitStack() as stack:
        ends: dict[str, _Endpoint] = {}
        groups: dict[str, _Group] = {}
        for s in systems:
            end = _endpoint(run, s, mode)
            stack.callback(end.close)
            ends[s] = end
        for s in systems:
            jobs = [
                (_Job(s, mode, p, per_producer, batch), ends[s].transport()) for p in range(nprod)
            ]
            group = _Group(run.ctx, s, jobs)
            stack.callback(group.close)
            groups[s] = group
        for s in systems:
            groups[s].wait_ready()
        run.progress.step(f"{label}: started")
        for rep in range(-1, run.sizes.reps):
            n = (warmup or _warmup(per_producer, batch)) if rep < 0 else per_producer
            total = n * nprod
            for s in systems:
                group, end = groups[s], ends[s]
                with _no_gc():
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
                checked=(per_producer * run.sizes.reps + (warmup or _warmup(per_producer, batch)))
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


def _run_unbatched(run: _Run) -> None:
    systems = [s for s in (SHMCHAN, MPQ, FFIFO, NAIVE) if s in run.systems]
    for nprod in run.sizes.producers:
        per = run.sizes.messages // nprod
        _throughput(
            run,
            workload=f"unbatched_p{nprod}",
            label=f"64 B unbatched, {nprod} producer{'s' if nprod > 1 else ''}",
            mode="msg",
            systems=systems,
            nprod=nprod,
            per_producer=per,
            batch=1,
            size=PAYLOAD,
            unit="msg/s",
            notes={
                SHMCHAN: "send / recv / payload / release",
                NAIVE: "over mp.Queue, key bookkeeping",
            },
        )


def _run_batched(run: _Run) -> None:
    systems = [s for s in (SHMCHAN, MPQ, FFIFO, NAIVE) if s in run.systems]
    b = run.sizes.batch
    _throughput(
        run,
        workload="batched",
        label=f"64 B batched ({b}), 1 producer",
        mode="batch",
        systems=systems,
        nprod=1,
        per_producer=run.sizes.batched_messages // b * b,
        batch=b,
        size=PAYLOAD,
        unit="msg/s",
        notes={
            SHMCHAN: "send_many / recv_many / payload / release",
            MPQ: f"a list of {b} per put (hand-batched)",
            FFIFO: "put_many / get_many",
            NAIVE: f"lists of {b} over mp.Queue",
        },
    )


class _CopyCeiling:
    """A shared-memory buffer as large as the channel's ring, filled 1 MiB at a time."""

    def __init__(self, size: int) -> None:
        self.name = "/" + _unique("copy")
        shm = posix_ipc.SharedMemory(self.name, posix_ipc.O_CREX, mode=0o600, size=size)
        try:
            self.map = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        self.view = memoryview(self.map)
        self.src = bytes([_FILL]) * MIB
        self.size = size

    def __call__(self, n: int) -> float:
        """Copy n MiB; return MiB/s."""
        view, src, size = self.view, self.src, self.size
        off = 0
        with _no_gc():
            t0 = time.perf_counter()
            for _ in range(n):
                if off + MIB > size:
                    off = 0
                view[off : off + MIB] = src
                off += MIB
            elapsed = time.perf_counter() - t0
        return n / elapsed

    def close(self) -> None:
        self.view.release()
        self.map.close()
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.name)


def _run_mib(run: _Run) -> None:
    systems = [s for s in (SHMCHAN, MPQ, FFIFO) if s in run.systems]
    ceiling = _CopyCeiling(CAPACITY)
    try:
        _throughput(
            run,
            workload="1mib",
            label="1 MiB payloads, 1 producer",
            mode="mib",
            systems=systems,
            nprod=1,
            per_producer=run.sizes.mib_messages,
            batch=1,
            size=MIB,
            unit="MiB/s",
            notes={
                SHMCHAN: "one copy into the ring; read in place (h.data)",
                MPQ: "bytes() per message: put() pickles later, in a thread",
            },
            ceiling=ceiling,
            # Every page of the ring (and of the copy buffer) is touched before timing:
            # first-touch page faults are start-up, not bandwidth.
            warmup=CAPACITY // MIB + 1,
        )
    finally:
        ceiling.close()


def _dispatch_shmchan(end: _ShmchanEnd, tx: Any, payloads: list[bytes], n: int) -> float:
    """µs per send -> recv -> release of a message on a free key, in this process."""
    send, recv, unpack = tx.send, end.rx.recv, _HDR.unpack_from
    with _no_gc():
        t0 = time.perf_counter()
        for i in range(n):
            send(payloads[i], i, TIMEOUT)
            h = recv(TIMEOUT)
            d = h.payload
            if unpack(d)[0] != i or d[-1] != i & 0xFF:
                raise _bad(SHMCHAN, d, PAYLOAD)
            h.release()
        elapsed = time.perf_counter() - t0
    return elapsed / n * 1e6


def _dispatch_naive(
    disp: NaiveKeyedDispatcher, intake: deque[Any], items: list[Any], n: int
) -> float:
    unpack = _HDR.unpack_from
    append = intake.append
    with _no_gc():
        t0 = time.perf_counter()
        for i in range(n):
            append(items[i])
            m = disp.recv(TIMEOUT)
            d = m[1]
            if unpack(d)[0] != i or d[-1] != i & 0xFF:
                raise _bad(NAIVE, d, PAYLOAD)
            disp.release(m)
        elapsed = time.perf_counter() - t0
    return elapsed / n * 1e6


def _park(run: _Run, end: _ShmchanEnd, tx: Any, parked: int) -> Any:
    """Hold a handle on "hot" and get `parked` messages on "hot" into the receiver's window."""
    hot_payload = _payload(0, 0)
    tx.send(hot_payload, "hot", TIMEOUT)
    hot = end.rx.recv(TIMEOUT)
    chunk = [(hot_payload, "hot")] * 1000
    for start in range(0, parked, 1000):
        tx.send_many(chunk[: min(1000, parked - start)], TIMEOUT)
    deadline = time.monotonic() + TIMEOUT
    polls = 0
    while True:
        h = end.rx.try_recv()
        if h is not None:
            raise BenchError("shmchan: a message on a held key was handed out")
        polls += 1
        if polls % 64 == 0:
            st = end.ch.stats()
            if st.window >= parked + 1 and st.queued >= parked:
                return hot
            if time.monotonic() > deadline:
                raise BenchError(f"shmchan: only {st.window} of {parked + 1} messages taken in")


def _run_parked(run: _Run) -> None:
    sz = run.sizes
    n, n_naive = sz.dispatch_messages, sz.naive_dispatch_messages
    max_messages = 1 << max(18, math.ceil(math.log2(sz.parked + 1024)))
    per_rec = 256  # upper bound of one 64 B record with one key
    capacity = max(CAPACITY, (sz.parked + (sz.reps + 1) * n + 1024) * per_rec)
    payloads = [_payload(i, 0) for i in range(max(n, n_naive))]
    free_label = "dispatch, no backlog"
    parked_label = f"dispatch, {sz.parked:,} parked on a held key"
    samples: dict[tuple[str, str], list[float]] = {
        (w, s): [] for w in ("dispatch_free", "dispatch_parked") for s in (SHMCHAN, NAIVE)
    }
    with contextlib.ExitStack() as stack:
        free = _ShmchanEnd(capacity, max_messages)
        stack.callback(free.close)
        busy = _ShmchanEnd(capacity, max_messages)
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
            k = _warmup(n) if rep < 0 else n
            kn = _warmup(n_naive) if rep < 0 else n_naive
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


def _run_latency(run: _Run) -> None:
    sz = run.sizes
    systems = [SHMCHAN, SEMAPHORE] + [s for s in (MPQ, FFIFO) if s in run.systems]
    medians: dict[str, list[float]] = {s: [] for s in systems}
    p99s: dict[str, list[float]] = {s: [] for s in systems}
    label = "idle wake-up latency"
    with contextlib.ExitStack() as stack:
        ends: dict[str, _Endpoint] = {}
        groups: dict[str, _Group] = {}
        acks: dict[str, Any] = {}
        for s in systems:
            end = _endpoint(run, s, "latency")
            stack.callback(end.close)
            ends[s] = end
            ack = acks[s] = posix_ipc.Semaphore("/" + _unique("ack"), posix_ipc.O_CREX, mode=0o600)
            stack.callback(ack.unlink)
            job = _Job(s, "latency", 0, sz.latency_samples, gap=sz.latency_gap, ack=ack.name)
            group = _Group(run.ctx, s, [(job, end.transport())])
            stack.callback(group.close)
            groups[s] = group
        for s in systems:
            groups[s].wait_ready()
        run.progress.step(f"{label}: started")
        for rep in range(-1, sz.reps):
            n = _warmup(sz.latency_samples) if rep < 0 else sz.latency_samples
            for s in systems:
                groups[s].go(n)
                try:
                    with _no_gc():
                        lat = ends[s].latencies(n, acks[s])
                except (queue.Empty, shmchan.Empty, posix_ipc.BusyError):
                    why = groups[s].failure()
                    raise BenchError(
                        f"{s}: no ping for {TIMEOUT:g} s" + (f"\n{why}" if why else "")
                    ) from None
                groups[s].wait_done()
                if rep >= 0:
                    lat.sort()
                    medians[s].append(statistics.median(lat))
                    p99s[s].append(lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)])
                run.progress.step(f"{label}: {s}")
    notes = {
        SHMCHAN: "send -> recv, consumer asleep; ping-pong like the floor",
        SEMAPHORE: "post -> wait of a bare posix_ipc semaphore",
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
                    checked=sz.latency_samples * sz.reps + _warmup(sz.latency_samples),
                )
            )


_RUNNERS: dict[str, Callable[[_Run], None]] = {
    "unbatched": _run_unbatched,
    "batched": _run_batched,
    "1mib": _run_mib,
    "parked": _run_parked,
    "latency": _run_latency,
}


def _steps(sizes: Sizes, workloads: Sequence[str], nsys: int) -> int:
    reps = sizes.reps + 1
    total = 0
    for w in workloads:
        if w == "unbatched":
            total += len(sizes.producers) * (1 + reps * nsys)
        elif w == "batched":
            total += 1 + reps * nsys
        elif w == "1mib":
            total += 1 + reps * (min(nsys, 3) + 1)
        elif w == "parked":
            total += 1 + reps * 2
        elif w == "latency":
            total += 1 + reps * (min(nsys, 3) + 1)
    return total


# ---------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------


def _revision() -> str | None:
    """The git commit shmchan runs from (+ "-dirty" if its sources differ), if in a checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(shmchan.__file__ or "")))
    if not os.path.isdir(os.path.join(root, ".git")):
        return None
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "csrc", "shmchan"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    model = ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count() or 0
    versions = {"shmchan": shmchan.__version__}
    for dist in ("faster-fifo", "posix-ipc", "cffi"):
        with contextlib.suppress(Exception):
            import importlib.metadata

            versions[dist] = importlib.metadata.version(dist)
    return {
        "revision": _revision(),
        "cpu_model": model or platform.processor() or "unknown",
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "kernel": platform.release(),
        "versions": versions,
    }


def run(
    quick: bool = False,
    workloads: Sequence[str] = WORKLOADS,
    reps: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Run the benchmark; returns the report (what --json prints)."""
    sizes = QUICK if quick else FULL
    if reps is not None:
        sizes = Sizes(**{**sizes.__dict__, "reps": reps})
    systems = [SHMCHAN, MPQ, NAIVE]
    skipped = []
    if importlib.util.find_spec("faster_fifo") is not None:
        # Importing it lets spawned processes receive faster-fifo queues. No stubs.
        import faster_fifo_reduction  # type: ignore[import-untyped,unused-ignore]  # noqa: F401

        systems.insert(2, FFIFO)
    else:
        skipped.append({"system": FFIFO, "reason": "not installed (pip install 'shmchan[bench]')"})
    started = datetime.datetime.now(datetime.UTC)
    load = [round(x, 2) for x in os.getloadavg()]  # before we add any load of our own
    bar = _Progress(_steps(sizes, workloads, len(systems)), progress)
    state = _Run(sizes, systems, multiprocessing.get_context("spawn"), bar)
    t0 = time.monotonic()
    try:
        for w in workloads:
            _RUNNERS[w](state)
    finally:
        bar.close()
    _rank(state.results)
    return {
        "schema": SCHEMA,
        "started": started.isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - t0, 1),
        "quick": quick,
        "repetitions": sizes.reps,
        "machine": machine() | {"loadavg_at_start": load},
        "sizes": sizes.__dict__ | {"producers": list(sizes.producers)},
        "workloads": list(workloads),
        "systems": systems,
        "skipped": skipped,
        "results": [r.as_dict() for r in state.results],
        "targets": [t.as_dict() for t in _targets(state.results)],
    }


# ---------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------


def _num(value: float, unit: str) -> str:
    if unit == "msg/s":
        if value >= 1e6:
            return f"{value / 1e6:.2f} M"
        if value >= 1e3:
            return f"{value / 1e3:.1f} k"
        return f"{value:.0f}"
    if unit == "MiB/s":
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _ratio(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x"


def format_table(report: dict[str, Any]) -> str:
    """The report as text: machine, results table, targets."""
    m = report["machine"]
    lines = [
        f"shmchan bench ({'quick' if report['quick'] else 'full'} run, "
        f"{report['repetitions']} repetitions each; median [min - max]; {report['seconds']} s)",
        f"machine: {m['cpu_model']}, {m['usable_cpus']} usable of {m['logical_cpus']} "
        f"logical CPUs, {m['implementation']} {m['python']}, Linux {m['kernel']}",
    ]
    if m.get("revision"):
        lines.append(f"shmchan {m['versions']['shmchan']} at {m['revision']}")
    load = m["loadavg_at_start"][0]
    if load > 0.5 * max(m["usable_cpus"], 1):
        lines.append(
            f"WARNING: load average {load:.2f} at start on {m['usable_cpus']} CPUs: other work "
            "was running, so figures and ratios may be noisy. Re-run on an idle machine."
        )
    for s in report["skipped"]:
        lines.append(f"note: {s['system']} skipped: {s['reason']}")
    lines.append("")
    header = ("workload", "system", "median", "min", "max", "unit", "vs best peer", "notes")
    rows: list[tuple[str, ...]] = []
    last = None
    for r in report["results"]:
        label = r["label"] if r["label"] != last else ""
        last = r["label"]
        rows.append(
            (
                label,
                r["system"] + (" (ref)" if r["reference"] else ""),
                _num(r["median"], r["unit"]),
                _num(r["min"], r["unit"]),
                _num(r["max"], r["unit"]),
                r["unit"],
                _ratio(r["vs_best_peer"]),
                r["note"],
            )
        )
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    right = {2, 3, 4, 6}

    def fmt(row: Sequence[str]) -> str:
        cells = [
            row[i].rjust(widths[i]) if i in right else row[i].ljust(widths[i])
            for i in range(len(row))
        ]
        return "  ".join(cells).rstrip()

    lines.append(fmt(header))
    lines.append(fmt(["-" * w for w in widths]))
    for i, row in enumerate(rows):
        if row[0] and i:
            lines.append("")
        lines.append(fmt(row))
    lines.append("")
    lines.append(
        "vs best peer: the row's median over the best of mp.Queue / faster-fifo / naive keyed "
        "for that workload; > 1 means better (faster, or lower latency / cost)."
    )
    checked = sum(r["checked"] for r in report["results"])
    lines.append(
        f"Verified: {checked:,} messages arrived exactly once with intact payloads "
        "(index, producer, check bytes)."
    )
    for r in report["results"]:
        if r["out_of_order"]:
            lines.append(
                f"order: {r['system']} handed out {r['out_of_order']:,} of {r['checked']:,} "
                f"messages in '{r['label']}' after a later message of the same producer"
            )
    if any(r["out_of_order"] for r in report["results"]):
        lines.append(
            "  (with several producers sharing keys this is allowed: a message waits behind "
            "another producer's earlier message on its key while its successor's key is free)"
        )
    lines.append("")
    lines.append("Targets (ratios of medians from this run):")
    tw = max(len(t["name"]) for t in report["targets"]) if report["targets"] else 0
    for t in report["targets"]:
        if t["measured"] is None:
            value, verdict = "not measured", ""
        elif t["name"].endswith("msg/s"):
            value = _num(t["measured"], "msg/s") + " msg/s"
            verdict = "met" if t["met"] else "NOT met"
        else:
            value = f"{t['measured']:.2f}x"
            verdict = "met" if t["met"] else "NOT met"
        goal = (
            _num(t["target"], "msg/s") + " msg/s"
            if t["name"].endswith("msg/s")
            else f"{t['target']:g}x"
        )
        lines.append(
            f"  {t['name']:<{tw}}  {value:>13}  target {t['comparison']} {goal:<12} {verdict:<8}"
            f"  ({t['source']}: {t['detail']})"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """A PNG with one panel per workload family (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in report["results"]]
    colors = {
        SHMCHAN: "#1f77b4",
        MPQ: "#ff7f0e",
        FFIFO: "#2ca02c",
        NAIVE: "#d62728",
        COPY: "#7f7f7f",
        SEMAPHORE: "#7f7f7f",
    }

    def rows(pred: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        return [r for r in results if pred(r)]

    def bars(
        ax: Any, sel: list[dict[str, Any]], title: str, ylabel: str, log: bool = False
    ) -> None:
        if not sel:
            ax.set_visible(False)
            return
        xs = range(len(sel))
        med = [r["median"] for r in sel]
        err = [[r["median"] - r["min"] for r in sel], [r["max"] - r["median"] for r in sel]]
        ax.bar(xs, med, yerr=err, capsize=3, color=[colors.get(r["system"], "#999") for r in sel])
        ax.set_xticks(list(xs), [_short(r) for r in sel], rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")

    fig, axes = plt.subplots(2, 3, figsize=(15, 9))
    ax = axes[0][0]
    sel = rows(lambda r: r["workload"] in ("unbatched_p1", "batched"))
    bars(ax, sel, "64 B payloads, 1 producer (msg/s)", "messages / s", log=True)

    ax = axes[0][1]
    curve: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for r in rows(lambda r: r["workload"].startswith("unbatched_p")):
        curve.setdefault(r["system"], []).append((int(r["workload"][len("unbatched_p") :]), r))
    for system, pts in curve.items():
        pts.sort()
        ax.errorbar(
            [p for p, _ in pts],
            [r["median"] for _, r in pts],
            yerr=[
                [r["median"] - r["min"] for _, r in pts],
                [r["max"] - r["median"] for _, r in pts],
            ],
            marker="o",
            capsize=3,
            label=system,
            color=colors.get(system),
        )
    if curve:
        ax.set_xticks(sorted({p for pts in curve.values() for p, _ in pts}))
        ax.legend(fontsize=8)
        ax.set_yscale("log")
    ax.set_title("64 B unbatched: aggregate rate vs producers", fontsize=10)
    ax.set_xlabel("producer processes")
    ax.set_ylabel("messages / s")

    bars(axes[0][2], rows(lambda r: r["workload"] == "1mib"), "1 MiB payloads (MiB/s)", "MiB / s")
    bars(
        axes[1][0],
        rows(lambda r: r["workload"] in ("dispatch_free", "dispatch_parked")),
        "free-key dispatch cost, no backlog vs 100k parked",
        "µs / message",
        log=True,
    )
    bars(
        axes[1][1],
        rows(lambda r: r["workload"] in ("latency_median", "latency_p99")),
        "idle consumer wake-up latency",
        "µs",
    )
    ax = axes[1][2]
    ax.axis("off")
    text = ["Targets (this run)"]
    for t in report["targets"]:
        if t["measured"] is None:
            text.append(f"{t['name']}: not measured")
            continue
        shown = (
            f"{t['measured'] / 1e6:.2f} M/s"
            if t["name"].endswith("msg/s")
            else f"{t['measured']:.2f}x"
        )
        goal = f"{t['target'] / 1e6:g} M/s" if t["name"].endswith("msg/s") else f"{t['target']:g}x"
        text.append(
            f"{t['name']}: {shown} ({t['comparison']} {goal}) {'met' if t['met'] else 'NOT met'}"
        )
    m = report["machine"]
    text += ["", f"{m['cpu_model']}, {m['usable_cpus']} CPUs, Python {m['python']}"]
    ax.text(0, 1, "\n".join(text), va="top", fontsize=8, family="monospace", wrap=True)
    fig.suptitle(
        f"shmchan bench ({'quick' if report['quick'] else 'full'} run, {report['started']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _short(r: dict[str, Any]) -> str:
    w = r["workload"]
    suffix = {
        "batched": " batched",
        "unbatched_p1": "",
        "dispatch_free": " none",
        "dispatch_parked": " parked",
        "latency_median": " p50",
        "latency_p99": " p99",
    }.get(w, "")
    return str(r["system"]) + suffix


# ---------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m shmchan bench",
        description=(
            "Measure shmchan against multiprocessing.Queue, faster-fifo and a naive keyed "
            "dispatcher, side by side in one run, and check the performance targets."
        ),
        epilog=(
            "Exit status: 0 the run completed (targets met or not), 1 the run failed, 2 bad usage."
        ),
    )
    p.add_argument(
        "--quick", action="store_true", help="a short run (smaller sizes, 3 repetitions)"
    )
    p.add_argument(
        "--json", action="store_true", help="print the report as JSON instead of a table"
    )
    p.add_argument("--plot", metavar="FILE.png", help="also write a chart (needs matplotlib)")
    p.add_argument(
        "--only",
        metavar="WORKLOAD",
        action="append",
        choices=WORKLOADS,
        help=f"run only this workload (repeatable): {', '.join(WORKLOADS)}",
    )
    p.add_argument(
        "--reps", type=int, metavar="N", help="repetitions per figure (default 5, quick 3)"
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress display (default: on when stderr is a terminal)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m shmchan bench`."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else 2
    if args.reps is not None and args.reps < 1:
        print("bench: --reps must be >= 1", file=sys.stderr)
        return 2
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("bench: --plot needs matplotlib (pip install 'shmchan[bench]')", file=sys.stderr)
        return 2
    workloads = [w for w in WORKLOADS if not args.only or w in args.only]
    show = not args.no_progress and sys.stderr.isatty()
    try:
        report = run(quick=args.quick, workloads=workloads, reps=args.reps, progress=show)
    except BenchError as e:
        print(f"bench: failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    if args.plot:
        plot(report, args.plot)
        if not args.json:
            print(f"\nplot written to {args.plot}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
