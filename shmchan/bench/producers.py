"""Producers: spawned processes that build their payloads, report ready, then send on cue."""

from __future__ import annotations

import array
import contextlib
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import posix_ipc

from shmchan.bench.common import (
    FFIFO,
    FILL,
    HDR,
    JOIN_TIMEOUT,
    KEY_SPACE,
    LAT,
    LAT_PAD,
    MIB,
    MPQ,
    NAIVE,
    PAYLOAD,
    READY_TIMEOUT,
    SEMAPHORE,
    SHMCHAN,
    TIMEOUT,
    ZEROQ,
    ZMQ,
    BenchError,
    no_gc,
    payload,
)
from shmchan.bench.fastpeers import producer_put


@dataclass(frozen=True)
class Job:
    system: str
    mode: str  # "msg", "batch", "mib", "latency", "batchapi", "burst"
    producer: int
    count: int  # most messages one repetition may ask for
    batch: int = 1
    gap: float = 0.0  # latency, burst: seconds of quiet; msg: seconds of work after each send
    ack: str = ""  # latency, burst: a semaphore the consumer posts once it has each ping


def _producer_main(conn: Connection, job: Job, transport: Any) -> None:
    """Spawned producer: build payloads, say ready, then send `n` messages per request."""
    try:
        send = _make_producer(job, transport)
        conn.send(("ready", os.getpid()))
        while True:
            n = conn.recv()
            if n is None:
                break
            with no_gc():
                send(n)
            conn.send(("done", None))
    except BaseException:  # report everything, KeyboardInterrupt included, then exit
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))


def _make_producer(job: Job, transport: Any) -> Callable[[int], None]:
    sysname, mode, p = job.system, job.mode, job.producer
    if sysname == SEMAPHORE:
        return _semaphore_pinger(job, transport)
    put: Callable[[Any, int], None]
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

    elif sysname in (ZEROQ, ZMQ):
        put = producer_put(sysname, mode, job.batch, transport)

    else:
        raise BenchError(f"unknown system {sysname!r}")

    if mode == "latency":
        gap = job.gap

        # Ping-pong, the floor's shape: after each ping the producer blocks until the
        # consumer has it (not timed), so both sides are idle when the next one goes.
        ack = posix_ipc.Semaphore(job.ack)

        def send_latency(n: int) -> None:
            sleep, clock, pack, wait = time.sleep, time.perf_counter_ns, LAT.pack, ack.acquire
            for k in range(n):
                sleep(gap)
                put(pack(clock(), k) + LAT_PAD, k)
                wait(TIMEOUT)

        return send_latency

    if mode == "mib":
        buf = bytearray([FILL]) * MIB

        def send_mib(n: int) -> None:
            pack_into = HDR.pack_into
            for i in range(n):
                pack_into(buf, 0, i, p)
                buf[-1] = i & 0xFF
                put(buf, i)

        return send_mib

    payloads = [payload(i, p) for i in range(job.count)]
    if sysname == NAIVE:
        items: list[Any] = [((i % KEY_SPACE,), payloads[i]) for i in range(job.count)]
    elif sysname == SHMCHAN and mode == "batch":
        items = [(payloads[i], i % KEY_SPACE) for i in range(job.count)]
    else:
        items = payloads

    if mode == "burst":
        # n messages as fast as the system takes them; then, once the consumer says it has
        # drained them all (ack), `gap` seconds of quiet and one stamped ping, sent like
        # the burst's messages; then wait (untimed) until the consumer has it. With no gap
        # the producer polls for the consumer's word instead of sleeping on it, so that the
        # ping leaves within microseconds of the consumer going back to recv (a sleeping
        # producer took 150-400 us to wake on a virtual machine).
        burst_ack, pause = posix_ipc.Semaphore(job.ack), job.gap

        def drained() -> None:
            if pause:
                burst_ack.acquire(TIMEOUT)
                time.sleep(pause)
                return
            deadline = time.monotonic() + TIMEOUT
            while True:
                try:
                    burst_ack.acquire(0)
                    return
                except posix_ipc.BusyError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0)  # lets other threads run (mp.Queue's feeder)

        def send_burst(n: int) -> None:
            for i in range(n):
                put(items[i], i)
            drained()
            put(LAT.pack(time.perf_counter_ns(), 0) + LAT_PAD, n)
            burst_ack.acquire(TIMEOUT)

        return send_burst

    if mode == "batchapi" and sysname != SHMCHAN:  # a plain queue: one joined buffer each
        b = job.batch
        joined = [b"".join(payloads[i : i + b]) for i in range(0, job.count, b)]

        def send_joined(n: int) -> None:
            for j in range(n // b):
                put(joined[j], j)

        return send_joined

    if mode == "batchapi":  # shmchan's send_batch: one buffer, its lengths, the keys
        b = job.batch
        tx = transport
        lens = array.array("Q", [PAYLOAD]) * b
        prebuilt = [
            (b"".join(payloads[i : i + b]), lens, [k % KEY_SPACE for k in range(i, i + b)])
            for i in range(0, job.count, b)
        ]

        def send_prebuilt(n: int) -> None:
            send_batch = tx.send_batch
            for j in range(n // b):
                data, lengths, keys = prebuilt[j]
                send_batch(data, lengths, keys, TIMEOUT)

        return send_prebuilt

    if mode == "batch":
        b = job.batch
        batches = [items[i : i + b] for i in range(0, job.count, b)]

        def send_batches(n: int) -> None:
            for j in range(n // b):
                put(batches[j], j)

        return send_batches

    if job.gap:  # paced: after each send, `gap` seconds of work (a busy wait, no sleep)
        gap = job.gap

        def send_paced(n: int) -> None:
            clock = time.perf_counter
            for i in range(n):
                put(items[i], i)
                until = clock() + gap
                while clock() < until:
                    pass

        return send_paced

    def send_each(n: int) -> None:
        for i in range(n):
            put(items[i], i)

    return send_each


def _semaphore_pinger(job: Job, transport: Any) -> Callable[[int], None]:
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


class Producers:
    """One system's producer processes: started together, told to go together."""

    def __init__(self, ctx: Any, system: str, jobs: Sequence[tuple[Job, Any]]) -> None:
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
