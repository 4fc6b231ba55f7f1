"""Durable channels: what the records' checksum costs.

A file-backed channel (`Channel.create(name, path=FILE)`) computes a CRC-32C of every
record when it is committed (csrc/crc32c.c); its receiver checks the records it recovers.
Here one process sends, receives and releases the same messages through an in-memory
channel and through a file-backed one (the file in a temporary directory, so the page
cache holds it: the difference is the checksum, not the disk), for 64 B and 1 MiB
payloads. Every message is checked on receipt (its index at both ends).
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
KINDS = ("in-memory", "durable")


def _counts(run: Run) -> tuple[int, int]:
    """Messages per repetition: 64 B, 1 MiB."""
    return (5_000, 50) if run.quick else (50_000, 500)


def _payloads(size: int, n: int) -> list[bytes]:
    body = bytes(range(256)) * (size // 256 + 1)
    return [struct.pack("<Q", i) + body[: size - 16] + struct.pack("<Q", i) for i in range(n)]


def _one_pass(kind: str, size: int, payloads: list[bytes], directory: str) -> float:
    """Send every payload and receive, check and release it; messages per second."""
    name = f"bench_durable_{uuid.uuid4().hex[:10]}"
    path = os.path.join(directory, name) if kind == "durable" else None
    capacity = max(4 << 20, 8 * (size + 4096))
    ch = shmchan.Channel.create(name, capacity=capacity, path=path)
    try:
        tx, rx = ch.sender(), ch.receiver()
        big = size >= MIB
        t0 = time.perf_counter()
        for i, p in enumerate(payloads):
            tx.send(p, keys=i & 1023)
            h = rx.recv(timeout=10)
            data = h.data if big else h.payload
            if (
                struct.unpack_from("<Q", data)[0] != i
                or struct.unpack_from("<Q", data, size - 8)[0] != i
            ):
                raise BenchError(f"durable bench: message {i} came back wrong ({kind})")
            del data
            h.release()
        elapsed = time.perf_counter() - t0
        rx.close()
    finally:
        ch.close()
        shmchan.unlink(name, path=path)
    return len(payloads) / elapsed


def _run_durable(run: Run) -> None:
    n64, nbig = _counts(run)
    samples: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="shmchan-bench-") as directory:
        work = (
            ("durable_64b", 64, _payloads(64, n64)),
            ("durable_1mib", MIB, _payloads(MIB, nbig)),
        )
        for _workload, size, payloads in work:  # warm-up, discarded
            for kind in KINDS:
                _one_pass(kind, size, payloads[: max(1, len(payloads) // 10)], directory)
        for _rep in range(run.sizes.reps):
            for workload, size, payloads in work:
                for kind in KINDS:  # interleaved, so drift hits both alike
                    rate = _one_pass(kind, size, payloads, directory)
                    samples.setdefault((workload, kind), []).append(
                        rate if size < MIB else rate * size / MIB
                    )
            run.progress.step("durable: one repetition")
    labels = {
        "durable_64b": "durable vs in-memory, 64 B",
        "durable_1mib": "durable vs in-memory, 1 MiB",
    }
    notes = {
        "in-memory": "/dev/shm; send -> recv -> release, one process",
        "durable": "path= file (page cache): + CRC-32C per record",
    }
    for (workload, kind), values in samples.items():
        run.results.append(
            Result(
                workload,
                labels[workload],
                f"shmchan {kind}",
                "msg/s" if workload == "durable_64b" else "MiB/s",
                True,
                values,
                note=notes[kind],
                checked=len(values) * (n64 if workload == "durable_64b" else nbig),
            )
        )


def _steps(sizes: Sizes, nsys: int) -> int:
    return sizes.reps


register("durable", _run_durable, steps=_steps, order=70, default=False)
