"""Connected components of the key graph: which rows must share a Spark partition.

Rows are linked when they share a key; a row with several keys links all of them. Every
key becomes a vertex whose id is `xxhash64(key)` (Spark's own 64-bit hash, computed in the
JVM). As with shmchan's key hash, a collision can only merge two components, which adds
serialization and never lets conflicting rows apart. Each row contributes a star: an edge
from each of its keys to its smallest key id. Edges are kept as `(hi, lo)` with hi > lo.

Three ways to label the components, all giving every vertex the smallest id of its
component:

* **On the driver** (when the graph has at most `driver_threshold` edges): collect
  the edges and run union-find (union by smaller id, path halving). Reported as 0 rounds.
* **Local union-find first** (`algorithm="local"`, the default on Spark): each partition of
  the edges runs union-find over its own edges, in place (no shuffle), and emits a star
  per local component: each vertex to the component's smallest id. These forests keep
  exactly the connectivity of the graph (each local component stays connected through its
  star). Few forest edges are finished on the driver; up to `task_threshold` of them by
  union-find in one Spark task (2 rounds in all, whatever the graph's diameter: a long
  chain costs nothing more); more go through the star rounds below.
* **Large-star / small-star** (`algorithm="stars"`), with DataFrame operations only: the
  alternating large-star / small-star algorithm of Kiveris et al., "Connected Components
  in MapReduce and Beyond" (SoCC 2014). One round is one large-star and one small-star step:

      large-star: for every vertex u with neighbourhood N(u), m(u) = min(N(u) + {u});
                  each neighbour v > u is linked to m(u) instead of u.
      small-star: for every vertex u, m = min of u's smaller neighbours (and u);
                  u and each of those neighbours is linked to m.

  Both keep the components and shrink the ids' distance to their minimum; the number of
  rounds is O(log^2 n) in the worst case and O(log n) in practice (a 300-row chain takes
  a handful, not 300). The loop stops when the edges form stars around their minimum:
  every vertex has one edge, to a vertex that has none of its own. Each round's edges are
  checkpointed (reliably when the SparkContext has a checkpoint directory, as `session()`
  sets; locally otherwise), so the query plan stays one round long.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    ByteType,
    DataType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
)

from .errors import ColumnError

__all__ = [
    "DRIVER_THRESHOLD",
    "Components",
    "ComponentsInfo",
    "components",
    "partition_by_keys",
    "key_ids",
]

log = logging.getLogger("shmchan.spark")

DRIVER_THRESHOLD = 100_000
"""Default `driver_threshold`: key graphs with at most this many distinct edges are labelled
by union-find on the driver (the environment's SHMCHAN_SPARK_DRIVER_THRESHOLD overrides it)."""

TASK_THRESHOLD = 4_000_000
"""Default `task_threshold`: local forests of at most this many edges are finished by
union-find in one Spark task (~0.5 GB of Python objects at most in that task)."""

COMPONENT = "component"
MAX_ROUNDS = 200  # far beyond O(log^2 n) for any graph that fits a cluster: a bug guard

_VERTEX = "__shmchan_vertex"
_LABEL = "__shmchan_label"
_MIN = "__shmchan_min"
_KEY_TYPES = (StringType, BinaryType, LongType, IntegerType, ShortType, ByteType)


@dataclass(frozen=True)
class ComponentsInfo:
    """How the components of one key graph were computed."""

    method: str
    """"driver" (union-find on the driver) or "spark" (the labels computed by Spark)."""
    rounds: int
    """Rounds of Spark work, each ending in a shuffle or a checkpoint (0 on the driver):
    with "stars", its large-star + small-star rounds; with "local", the union-find pass
    over each partition, then the one-task union-find or the star rounds after it."""
    edges: int
    """Edges labelled: the distinct edges of the key graph (each key of a row to the
    row's smallest key) with "stars", the edges of the local forests with "local"."""
    seconds: float
    """Wall time of the computation, the edges' first pass included."""
    algorithm: str = "stars"
    """"local" (union-find inside each partition first) or "stars" (large-star /
    small-star on all the edges): the `algorithm` argument of `components()`."""


@dataclass(frozen=True)
class Components:
    """The labels of a key graph and how they were computed."""

    labels: DataFrame
    """`(vertex, component)` longs for every key id that is not its component's smallest id
    (a key id absent from it is its own component)."""
    info: ComponentsInfo


def key_ids(df: DataFrame, keys_col: str) -> Column:
    """An `array<bigint>` column: the ids (xxhash64) of the row's non-null keys, deduplicated.

    `keys_col` holds one key (string, integer or binary) or an array of them.
    """
    if keys_col not in df.columns:
        raise ColumnError(f"no column {keys_col!r} (columns: {', '.join(df.columns)})")
    dtype = df.schema[keys_col].dataType
    col = F.col(f"`{keys_col}`")
    if isinstance(dtype, ArrayType):
        _check_key_type(keys_col, dtype.elementType)
        present = F.filter(col, lambda k: k.isNotNull())
        return F.array_distinct(F.transform(present, lambda k: F.xxhash64(k)))
    _check_key_type(keys_col, dtype)
    return F.when(col.isNull(), F.array().cast("array<bigint>")).otherwise(F.array(F.xxhash64(col)))


def _check_key_type(keys_col: str, dtype: DataType) -> None:
    if not isinstance(dtype, _KEY_TYPES):
        raise ColumnError(
            f"column {keys_col!r} has type {dtype.simpleString()}: keys must be strings, "
            "integers or binary, or an array of them"
        )


def _threshold(driver_threshold: int | None) -> int:
    if driver_threshold is None:
        env = os.environ.get("SHMCHAN_SPARK_DRIVER_THRESHOLD")
        driver_threshold = int(env) if env else DRIVER_THRESHOLD
    if driver_threshold < 0:
        raise ValueError(f"driver_threshold must be >= 0, got {driver_threshold}")
    return driver_threshold


def _materialize(df: DataFrame) -> DataFrame:
    """Cut the lineage: a reliable checkpoint when the context has a directory for it."""
    if df.sparkSession.sparkContext.getCheckpointDir():
        return df.checkpoint(eager=True)
    return df.localCheckpoint(eager=True)


def components(
    df: DataFrame,
    keys_col: str,
    *,
    driver_threshold: int | None = None,
    algorithm: str = "local",
    task_threshold: int | None = None,
) -> Components:
    """Label the connected components of `df`'s key graph (see the module docstring).

    `driver_threshold` (default `DRIVER_THRESHOLD`, or the environment's
    SHMCHAN_SPARK_DRIVER_THRESHOLD): graphs with at most this many edges are solved on
    the driver; 0 always uses Spark. `algorithm`: "local" (union-find inside each
    partition, then one task or star rounds; the default) or "stars" (large-star /
    small-star rounds on all the edges). `task_threshold` (default `TASK_THRESHOLD`):
    with "local", the most local-forest edges finished by union-find in one Spark task;
    past it the forest goes through large-star / small-star rounds.
    """
    if algorithm not in ("local", "stars"):
        raise ValueError(f"algorithm must be 'local' or 'stars', not {algorithm!r}")
    threshold = _threshold(driver_threshold)
    one_task = TASK_THRESHOLD if task_threshold is None else task_threshold
    if one_task < 0:
        raise ValueError(f"task_threshold must be >= 0, got {one_task}")
    started = time.perf_counter()
    ids = df.select(key_ids(df, keys_col).alias("ids")).where(F.size("ids") > 1)
    edges = ids.select(F.explode("ids").alias("hi"), F.array_min("ids").alias("lo"))
    edges = edges.where("hi != lo")
    spark = df.sparkSession
    schema = f"{_VERTEX} bigint, {_LABEL} bigint"
    if algorithm == "local":
        labels, info = _local_components(edges, threshold, one_task)
    else:
        labels, info = _star_components(edges, threshold)
    if info.method == "driver":
        labels = spark.createDataFrame(labels, schema)
    else:
        labels = labels.toDF(_VERTEX, _LABEL)
    info = replace(info, seconds=time.perf_counter() - started)
    log.info(
        "components of %r: %s/%s, %d edges, %d rounds, %.2f s",
        keys_col,
        info.method,
        info.algorithm,
        info.edges,
        info.rounds,
        info.seconds,
    )
    return Components(labels, info)


def _star_components(edges: DataFrame, threshold: int) -> tuple[Any, ComponentsInfo]:
    """Distinct edges; union-find on the driver if few, else large-star / small-star."""
    # Kept in memory for as long as it takes to count it and, on the driver path, collect
    # it: one pass over `df` either way, and no checkpoint unless the rounds need one.
    edges = edges.distinct().persist()
    try:
        count = edges.count()
        if count <= threshold:
            pairs = _union_find((row.hi, row.lo) for row in edges.collect())
            return pairs, ComponentsInfo("driver", 0, count, 0.0, "stars")
        stars, rounds = _star_rounds(_materialize(edges))
        return stars, ComponentsInfo("spark", rounds, count, 0.0, "stars")
    finally:
        edges.unpersist()


def _local_components(
    edges: DataFrame, threshold: int, one_task: int
) -> tuple[Any, ComponentsInfo]:
    """Union-find inside each partition of `edges` (no shuffle): a forest of stars, each
    local component linked to its smallest id, with the components of the whole graph.
    Few forest edges: union-find over them on the driver (one job). Else the forest goes
    to one Spark task that runs union-find over it (at most `one_task` edges), or
    through large-star / small-star rounds. Rounds counted: the local pass is one, the
    one-task finish another, and each star round one more."""
    spark = edges.sparkSession
    forest = spark.createDataFrame(
        edges.rdd.mapPartitions(_forest_of), "hi bigint, lo bigint"
    ).persist()
    try:
        if threshold > 0:
            few = forest.limit(threshold + 1).collect()
            if len(few) <= threshold:
                pairs = _union_find((row.hi, row.lo) for row in few)
                return pairs, ComponentsInfo("driver", 0, len(few), 0.0, "local")
        count = forest.count()
        if count <= one_task:
            labels = spark.createDataFrame(
                forest.rdd.coalesce(1).mapPartitions(_forest_of), "hi bigint, lo bigint"
            )
            return _materialize(labels), ComponentsInfo("spark", 2, count, 0.0, "local")
        stars, rounds = _star_rounds(_materialize(forest.distinct()))
        return stars, ComponentsInfo("spark", 1 + rounds, count, 0.0, "local")
    finally:
        forest.unpersist()


def _forest_of(edges: Iterable[Any]) -> Iterator[tuple[int, int]]:
    """Union-find over one partition's (hi, lo) edges: (vertex, smallest id of its local
    component) for every vertex that is not that id."""
    return iter(_union_find((e[0], e[1]) for e in edges))


def _union_find(edges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(vertex, smallest id of its component) for every vertex that is not that id."""
    parent: dict[int, int] = {}

    def find(v: int) -> int:
        root = parent.setdefault(v, v)
        while root != parent[root]:
            parent[root] = parent[parent[root]]  # path halving
            root = parent[root]
        return root

    for hi, lo in edges:
        a, b = find(hi), find(lo)
        if a != b:
            parent[max(a, b)] = min(a, b)
    return [(v, r) for v in parent if (r := find(v)) != v]


def _large_star(edges: DataFrame) -> DataFrame:
    both = edges.select(F.col("hi").alias("u"), F.col("lo").alias("v")).unionAll(
        edges.select(F.col("lo").alias("u"), F.col("hi").alias("v"))
    )
    low = both.groupBy("u").agg(F.least(F.min("v"), F.col("u")).alias("m"))
    return (
        both.where("v > u")
        .join(low, "u")
        .select(F.col("v").alias("hi"), F.col("m").alias("lo"))
        .distinct()
    )


def _small_star(edges: DataFrame) -> DataFrame:
    low = edges.groupBy("hi").agg(F.min("lo").alias("m"))
    linked = edges.join(low, "hi")
    neighbours = linked.where("lo != m").select(F.col("lo").alias("hi"), F.col("m").alias("lo"))
    centre = low.select("hi", F.col("m").alias("lo"))
    return neighbours.unionAll(centre).distinct()


def _is_star_forest(edges: DataFrame) -> bool:
    """Every vertex has exactly one edge, and it points to a vertex with no edge of its own.

    One Spark job: each edge, with whether its `lo` has edges of its own."""
    centres = edges.select(F.col("hi").alias("lo")).distinct().withColumn("busy", F.lit(1))
    marked = edges.join(centres, "lo", "left")
    row = marked.agg(
        F.count(F.lit(1)).alias("edges"),
        F.countDistinct("hi").alias("vertices"),
        F.count("busy").alias("chained"),
    ).first()
    assert row is not None  # a global aggregate always has one row
    return bool(row.chained == 0 and row.edges == row.vertices)


def _star_rounds(edges: DataFrame) -> tuple[DataFrame, int]:
    rounds = 0
    while not _is_star_forest(edges):
        if rounds == MAX_ROUNDS:
            raise RuntimeError(f"components did not converge in {MAX_ROUNDS} rounds")
        edges = _materialize(_small_star(_large_star(edges)))
        rounds += 1
    return edges, rounds


def _order_cols(df: DataFrame, order_col: str | Sequence[str]) -> list[str]:
    cols = [order_col] if isinstance(order_col, str) else list(order_col)
    if not cols:
        raise ValueError("order_col must name at least one column")
    for c in cols:
        if c not in df.columns:
            raise ColumnError(f"no column {c!r} (columns: {', '.join(df.columns)})")
    return cols


def partition_by_keys(
    df: DataFrame,
    keys_col: str,
    order_col: str | Sequence[str],
    *,
    num_partitions: int | None = None,
    driver_threshold: int | None = None,
) -> DataFrame:
    """`df` plus a `component` column (a long): rows that share a key, directly or through
    rows with several keys, have the same component; repartitioned by component (all rows
    of a component in one partition) and sorted within partitions by `order_col`.

    `keys_col` holds a row's key (string, integer or binary) or an array of keys; a row
    with no keys (null or empty) gets a component of its own, hashed from `order_col`.
    `order_col` is one column name or several. `num_partitions` defaults to
    `spark.sql.shuffle.partitions`; `driver_threshold`: see `components()`.

    How the components were computed (method, rounds, edges, seconds) is attached to the
    returned DataFrame as `.components_info` (a `ComponentsInfo`; DataFrames derived from it
    do not carry it) and logged at INFO level on the "shmchan.spark" logger.
    `df` is read twice (once for the key graph, once to label its rows): cache it first if
    it is expensive, and it must be deterministic.
    """
    out, info = partition(df, keys_col, order_col, COMPONENT, num_partitions, driver_threshold)
    out.components_info = info  # type: ignore[attr-defined]
    out._shmchan_partitioned_by = (keys_col, order_col)  # type: ignore[attr-defined]
    return out


def partition(
    df: DataFrame,
    keys_col: str,
    order_col: str | Sequence[str],
    column: str,
    num_partitions: int | None = None,
    driver_threshold: int | None = None,
) -> tuple[DataFrame, ComponentsInfo]:
    """partition_by_keys with the component in `column` (replacing any column of that name)."""
    order = _order_cols(df, order_col)
    ids = key_ids(df, keys_col)
    comp = components(df, keys_col, driver_threshold=driver_threshold)
    labels = comp.labels
    if comp.info.method == "driver":
        labels = F.broadcast(labels)
    rows = df.withColumn(_MIN, F.array_min(ids))
    joined = rows.join(labels, rows[_MIN] == labels[_VERTEX], "left")
    no_keys = F.xxhash64(F.lit("shmchan.spark: no keys"), *[F.col(f"`{c}`") for c in order])
    component = F.coalesce(F.col(_LABEL), F.col(_MIN), no_keys).alias(column)
    kept = [F.col(f"`{c}`") for c in df.columns if c != column]
    labelled = joined.select(*kept, component)
    if num_partitions is None:
        num_partitions = int(df.sparkSession.conf.get("spark.sql.shuffle.partitions") or "200")
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be at least 1, got {num_partitions}")
    out = labelled.repartition(num_partitions, column).sortWithinPartitions(*order)
    return out, comp.info


def partitioned_by(df: DataFrame) -> tuple[str, str | Sequence[str]] | None:
    """`(keys_col, order_col)` if `df` is the very DataFrame partition_by_keys returned for
    them (attributes do not pass to DataFrames derived from it), else None."""
    return getattr(df, "_shmchan_partitioned_by", None)
