"""`--only spark`: process_keyed against Spark's usual recipe for per-key order.

Spark's usual way to process rows in per-key order is to `repartition` by the key,
`sortWithinPartitions` by the order column and run the function serially in
`mapPartitions`: a partition's rows run one at a time, however many of them could run
together. `process_keyed(workers_per_task=8)` runs them through a KeyedExecutor instead.
Both run, on the same cached data and session, an I/O-bound function (a 2 ms sleep) whose
result depends on the order: the row's position among the rows of its key, counted in a
shared file of counters. The two results must be identical (else the run fails).

Also measured: the key-graph components of 1 M rows (100 k quick) on Spark
(large-star / small-star, forced with driver_threshold=0) with their rounds, and the cost
of one giant component: the same rows plus bridge rows that join every key into one
component, so that everything runs in one Spark task.
Needs the `[spark]` extra and Java 17+; a run without them fails with a clear message.
"""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from shmchan.bench.common import SHMCHAN, BenchError
from shmchan.bench.harness import Run
from shmchan.bench.registry import register
from shmchan.bench.report import Result, Target, median_ratio

RECIPE = "Spark recipe"
SLEEP = 0.002  # seconds of waiting per row: an I/O-bound function
WORKERS = 8  # workers_per_task


@dataclass(frozen=True)
class _Sizes:
    rows: int  # rows of the order-dependent workload
    keys: int  # distinct keys among them
    graph_rows: int  # rows of the component computation
    reps: int


_QUICK = _Sizes(rows=2_000, keys=400, graph_rows=100_000, reps=1)
_FULL = _Sizes(rows=40_000, keys=8_000, graph_rows=1_000_000, reps=3)


class Position:
    """The function both sides run: wait 2 ms, then return how many rows of this row's key
    ran before it, so a result depends on the order.

    The counts live in one shared file of 8-byte counters mapped by every process, one
    counter per key ("k<j>" uses counter j), read and written without a lock: the fifo
    promise (rows sharing a key never run at once, and in order) is what keeps them
    right. A counter costs a memory access, so the function is the 2 ms wait the
    benchmark specifies, not file-system work; one file per key read and written per row cost
    ~0.3 ms of CPU per row here and made 16 workers on 2 CPUs CPU-bound.
    """

    def __init__(self, directory: str, keys: int) -> None:
        self.path = os.path.join(directory, "counts")
        if not os.path.exists(self.path):
            with open(self.path, "wb") as f:
                f.truncate(8 * keys)
        self._counts: mmap.mmap | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_counts": None}  # each process maps the file itself

    def __call__(self, row: Any) -> int:
        time.sleep(SLEEP)
        if self._counts is None:
            with open(self.path, "r+b") as f:
                self._counts = mmap.mmap(f.fileno(), 0)
        at = 8 * int(row.key[1:])
        (seen,) = _COUNT.unpack_from(self._counts, at)
        _COUNT.pack_into(self._counts, at, seen + 1)
        return int(seen)


_COUNT = struct.Struct("<q")


def _recipe(df: Any, fn: Position, partitions: int) -> dict[int, int]:
    """Spark's usual recipe: repartition by key, sort within partitions, run serially."""
    ordered = df.repartition(partitions, "key").sortWithinPartitions("id")
    return dict(ordered.rdd.mapPartitions(lambda rows: ((r.id, fn(r)) for r in rows)).collect())


def _keyed(df: Any, fn: Position) -> dict[int, int]:
    from shmchan.spark import process_keyed

    out = process_keyed(df, "key", fn, "id", result_type="int", workers_per_task=WORKERS)
    return {r.id: r.result for r in out.select("id", "result").collect()}


def _timed(directory: str, keys: int, call: Any) -> tuple[float, dict[int, int]]:
    shutil.rmtree(directory, ignore_errors=True)
    os.mkdir(directory)
    fn = Position(directory, keys)
    t0 = time.perf_counter()
    result = call(fn)
    return time.perf_counter() - t0, result


def _run_spark(run: Run) -> None:
    try:
        from pyspark.sql import functions as F

        from shmchan import spark as ss
    except ImportError as e:
        raise BenchError(f"spark: {e}") from None
    sizes = _QUICK if run.quick else _FULL
    reps = run.sizes.reps if run.sizes.reps < sizes.reps else sizes.reps
    scratch = tempfile.mkdtemp(prefix="shmchan-bench-spark-")
    spark = ss.session("shmchan-bench")
    try:
        partitions = int(spark.conf.get("spark.sql.shuffle.partitions") or "4")
        ids = spark.range(sizes.rows)
        key = F.concat(F.lit("k"), F.pmod(F.xxhash64("id", F.lit(1)), F.lit(sizes.keys)))
        df = ids.select("id", key.alias("key")).cache()
        df.count()
        here = os.path.join(scratch, "state")
        # A discarded warm-up of each: Spark's Python workers start, modules are imported.
        warm = df.limit(200)
        _timed(here, sizes.keys, lambda fn: _keyed(warm, fn))
        _timed(here, sizes.keys, lambda fn: _recipe(warm, fn, partitions))
        keyed: list[float] = []
        recipe: list[float] = []
        for _ in range(reps):  # interleaved, so drift hits both alike
            t_keyed, by_keyed = _timed(here, sizes.keys, lambda fn: _keyed(df, fn))
            t_recipe, by_recipe = _timed(here, sizes.keys, lambda fn: _recipe(df, fn, partitions))
            if by_keyed != by_recipe or len(by_keyed) != sizes.rows:
                raise BenchError("spark: process_keyed and the recipe gave different results")
            keyed.append(sizes.rows / t_keyed)
            recipe.append(sizes.rows / t_recipe)
        label = f"{sizes.rows:,} rows, 2 ms fn, {sizes.keys:,} keys"
        note = f"process_keyed, {WORKERS} workers per task, {partitions} partitions"
        run.results.append(
            Result(
                "spark_keyed",
                label,
                SHMCHAN,
                "rows/s",
                True,
                keyed,
                note=note,
                checked=sizes.rows * reps,
            )
        )
        run.results.append(
            Result(
                "spark_keyed",
                label,
                RECIPE,
                "rows/s",
                True,
                recipe,
                note="repartition + sortWithinPartitions + serial mapPartitions",
                checked=sizes.rows * reps,
            )
        )
        run.progress.step("spark: process_keyed vs the recipe")

        # One giant component: bridge rows (k_j, k_j+1), last in id order, join every key.
        bridges = spark.range(sizes.keys - 1).select(
            (F.col("id") + sizes.rows).alias("id"),
            F.array(F.concat(F.lit("k"), F.col("id")), F.concat(F.lit("k"), F.col("id") + 1)).alias(
                "keys"
            ),
        )
        giant = df.select("id", F.array("key").alias("keys")).unionByName(bridges)
        giant = giant.withColumn("key", F.col("keys")[0]).cache()
        giant.count()
        samples = []
        for _ in range(reps):
            directory = os.path.join(scratch, "giant")
            shutil.rmtree(directory, ignore_errors=True)
            os.mkdir(directory)
            t0 = time.perf_counter()
            out = ss.process_keyed(
                giant,
                "keys",
                Position(directory, sizes.keys),
                "id",
                result_type="int",
                workers_per_task=WORKERS,
            )
            n = out.count()
            samples.append(n / (time.perf_counter() - t0))
        run.results.append(
            Result(
                "spark_giant",
                f"the same + {sizes.keys - 1:,} bridge rows: 1 component",
                SHMCHAN,
                "rows/s",
                True,
                samples,
                note="everything in one Spark task (one KeyedExecutor)",
            )
        )
        run.progress.step("spark: one giant component")

        # Components of a random multi-key graph, on Spark.
        n = sizes.graph_rows
        pick = [
            F.concat(F.lit("g"), F.pmod(F.xxhash64("id", F.lit(s)), F.lit(n))) for s in (2, 3, 4)
        ]
        width = F.pmod(F.xxhash64("id", F.lit(5)), F.lit(3)).cast("int") + 1
        graph = spark.range(n).select("id", F.slice(F.array(*pick), 1, width).alias("keys"))
        graph = graph.cache()
        graph.count()
        seconds = []
        infos = []
        for _ in range(reps):
            t0 = time.perf_counter()
            comp = ss.components(graph, "keys", driver_threshold=0)
            seconds.append(time.perf_counter() - t0)
            infos.append(comp.info)
        info = infos[-1]
        run.results.append(
            Result(
                "spark_components",
                f"components of {n:,} rows (1-3 random keys)",
                SHMCHAN,
                "s",
                False,
                seconds,
                note=f"large-star/small-star on Spark: {info.rounds} rounds, {info.edges:,} edges",
            )
        )
        run.progress.step("spark: components")
    finally:
        ss.stop(spark)
        shutil.rmtree(scratch, ignore_errors=True)


def _targets(results: list[Result]) -> list[Target]:
    ratio = median_ratio(results, ("spark_keyed", SHMCHAN), ("spark_keyed", RECIPE))
    return [
        Target(
            "spark: process_keyed / Spark recipe",
            ratio,
            5.0,
            ">=",
            f"2 ms I/O-bound fn, workers_per_task={WORKERS}, same data and session",
        )
    ]


register(
    "spark", _run_spark, steps=lambda sizes, nsys: 3, order=90, default=False, targets=_targets
)
