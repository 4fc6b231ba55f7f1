"""What every part of the benchmark shares: run sizes, system names, payloads, errors."""

from __future__ import annotations

import contextlib
import gc
import os
import struct
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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
    # pressure.py: a ring that fills, a channel of many slots, an idle receiver
    fill_messages: int = 400_000  # 64 B messages per repetition into a ring that fills
    fill_capacity: int = 8 << 20
    fill_producers: tuple[int, ...] = (1, 2, 4, 8)
    big_capacity: int = 1 << 30  # the large channel, against a fill_capacity one
    big_messages: int = 50_000  # fit in either ring: the receiver's cost is compared
    idle_seconds: float = 2.0  # one idle receiver's measuring period
    # coldstart.py: the first message after a burst
    burst_messages: int = 20_000  # 64 B messages in the burst the consumer drains first
    burst_pause: float = 0.005  # seconds between the drained burst and the ping
    # overflow.py: a burst into a small channel with overflow= while its consumer sleeps
    overflow_burst: int = 1 << 30  # bytes of the burst


FULL = Sizes(
    reps=5,
    messages=100_000,
    batch=256,
    batched_messages=256 * 1000,
    mib_messages=1000,
    parked=100_000,
    dispatch_messages=20_000,
    naive_dispatch_messages=200,
    latency_samples=1000,
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
    fill_messages=6_000,
    fill_capacity=128 << 10,
    fill_producers=(1, 8),
    big_capacity=128 << 20,
    big_messages=4_000,
    idle_seconds=0.3,
    burst_messages=2_000,
    overflow_burst=32 << 20,
)

SHMCHAN = "shmchan"
MPQ = "mp.Queue"
FFIFO = "faster-fifo"
ZEROQ = "zeroq"  # a lock-free shared-memory MPMC queue of fixed-size slots (optional)
ZMQ = "pyzmq"  # ZeroMQ PUSH/PULL over ipc:// (optional)
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

HDR = struct.Struct("<QI")  # message index, producer number: the first 12 bytes
LAT = struct.Struct("<qQ")  # send time (perf_counter_ns), ping number
FILL = 0xA5  # every other byte of a payload but the last
LAT_PAD = bytes([FILL]) * (PAYLOAD - LAT.size)


class BenchError(Exception):
    """The benchmark could not run to the end (a peer failed, a payload was wrong, ...)."""


def payload(i: int, producer: int, size: int = PAYLOAD) -> bytes:
    """Index and producer, then FILL, then the check byte i % 256."""
    return HDR.pack(i, producer) + bytes([FILL]) * (size - HDR.size - 1) + bytes([i & 0xFF])


def bad_payload(system: str, data: Any, size: int) -> BenchError:
    try:
        i, p = HDR.unpack_from(data)
        got = f"message {i} of producer {p}"
    except struct.error:
        got = "an unreadable message"
    return BenchError(
        f"{system}: payload check failed: {got}, length {len(data)} (expected {size}): "
        "corrupt, duplicated or unknown"
    )


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def unique(tag: str) -> str:
    return f"bench-{os.getpid()}-{tag}-{uuid.uuid4().hex[:8]}"


def warmup_count(n: int, unit: int = 1) -> int:
    return max(unit, (n // 10) // unit * unit)
