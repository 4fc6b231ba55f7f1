"""Worker pools: KeyedExecutor against ProcessPoolExecutor and loky.

Every system runs the same trivial function over the same items with as many workers
as there are usable CPUs; the executors are started (and warmed up) before any clock
runs, so process start-up is never timed. KeyedExecutor's tasks carry one of 64 keys
(item % 64): it does its key locking while being timed, the peers have no such thing.
Every result is checked against the expected list.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import time
from concurrent.futures import Executor, ProcessPoolExecutor
from typing import Any

import shmchan
from shmchan.bench.common import SHMCHAN, BenchError, Sizes
from shmchan.bench.harness import Run
from shmchan.bench.registry import register
from shmchan.bench.report import Result, Target, find_result

PPE = "ProcessPoolExecutor"
LOKY = "loky"
KEYS = 64
CHUNKSIZES = (16, 64, 256, 1024)  # candidates for "best chunksize", tried in the warm-up
MIB = 1 << 20


def trivial(x: int) -> int:
    return x


def size_of(blob: bytes) -> int:
    return len(blob)


def _key(x: int) -> int:
    return x % KEYS


def _counts(run: Run) -> tuple[int, int, int]:
    """Tasks per repetition: chunksize-1 workloads, best-chunksize, 1 MiB."""
    return (3_000, 20_000, 40) if run.quick else (20_000, 200_000, 300)


def _systems() -> list[str]:
    out = [SHMCHAN, PPE]
    with contextlib.suppress(ImportError):
        importlib.import_module("loky")
        out.append(LOKY)
    return out


def _start(system: str, workers: int) -> Executor:
    if system == SHMCHAN:
        return shmchan.KeyedExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    if system == PPE:
        return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    loky = importlib.import_module("loky")  # an optional peer, without type information
    ex: Executor = loky.get_reusable_executor(max_workers=workers, reuse=False)
    return ex


def _map(system: str, ex: Executor, n: int, chunksize: int) -> list[Any]:
    if isinstance(ex, shmchan.KeyedExecutor):
        return list(ex.map(trivial, range(n), keys=_key, chunksize=chunksize))
    return list(ex.map(trivial, range(n), chunksize=chunksize))


def _submit(system: str, ex: Executor, n: int) -> list[Any]:
    if isinstance(ex, shmchan.KeyedExecutor):
        futures = [ex.submit(trivial, i, keys=(i % KEYS,)) for i in range(n)]
    else:
        futures = [ex.submit(trivial, i) for i in range(n)]
    return [f.result() for f in futures]


def _big(system: str, ex: Executor, n: int, blob: bytes) -> list[Any]:
    if isinstance(ex, shmchan.KeyedExecutor):
        futures = [ex.submit(size_of, blob, keys=(i % KEYS,)) for i in range(n)]
    else:
        futures = [ex.submit(size_of, blob) for i in range(n)]
    return [f.result() for f in futures]


def _timed(workload: str, system: str, ex: Executor, n: int, arg: Any) -> float:
    """Run one workload once; tasks (or MiB) per second. Checks every result."""
    t0 = time.perf_counter()
    if workload in ("pool_map", "pool_map_best"):
        got = _map(system, ex, n, arg)
    elif workload == "pool_submit":
        got = _submit(system, ex, n)
    else:
        got = _big(system, ex, n, arg)
    elapsed = time.perf_counter() - t0
    want = [MIB] * n if workload == "pool_1mib" else list(range(n))
    if got != want:
        raise BenchError(f"{workload} on {system}: wrong results")
    return n / elapsed  # pool_1mib: one MiB per task, so tasks/s is MiB/s


def _run_pool(run: Run) -> None:
    sz = run.sizes
    systems = _systems()
    workers = len(os.sched_getaffinity(0))
    n1, nbest, nbig = _counts(run)
    blob = bytes(MIB)
    samples: dict[tuple[str, str], list[float]] = {}
    best: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        executors: dict[str, Executor] = {}
        for s in systems:
            ex = _start(s, workers)
            stack.callback(ex.shutdown, True)
            executors[s] = ex
            _map(s, ex, 2_000, 1)  # every worker up and warm
        run.progress.step("pool: executors started")
        # Warm-up: each system's best chunksize, one try each on a quarter of the run.
        for s in systems:
            rates = {
                cs: _timed("pool_map_best", s, executors[s], nbest // 4, cs) for cs in CHUNKSIZES
            }
            best[s] = max(rates, key=lambda cs: rates[cs])
        run.progress.step("pool: best chunksizes found")
        for _rep in range(sz.reps):
            for s in systems:
                ex = executors[s]
                for workload, n, arg in (
                    ("pool_map", n1, 1),
                    ("pool_submit", n1, None),
                    ("pool_map_best", nbest, best[s]),
                    ("pool_1mib", nbig, blob),
                ):
                    samples.setdefault((workload, s), []).append(_timed(workload, s, ex, n, arg))
                run.progress.step(f"pool: {s}")
    labels = {
        "pool_map": f"pool: map, trivial fn, chunksize 1 ({KEYS} keys)",
        "pool_submit": f"pool: submit, trivial fn ({KEYS} keys)",
        "pool_map_best": "pool: map, trivial fn, best chunksize",
        "pool_1mib": "pool: submit, 1 MiB argument",
    }
    notes = {
        SHMCHAN: f"KeyedExecutor, tasks keyed item % {KEYS}",
        PPE: "concurrent.futures, no keys",
        LOKY: "loky reusable executor, no keys",
    }
    counts = {"pool_map": n1, "pool_submit": n1, "pool_map_best": nbest, "pool_1mib": nbig}
    for (workload, s), values in samples.items():
        note = notes[s]
        if workload == "pool_map_best":
            note = f"chunksize {best[s]}; " + note
        run.results.append(
            Result(
                workload,
                labels[workload],
                s,
                "MiB/s" if workload == "pool_1mib" else "task/s",
                True,
                values,
                note=note,
                checked=len(values) * counts[workload],
            )
        )


def _targets(results: list[Result]) -> list[Target]:
    def ratio(workload: str) -> float | None:
        a = find_result(results, workload, SHMCHAN)
        b = find_result(results, workload, PPE)
        return None if a is None or b is None else a.median / b.median

    return [
        Target(
            "pool map, chunksize 1: KeyedExecutor / ProcessPoolExecutor",
            ratio("pool_map"),
            10.0,
            ">=",
            "trivial fn, both at chunksize 1",
        ),
        Target(
            "pool map, best chunksize: KeyedExecutor / ProcessPoolExecutor",
            ratio("pool_map_best"),
            1.0,
            ">=",
            "trivial fn, each at its best chunksize",
        ),
    ]


def _steps(sizes: Sizes, nsys: int) -> int:
    return 2 + sizes.reps * len(_systems())


register("pool", _run_pool, steps=_steps, order=60, default=False, targets=_targets)
