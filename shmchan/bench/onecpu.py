"""One CPU: a producer and its consumer that share a single CPU, as in a container limited
to one CPU or on a machine whose other CPUs are busy.

The bench process (the consumer) pins itself to one CPU of its affinity before it starts
the producers, which inherit it, and restores its affinity afterwards. Two cases, every
system alike:

* paced: the producer works PACE seconds (a busy wait) after each send, so the consumer
  keeps up and keeps finding the queue empty. Whatever CPU a consumer spends waiting
  (spinning) is taken from the producer: the rate shows it against the pace's own limit.
* unpaced: the unbatched case on one CPU: the two take turns, and the rate is what both
  sides' work per message (and their cache misses) allows together.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from shmchan.bench.common import FFIFO, MPQ, PAYLOAD, SHMCHAN, ZEROQ, ZMQ, Sizes
from shmchan.bench.harness import Run, throughput
from shmchan.bench.registry import register

PACE = 2e-6  # seconds of producer work after each send in the paced case
SYSTEMS = (SHMCHAN, MPQ, FFIFO, ZEROQ, ZMQ)
CASES = (  # (workload, what a reader sees, pace, share of the unbatched message count)
    ("onecpu_paced", f"one CPU: 64 B, 1 producer working {PACE * 1e6:g} us a message", PACE, 4),
    ("onecpu_unbatched", "one CPU: 64 B unbatched, 1 producer", 0.0, 1),
)


@contextlib.contextmanager
def _one_cpu() -> Iterator[int]:
    """This process (and what it starts meanwhile) on one CPU of its affinity."""
    before = os.sched_getaffinity(0)
    cpu = min(before)
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, before)


def _run_onecpu(run: Run) -> None:
    systems = [s for s in SYSTEMS if s in run.systems]
    with _one_cpu() as cpu:
        for workload, label, pace, share in CASES:
            throughput(
                run,
                workload=workload,
                label=label,
                mode="msg",
                systems=systems,
                nprod=1,
                per_producer=run.sizes.messages // share,
                batch=1,
                size=PAYLOAD,
                unit="msg/s",
                notes={SHMCHAN: f"send / recv / payload / release; CPU {cpu} only"},
                gap=pace,
            )


def _steps(sizes: Sizes, nsys: int) -> int:
    return len(CASES) * (1 + (sizes.reps + 1) * min(nsys, len(SYSTEMS)))


register("onecpu", _run_onecpu, steps=_steps, order=47, default=False)
