"""The batch API (Sender.send_batch, Receiver.recv_batch): 64 B messages in prebuilt
batches -- one buffer, its lengths and the keys per send -- received as one Batch object,
read with joined() and released whole. The same payload check as every batched workload.

Beside it: zeroq and pyzmq moving the same batches as one joined buffer per item (one
slot of batch x 64 B, one frame; no keys), and the floor of any transport, one process
copying the same bytes into a shared-memory buffer one batch at a time (memcpy)."""

from __future__ import annotations

from shmchan.bench.common import CAPACITY, COPY, PAYLOAD, SHMCHAN, ZEROQ, ZMQ, Sizes
from shmchan.bench.harness import Run, throughput
from shmchan.bench.registry import register
from shmchan.bench.report import Result, Target, find_result
from shmchan.bench.throughput import CopyCeiling


def _run_batchapi(run: Run) -> None:
    b = run.sizes.batch
    copy = CopyCeiling(CAPACITY, chunk=b * PAYLOAD)
    try:
        throughput(
            run,
            workload="batch_api",
            label=f"64 B batch API ({b}), 1 producer",
            mode="batchapi",
            systems=[s for s in (SHMCHAN, ZEROQ, ZMQ) if s in run.systems],
            nprod=1,
            per_producer=run.sizes.batched_messages // b * b,
            batch=b,
            size=PAYLOAD,
            unit="msg/s",
            notes={
                SHMCHAN: "send_batch(buffer, lengths, keys) / recv_batch / joined / release",
                ZEROQ: f"one {b * PAYLOAD // 1024} KiB slot of joined payloads per put, no keys",
                ZMQ: "one frame of joined payloads per send, no keys",
            },
            ceiling=lambda n: copy(n // b) * b,
        )
    finally:
        copy.close()


def _steps(sizes: Sizes, nsys: int) -> int:
    return 1 + (sizes.reps + 1) * 4


def _targets(results: list[Result]) -> list[Target]:
    def med(workload: str) -> float | None:
        r = find_result(results, workload, SHMCHAN)
        return None if r is None else r.median

    api, many, one = med("batch_api"), med("batched"), med("unbatched_p1")
    floor = find_result(results, "batch_api", COPY)
    copy = None if floor is None else floor.median
    return [
        Target(
            "64 B batch API: shmchan msg/s",
            api,
            15e6,
            ">=",
            "prebuilt send_batch batches, recv_batch, cross-process"
            + ("" if copy is None else f"; a memcpy of the same bytes: {copy / 1e6:.0f} M msg/s"),
        ),
        Target(
            "64 B batch API / unbatched",
            None if api is None or one is None else api / one,
            2.0,
            ">=",
            "the batch API vs send/recv/release of the same messages, same run",
        ),
        Target(
            "64 B send_many/recv_many: msg/s",
            many,
            3e6,
            ">=",
            "the Handle-per-message batch calls",
        ),
    ]


register("batchapi", _run_batchapi, steps=_steps, order=25, targets=_targets)
