"""A busy machine: the throughput cases again, each repetition once quiet and once with one
more process spinning on a CPU, and the share of its throughput each system keeps.

The quiet and the busy run of a repetition follow each other (in alternating order), so
the retained share -- busy over quiet, per repetition -- compares like with like even when
the machine drifts. The target: the spinner costs shmchan no larger share than it costs the
best peer of the case (the fastest peer of the quiet rows). The naive dispatcher is left
out: it is mp.Queue plus bookkeeping, and the slowest row by far.
"""

from __future__ import annotations

from shmchan.bench.common import (
    CAPACITY,
    FFIFO,
    FULL,
    MPQ,
    PAYLOAD,
    SHMCHAN,
    ZEROQ,
    ZMQ,
    Sizes,
)
from shmchan.bench.harness import Run, Spinner, throughput
from shmchan.bench.registry import register
from shmchan.bench.report import Result, Target, best_peer, find_result

# (workload suffix, what a reader sees, mode, producers, systems that can run it)
CASES = (
    ("unbatched_p1", "64 B unbatched, 1 producer", "msg", 1, (SHMCHAN, MPQ, FFIFO, ZEROQ, ZMQ)),
    ("unbatched_p2", "64 B unbatched, 2 producers", "msg", 2, (SHMCHAN, MPQ, FFIFO, ZEROQ, ZMQ)),
    ("batched", "64 B batched", "batch", 1, (SHMCHAN, MPQ, FFIFO, ZEROQ, ZMQ)),
    ("batch_api", "64 B batch API", "batchapi", 1, (SHMCHAN, ZEROQ, ZMQ)),
)
PREFIX = "contention_"
QUICK_CASES = ("unbatched_p1",)  # what a --quick run measures busy


def _run_busy(run: Run) -> None:
    sz = run.sizes
    spinner = Spinner(run.ctx)
    try:
        for case, label, mode, nprod, can in _cases(run.quick):
            batched = mode != "msg"
            per = (sz.batched_messages // sz.batch * sz.batch) if batched else sz.messages // nprod
            throughput(
                run,
                workload=PREFIX + case,
                label=f"busy machine: {label}",
                mode=mode,
                systems=[s for s in can if s in run.systems],
                nprod=nprod,
                per_producer=per,
                batch=sz.batch if batched else 1,
                size=PAYLOAD,
                unit="msg/s",
                capacity=CAPACITY,
                spinner=spinner,
            )
    finally:
        spinner.close()


def _cases(quick: bool) -> list[tuple[str, str, str, int, tuple[str, ...]]]:
    return [c for c in CASES if not quick or c[0] in QUICK_CASES]


def _steps(sizes: Sizes, nsys: int) -> int:
    cases = _cases(sizes.messages < FULL.messages)  # a --quick run has fewer messages
    return sum(1 + (sizes.reps + 1) * min(nsys, len(can)) for *_, can in cases)


def _targets(results: list[Result]) -> list[Target]:
    out = []
    for case, label, *_ in CASES:
        shm = find_result(results, f"{PREFIX}{case}_retained", SHMCHAN)
        quiet_best = best_peer(results, PREFIX + case)
        peer = (
            None
            if quiet_best is None
            else find_result(results, f"{PREFIX}{case}_retained", quiet_best.system)
        )
        if peer is None:  # no peer ran this case here (an optional one is missing)
            continue
        measured = None if shm is None else shm.median / peer.median
        detail = "share of quiet throughput kept with one spinning process, vs the best peer's"
        if shm is not None:
            detail += f" (this run: shmchan {shm.median:.0f} %, {peer.system} {peer.median:.0f} %)"
        out.append(
            Target(f"busy machine, {label}: kept / best peer's", measured, 1.0, ">=", detail)
        )
    return out


register("busy", _run_busy, steps=_steps, order=45, targets=_targets)
