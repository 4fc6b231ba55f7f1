"""The fastest plain queues a user would pick instead: zeroq and pyzmq (both optional).

* zeroq: a lock-free shared-memory MPMC queue of fixed-size slots, no keys. Its `put`
  takes exactly one slot's bytes, so each workload sizes the slots to its messages: 64 B
  (unbatched, and batched message by message: it has no batch call), 1 MiB, or one batch
  of payloads joined into one buffer (beside the batch API). The ring holds as many bytes
  as shmchan's channel (rounded down to a power of two slots). A blocked `get` polls with
  short sleeps: its wake-up is what the latency rows show.
* pyzmq: ZeroMQ PUSH (one socket per producer process) to PULL (the consumer) over
  `ipc://` in a fresh temporary directory. Batches go as one multipart message (each
  payload one frame: `send_multipart` / `recv_multipart`), joined buffers as one frame.
  The high-water marks allow as many bytes in flight as shmchan's channel holds.

Both hand the consumer bytes objects, as the other peers do. Their timeouts are mapped
to queue.Empty, which the harness reports as "nothing arrived".
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from shmchan.bench.check import BatchCheck
from shmchan.bench.common import (
    CAPACITY,
    FILL,
    HDR,
    LAT,
    MIB,
    PAYLOAD,
    TIMEOUT,
    ZEROQ,
    ZMQ,
    BenchError,
    bad_payload,
    unique,
)
from shmchan.bench.endpoints import Endpoint


def slot_size(mode: str, batch: int) -> int:
    """The bytes of one queue item in a workload mode."""
    if mode == "mib":
        return MIB
    if mode == "batchapi":
        return batch * PAYLOAD
    return PAYLOAD


class _PlainQueueEnd(Endpoint):
    """What zeroq and pyzmq share: a blocking getter of one item (bytes), a batch getter,
    and the exception their timeouts raise."""

    timeout_error: type[BaseException] = queue.Empty

    def getter(self) -> Callable[[], bytes]:
        """A C-level callable taking one item, waiting up to TIMEOUT."""
        raise NotImplementedError

    def get_batch(self, batch: int) -> list[bytes]:
        raise NotImplementedError

    def consume(self, mode: str, n: int, nprod: int, batch: int, size: int) -> int:
        try:
            return self._consume(mode, n, nprod, batch, size)
        except self.timeout_error:
            raise queue.Empty from None

    def _consume(self, mode: str, n: int, nprod: int, batch: int, size: int) -> int:
        got, total = 0, n * nprod
        get1 = self.getter()
        if mode in ("batch", "batchapi"):
            check = BatchCheck(self.system, n, nprod, size)
            if mode == "batchapi":  # one buffer of joined payloads per item
                while got < total:
                    blob = get1()
                    check.add_joined(blob)
                    got += len(blob) // size
            else:
                get_batch = self.get_batch
                while got < total:
                    ms = get_batch(min(batch, total - got))
                    check.add(ms)
                    got += len(ms)
            return check.finish()
        seen = [bytearray(n) for _ in range(nprod)]
        high = [-1] * nprod
        late = 0
        unpack = HDR.unpack_from
        mid = size // 2
        while got < total:  # the same inline check as QueueEnd's
            d = get1()
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
        get1, clock, unpack = self.getter(), time.perf_counter_ns, LAT.unpack_from
        try:
            for k in range(n):
                d = get1()
                t1 = clock()
                t0, j = unpack(d)
                ack.release()
                if j != k:
                    raise BenchError(f"{self.system}: ping {j} arrived, expected {k}")
                out.append((t1 - t0) / 1e3)
        except self.timeout_error:
            raise queue.Empty from None
        return out


class ZeroqEnd(_PlainQueueEnd):
    """A zeroq queue created here; producers attach to it by name."""

    system = ZEROQ

    def __init__(self, mode: str, batch: int, capacity: int = CAPACITY) -> None:
        import zeroq

        self.item = slot_size(mode, batch)
        slots = 1 << max(1, (capacity // self.item).bit_length() - 1)
        self.name = unique("zq")
        self.q = zeroq.Queue(self.name, element_size=self.item, capacity=slots, create=True)
        self.timeout_error = zeroq.Empty

    def getter(self) -> Callable[[], bytes]:
        return functools.partial(self.q.get, TIMEOUT)

    def get_batch(self, batch: int) -> list[bytes]:  # no batch call: one get per message
        get = self.q.get
        return [get(TIMEOUT) for _ in range(batch)]

    def transport(self) -> Any:
        return self.name

    def close(self) -> None:
        self.q.close()
        with contextlib.suppress(OSError):  # close() unlinks it; this is for a failed close
            os.unlink(os.path.join("/dev/shm", self.name))


class ZmqEnd(_PlainQueueEnd):
    """A PULL socket bound to ipc://<temporary directory>/sock; producers PUSH to it."""

    system = ZMQ

    def __init__(self, mode: str, batch: int, capacity: int = CAPACITY) -> None:
        import zmq

        self.dir = tempfile.mkdtemp(prefix=unique("zmq") + "-")
        self.address = f"ipc://{self.dir}/sock"
        self.ctx = zmq.Context()
        try:
            self.sock = self.ctx.socket(zmq.PULL)
            self.sock.setsockopt(zmq.RCVHWM, _hwm(mode, batch, capacity))
            self.sock.setsockopt(zmq.RCVTIMEO, int(TIMEOUT * 1000))
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.bind(self.address)
        except BaseException:
            self.ctx.destroy(linger=0)
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.timeout_error = zmq.Again

    def getter(self) -> Callable[[], bytes]:
        return self.sock.recv  # bytes: copy=True

    def get_batch(self, batch: int) -> list[bytes]:  # one multipart message per batch
        return self.sock.recv_multipart()

    def transport(self) -> Any:
        return self.address

    def close(self) -> None:
        try:
            self.sock.close(linger=0)
            self.ctx.term()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def _hwm(mode: str, batch: int, capacity: int) -> int:
    """Messages in flight allowed per socket: as many bytes as the channel's ring."""
    per_message = batch * PAYLOAD if mode == "batch" else slot_size(mode, batch)
    return max(1, capacity // per_message)


def producer_put(system: str, mode: str, batch: int, transport: Any) -> Callable[[Any, int], None]:
    """A producer's `put(item, index)`, shaped like every other system's: one message
    (bytes), or with mode "batch" a list of them."""
    if system == ZEROQ:
        import zeroq

        qput = zeroq.Queue(transport, create=False).put
        if mode == "batch":

            def put_each(items: Any, i: int) -> None:  # no batch call: one put per message
                for x in items:
                    qput(x, TIMEOUT)

            return put_each

        def put_zeroq(obj: Any, i: int) -> None:
            qput(obj, TIMEOUT)

        return put_zeroq
    if system == ZMQ:
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, _hwm(mode, batch, CAPACITY))
        sock.setsockopt(zmq.SNDTIMEO, int(TIMEOUT * 1000))
        sock.setsockopt(zmq.LINGER, 1000)  # everything sent is received before "done"
        sock.connect(transport)
        send = sock.send_multipart if mode == "batch" else sock.send

        def put_zmq(obj: Any, i: int) -> None:
            send(obj)

        return put_zmq
    raise BenchError(f"unknown system {system!r}")
