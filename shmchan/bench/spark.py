"""`--only spark`: process_keyed against Spark's usual recipe for per-key order.

Spark's usual way to process rows in per-key order is to `repartition` by the key,
`sortWithinPartitions` by the order column and run the function serially in
`mapPartitions`: a partition's rows run one at a time, however many of them could run
together. `process_keyed(workers_per_task=8)` runs them through a KeyedExecutor instead.
Both run, on the same cached data and session, an I/O-bound function (a 2 ms sleep) whose
result depends on the order: the row's position among the rows of its key, counted in a
shared file of counters. The two results must be identical (else the run fails).

The 400 000-row size runs once (ONCE_FROM) and without applyInPandas (PANDAS_UP_TO),
which would take half an hour there; SHMCHAN_BENCH_SPARK_ROWS picks other sizes.

Also measured: the key-graph components of 1 M rows (100 k quick) on Spark
(large-star / small-star, forced with driver_threshold=0) with their rounds, and the cost
of one giant component: the same rows plus bridge rows that join every key into one
component, so that everything runs in one Spark task.
Needs the `[spark]` extra and Java 17+; a run without them fails with a clear message.
"""

from __future__ import annotations

import importlib
import importlib.util
import mmap
import os
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any

from shmchan.bench.common import SHMCHAN, BenchError
from shmchan.bench.harness import Run
from shmchan.bench.registry import register
from shmchan.bench.report import Result, Target, median_ratio

RECIPE = "Spark recipe"
PANDAS = "applyInPandas"
STARS = "large-star/small-star"
SLEEP = 0.002  # seconds of waiting per row: an I/O-bound function
WORKERS = 8  # workers_per_task
CHAIN = 300  # rows of the chain added to the components' random graph
ONCE_FROM = 200_000  # sizes from here run once: the 400 000-row recipe alone takes ~400 s
PANDAS_UP_TO = 40_000  # applyInPandas pays ~20 ms per key here: 80 000 keys would take ~30 min

ROWS_ENV = "SHMCHAN_BENCH_SPARK_ROWS"  # e.g. "4000,40000": the process_keyed sizes
GRAPH_ENV = "SHMCHAN_BENCH_SPARK_GRAPH_ROWS"  # e.g. "200000": the components' rows


@dataclass(frozen=True)
class _Sizes:
    rows: tuple[int, ...]  # sizes of the order-dependent workload (keys: rows / 5)
    graph_rows: int  # rows of the component computation (2 keys each) + the chain
    reps: int


_QUICK = _Sizes(rows=(2_000,), graph_rows=20_000, reps=1)
_FULL = _Sizes(rows=(4_000, 40_000, 400_000), graph_rows=1_000_000, reps=3)


def _sizes(quick: bool) -> _Sizes:
    """The sizes of this run: quick or full, each overridable from the environment (the
    400 000-row recipe alone waits 800 s of 2 ms sleeps, a lot for a small machine)."""
    sizes = _QUICK if quick else _FULL
    rows = os.environ.get(ROWS_ENV)
    graph = os.environ.get(GRAPH_ENV)
    try:
        if rows:
            sizes = replace(sizes, rows=tuple(int(r) for r in rows.split(",")))
        if graph:
            sizes = replace(sizes, graph_rows=int(graph))
    except ValueError:
        raise BenchError(f"spark: {ROWS_ENV} / {GRAPH_ENV} must be integers") from None
    return sizes


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


def _pandas(df: Any, fn: Position) -> dict[int, int]:
    """applyInPandas: each key's rows as one pandas frame, sorted by id, run serially."""
    pd: Any = importlib.import_module("pandas")  # the bench extra; untyped

    def per_key(frame: Any) -> Any:
        frame = frame.sort_values("id")
        results = [fn(row) for row in frame.itertuples(index=False)]
        return pd.DataFrame({"id": frame["id"], "result": results})

    out = df.groupBy("key").applyInPandas(per_key, schema="id long, result int")
    return {r.id: r.result for r in out.collect()}


def _have_pandas() -> str | None:
    """None if applyInPandas can run here, else why not."""
    for name in ("pandas", "pyarrow"):
        if importlib.util.find_spec(name) is None:
            return f"applyInPandas not run: {name} is not installed (the bench extra has it)"
    return None


def _executor_start(partition: Any) -> Any:
    """In a Spark task: seconds to start a KeyedExecutor, run one row, and shut it down
    (what process_keyed pays in the first task a Python worker runs)."""
    import shmchan

    t0 = time.perf_counter()
    with shmchan.KeyedExecutor(max_workers=WORKERS) as ex:
        list(ex.map(abs, [1], keys=lambda x: (x,)))
    yield time.perf_counter() - t0


def _run_spark(run: Run) -> None:
    try:
        from pyspark.sql import functions as F

        from shmchan import spark as ss
    except ImportError as e:
        raise BenchError(f"spark: {e}") from None
    sizes = _sizes(run.quick)
    reps = run.sizes.reps if run.sizes.reps < sizes.reps else sizes.reps
    no_pandas = _have_pandas()
    scratch = tempfile.mkdtemp(prefix="shmchan-bench-spark-")
    spark = ss.session("shmchan-bench")
    try:
        partitions = int(spark.conf.get("spark.sql.shuffle.partitions") or "4")
        here = os.path.join(scratch, "state")
        for rows in sizes.rows:
            keys = max(rows // 5, 1)
            key = F.concat(F.lit("k"), F.pmod(F.xxhash64("id", F.lit(1)), F.lit(keys)))
            df = spark.range(rows).select("id", key.alias("key")).cache()
            df.count()
            systems: list[tuple[str, Any, str]] = [
                (
                    SHMCHAN,
                    lambda fn, d=df: _keyed(d, fn),
                    f"process_keyed, {WORKERS} workers per task",
                ),
                (
                    RECIPE,
                    lambda fn, d=df: _recipe(d, fn, partitions),
                    f"repartition({partitions}) + sortWithinPartitions + serial mapPartitions"
                    + ("" if no_pandas is None else f"; {no_pandas}"),
                ),
            ]
            if no_pandas is None and rows <= PANDAS_UP_TO:
                systems.append(
                    (PANDAS, lambda fn, d=df: _pandas(d, fn), "groupBy(key).applyInPandas")
                )
            if rows == sizes.rows[0]:  # a discarded warm-up: workers start, modules load
                warm = df.limit(200)
                _timed(here, keys, lambda fn, w=warm: _keyed(w, fn))
                _timed(here, keys, lambda fn, w=warm: _recipe(w, fn, partitions))
                if no_pandas is None:
                    _timed(here, keys, lambda fn, w=warm: _pandas(w, fn))
            samples: dict[str, list[float]] = {name: [] for name, _, _ in systems}
            for _ in range(1 if rows >= ONCE_FROM else reps):  # interleaved: drift hits all
                want = None
                for name, call, _ in systems:
                    seconds, got = _timed(here, keys, call)
                    if len(got) != rows or (want is not None and got != want):
                        raise BenchError(f"spark: {name} gave different results at {rows} rows")
                    want = got
                    samples[name].append(rows / seconds)
            label = f"{rows:,} rows, 2 ms fn, {keys:,} keys"
            for name, _, note in systems:
                run.results.append(
                    Result(
                        "spark_keyed" if rows == max(sizes.rows) else f"spark_keyed_{rows}",
                        label,
                        name,
                        "rows/s",
                        True,
                        samples[name],
                        note=note,
                        checked=rows * len(samples[name]),
                    )
                )
            df.unpersist()
        run.progress.step("spark: process_keyed vs the recipe and applyInPandas")

        # What a Spark task pays to start (and stop) its KeyedExecutor.
        starts = (
            spark.sparkContext.parallelize(range(4 * reps), 4 * reps)
            .mapPartitions(_executor_start)
            .collect()
        )
        run.results.append(
            Result(
                "spark_executor_start",
                f"KeyedExecutor({WORKERS} workers) start + 1 row + shutdown in a Spark task",
                SHMCHAN,
                "s",
                False,
                starts,
                note="paid by a Spark Python worker's first process_keyed task: its later "
                "tasks reuse the executor",
            )
        )
        run.progress.step("spark: executor start-up per task")

        # Components of a random graph (2 keys per row) plus a chain, both algorithms.
        n = sizes.graph_rows
        pick = [F.concat(F.lit("g"), F.pmod(F.xxhash64("id", F.lit(s)), F.lit(n))) for s in (2, 3)]
        chain = spark.range(CHAIN).select(
            (F.col("id") + n).alias("id"),
            F.array(F.concat(F.lit("c"), F.col("id")), F.concat(F.lit("c"), F.col("id") + 1)).alias(
                "keys"
            ),
        )
        graph = spark.range(n).select("id", F.array(*pick).alias("keys")).unionByName(chain)
        graph = graph.cache()
        graph.count()
        timings: dict[str, list[float]] = {"stars": [], "local": []}
        infos = {}
        labels = {}
        for _ in range(reps):
            for algorithm in ("stars", "local"):
                t0 = time.perf_counter()
                comp = ss.components(graph, "keys", driver_threshold=0, algorithm=algorithm)
                labels[algorithm] = comp.labels.cache()
                labels[algorithm].count()
                timings[algorithm].append(time.perf_counter() - t0)
                infos[algorithm] = comp.info
        a, b = labels["stars"], labels["local"]
        if a.exceptAll(b).count() or b.exceptAll(a).count():
            raise BenchError("spark: the two components algorithms labelled differently")
        for algorithm, system in (("stars", STARS), ("local", SHMCHAN)):
            info = infos[algorithm]
            run.results.append(
                Result(
                    "spark_components",
                    f"components of {n:,} rows (2 random keys) + a {CHAIN}-row chain",
                    system,
                    "s",
                    False,
                    timings[algorithm],
                    note=f"algorithm={algorithm!r}: {info.rounds} rounds, {info.edges:,} edges",
                )
            )
        run.progress.step("spark: components")
    finally:
        ss.stop(spark)
        shutil.rmtree(scratch, ignore_errors=True)


def _targets(results: list[Result]) -> list[Target]:
    ratio = median_ratio(results, ("spark_keyed", SHMCHAN), ("spark_keyed", RECIPE))
    components = median_ratio(results, ("spark_components", SHMCHAN), ("spark_components", STARS))
    return [
        Target(
            "spark: process_keyed / Spark recipe (largest size)",
            ratio,
            5.0,
            ">=",
            f"2 ms I/O-bound fn, workers_per_task={WORKERS}, same data and session",
        ),
        Target(
            "spark: components time, local / large-star+small-star",
            components,
            1 / 3,
            "<=",
            "same graph and session, labels checked identical",
        ),
    ]


register(
    "spark", _run_spark, steps=lambda sizes, nsys: 3, order=90, default=False, targets=_targets
)
