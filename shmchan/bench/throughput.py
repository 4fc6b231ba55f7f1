"""Throughput workloads: 64 B unbatched (1, 2, 4 producers), 64 B batched, 1 MiB."""

from __future__ import annotations

import contextlib
import mmap
import time

import posix_ipc

from shmchan.bench.common import (
    CAPACITY,
    FFIFO,
    FILL,
    MIB,
    MPQ,
    NAIVE,
    PAYLOAD,
    SHMCHAN,
    ZEROQ,
    ZMQ,
    Sizes,
    no_gc,
    unique,
)
from shmchan.bench.harness import Run, throughput
from shmchan.bench.registry import register


def _run_unbatched(run: Run) -> None:
    systems = [s for s in (SHMCHAN, MPQ, FFIFO, ZEROQ, ZMQ, NAIVE) if s in run.systems]
    for nprod in run.sizes.producers:
        per = run.sizes.messages // nprod
        throughput(
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
                ZMQ: "PUSH / PULL over ipc://",
            },
        )


def _run_batched(run: Run) -> None:
    systems = [s for s in (SHMCHAN, MPQ, FFIFO, ZEROQ, ZMQ, NAIVE) if s in run.systems]
    b = run.sizes.batch
    throughput(
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
            ZEROQ: "no batch call: put / get per message",
            ZMQ: f"send_multipart / recv_multipart, {b} frames",
            NAIVE: f"lists of {b} over mp.Queue",
        },
    )


class CopyCeiling:
    """A shared-memory buffer as large as the channel's ring, filled `chunk` bytes at a
    time (one C memcpy each: a slice assignment into the mapping)."""

    def __init__(self, size: int, chunk: int = MIB) -> None:
        self.name = "/" + unique("copy")
        shm = posix_ipc.SharedMemory(self.name, posix_ipc.O_CREX, mode=0o600, size=size)
        try:
            self.map = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        self.view = memoryview(self.map)
        self.src = bytes([FILL]) * chunk
        self.size = size
        self.chunk = chunk

    def __call__(self, n: int) -> float:
        """Copy n chunks; return chunks per second (MiB/s with the default chunk)."""
        view, src, size, chunk = self.view, self.src, self.size, self.chunk
        off = 0
        with no_gc():
            t0 = time.perf_counter()
            for _ in range(n):
                if off + chunk > size:
                    off = 0
                view[off : off + chunk] = src
                off += chunk
            elapsed = time.perf_counter() - t0
        return n / elapsed

    def close(self) -> None:
        self.view.release()
        self.map.close()
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.name)


def _run_mib(run: Run) -> None:
    systems = [s for s in (SHMCHAN, MPQ, FFIFO, ZEROQ, ZMQ) if s in run.systems]
    ceiling = CopyCeiling(CAPACITY)
    try:
        throughput(
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


def _steps_unbatched(sizes: Sizes, nsys: int) -> int:
    return len(sizes.producers) * (1 + (sizes.reps + 1) * nsys)


def _steps_batched(sizes: Sizes, nsys: int) -> int:
    return 1 + (sizes.reps + 1) * nsys


def _steps_mib(sizes: Sizes, nsys: int) -> int:
    return 1 + (sizes.reps + 1) * nsys  # every system but the naive one, and the copy


register("unbatched", _run_unbatched, steps=_steps_unbatched, order=10)
register("batched", _run_batched, steps=_steps_batched, order=20)
register("1mib", _run_mib, steps=_steps_mib, order=30)
