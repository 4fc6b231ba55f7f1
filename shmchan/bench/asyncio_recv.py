"""asyncio receive throughput beside the synchronous one: one producer process sends 64 B
keyed messages; the consumer takes them with recv_many + release_many, or awaits them
with recv_many_async + release_many on an event loop. Only when asked (`--only asyncio`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import shmchan
from shmchan.bench.common import unique
from shmchan.bench.harness import Run
from shmchan.bench.registry import register
from shmchan.bench.report import Result

_BATCH = 64


def _produce(name: str, n: int) -> None:
    tx = shmchan.Sender.open(name)
    payload = b"x" * 64
    for i in range(n):
        tx.send(payload, keys=(i % 64,), timeout=60)


def _consume_sync(rx: shmchan.Receiver, n: int) -> None:
    got = 0
    while got < n:
        hs = rx.recv_many(_BATCH, timeout=60)
        rx.release_many(hs)
        got += len(hs)


def _consume_async(rx: shmchan.Receiver, n: int) -> None:
    async def main() -> None:
        got = 0
        while got < n:
            hs = await rx.recv_many_async(_BATCH, timeout=60)
            rx.release_many(hs)
            got += len(hs)

    asyncio.run(main())


def _one(run: Run, consume: Any, n: int) -> float:
    name = unique("asyncio")
    ch = shmchan.Channel.create(name, capacity=1 << 22)
    try:
        rx = ch.receiver()
        p = run.ctx.Process(target=_produce, args=(name, n))
        p.start()
        try:
            t0 = time.perf_counter()
            consume(rx, n)
            took = time.perf_counter() - t0
        finally:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(10)
        rx.close()
        return n / took
    finally:
        ch.close()
        shmchan.unlink(name)


def _run_asyncio(run: Run) -> None:
    n = 20_000 if run.quick else 300_000
    for workload, label, consume, note in (
        ("recv_sync", "64 B recv_many, 1 producer", _consume_sync, "recv_many + release_many"),
        (
            "recv_async",
            "64 B recv_many_async, 1 producer",
            _consume_async,
            "await recv_many_async + release_many (asyncio)",
        ),
    ):
        samples = [_one(run, consume, n) for _ in range(run.sizes.reps)]
        run.results.append(
            Result(workload, label, "shmchan", "msg/s", True, samples, note=note, checked=0)
        )
        run.progress.step(f"asyncio: {workload} done")


register("asyncio", _run_asyncio, steps=lambda sizes, nsys: 2, order=95, default=False)
