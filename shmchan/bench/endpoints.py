"""A system's receiving end (this process), and shmchan's own."""

from __future__ import annotations

import time
from typing import Any

import shmchan
from shmchan.bench.check import BatchCheck
from shmchan.bench.common import (
    CAPACITY,
    FILL,
    HDR,
    LAT,
    SHMCHAN,
    TIMEOUT,
    BenchError,
    bad_payload,
    unique,
)


class Endpoint:
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


class ShmchanEnd(Endpoint):
    system = SHMCHAN

    def __init__(self, capacity: int = CAPACITY, max_messages: int | None = None) -> None:
        self.name = unique("ch")
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
        unpack = HDR.unpack_from
        mid = size // 2
        got, total = 0, n * nprod
        # The peers hand out bytes objects: the like-for-like call is h.payload (a copy).
        # The zero-copy view h.data is what 1 MiB payloads are read with.
        zero_copy = mode == "mib"
        if mode == "batchapi":  # recv_batch: one object per batch, payloads joined
            recv_batch = self.rx.recv_batch
            check = BatchCheck(self.system, n, nprod, size)
            while got < total:
                b = recv_batch(batch, TIMEOUT)
                check.add_joined(b.joined())
                b.release()
                got += len(b)
            return check.finish()
        if mode == "batch":
            recv_many, release_many = self.rx.recv_many, self.rx.release_many
            check = BatchCheck(self.system, n, nprod, size)
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
            if seen[p][i] or d[-1] != i & 0xFF or d[mid] != FILL or len(d) != size:
                raise bad_payload(self.system, d, size)
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
        recv, clock, unpack = self.rx.recv, time.perf_counter_ns, LAT.unpack_from
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

    def sender_posts(self) -> int:
        """How often this receiver woke a sender waiting for space (all runs so far)."""
        seg = self.rx._seg
        return 0 if seg is None else int(seg.tx_posts)

    def close(self) -> None:
        try:
            self.rx.close()
            self.ch.close()
        finally:
            shmchan.unlink(self.name)
