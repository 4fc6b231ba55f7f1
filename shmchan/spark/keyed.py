"""process_keyed: run a function on every row with the channel's fifo promise, on Spark.

Data flow of one call:

    driver:      partition_by_keys(df)       every component in one partition, rows sorted
                        |                    by order_col within it
    Spark task:  rows of one partition  ---> KeyedExecutor (workers_per_task processes)
                 in order, as batches of     runs fn(row) with keys = the row's keys:
                 `map` (two in flight)       rows sharing a key never at once, and in
                                             submission order; others in parallel
                        |
                 (input columns, result, attempt) rows, in partition order

Rows that share a key, directly or transitively, are in one partition, so the executor of
that partition alone decides their order: the fifo guarantee holds across the whole job.

The executor is borrowed from the Python worker's own (executors.py): the tasks a Python
worker runs one after another share its worker processes. Each task posts its plan (the
function, cloudpickled so lambdas and closures work, the column names, the task's
context) once; each row is one executor task whose argument is the plan's number and the
row's values, and a worker loads a plan the first time it meets its number.

Spark retries a failed task from its first row, so across task failures processing is
at-least-once: `task_context()` tells `fn` which Spark task attempt it runs in.
"""

from __future__ import annotations

import functools
import itertools
import os
import pickle
import subprocess
import sys
import threading
import types
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from pyspark import TaskContext as _SparkTaskContext
from pyspark import cloudpickle as _cloudpickle
from pyspark.sql import DataFrame, Row
from pyspark.sql.types import (
    DataType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from .errors import ColumnError
from .executors import Config, borrowed
from .keygraph import ComponentsInfo, partition, partitioned_by
from .producers import message_keys

__all__ = ["process_keyed", "task_context", "TaskContext"]

cloudpickle: Any = _cloudpickle  # PySpark's copy of cloudpickle has no type annotations

RESULT = "result"
ATTEMPT = "attempt"
BATCH_ID = "batch_id"
ROW_ID = "row_id"
_COMPONENT = "__shmchan_component"
BATCH_PER_WORKER = 64  # rows per map batch per worker: enough to look past a blocked key


class TaskContext(NamedTuple):
    """Where a row of `process_keyed` runs: its Spark partition and task attempt, and on a
    stream (`process_keyed_stream`) its micro-batch and the row's stable identity."""

    partition_id: int
    """The Spark partition (TaskContext.partitionId())."""
    attempt: int
    """The Spark task's attempt: 1 on the first run, 2 on Spark's first retry, ...
    (Spark's TaskContext.attemptNumber() + 1, counted like shmchan's Handle.attempt)."""
    batch_id: int | None = None
    """The micro-batch of a streaming query (foreachBatch's batchId); None in a batch job."""
    row_id: str | None = None
    """The row's identity on a stream: the same every time this row runs, across Spark task
    retries and query restarts, and different for every other row of the query (see
    `process_keyed_stream`); None in a batch job."""


_context = threading.local()  # .value: the TaskContext of the row being run, in a worker
_installed: dict[str, Any] = {}  # "fn": the user's function, in an executor's worker


def task_context() -> TaskContext:
    """The `(partition_id, attempt, batch_id, row_id)` of the row `fn` is running.

    Call it inside the `fn` given to `process_keyed` or `process_keyed_stream` (in any
    other Spark task it reads PySpark's own TaskContext). A row may run more than once
    when Spark retries its task (attempt > 1 then) or a streaming query restarts: on a
    stream, `batch_id` and `row_id` are the same every time, so an effect recorded
    under `row_id` (an insert that ignores a row id it already has) happens once.
    `batch_id` and `row_id` are None in a batch job. RuntimeError outside a Spark task.
    """
    ctx = getattr(_context, "value", None)
    if ctx is not None:
        return ctx  # type: ignore[no-any-return]
    spark_ctx = _SparkTaskContext.get()
    if spark_ctx is not None:
        return TaskContext(spark_ctx.partitionId(), spark_ctx.attemptNumber() + 1)
    raise RuntimeError("task_context() is only available inside a Spark task or process_keyed's fn")


def process_keyed(
    df: DataFrame,
    keys_col: str,
    fn: Callable[[Row], Any],
    order_col: str | Sequence[str],
    *,
    result_type: str | DataType = "string",
    workers_per_task: int = 4,
    max_attempts: int = 3,
    task_timeout: float | None = None,
    num_partitions: int | None = None,
) -> DataFrame:
    """Run `fn(row)` for every row of `df` with shmchan's fifo promise, on Spark.

    No two rows that share a key (an element of `keys_col`: one key, or an array of keys)
    run at the same time, and rows that share a key run in `order_col` order (one column
    or several; make it unique among rows that share a key, or ties run in either order).
    `df` is partitioned with `partition_by_keys` into `num_partitions` partitions (unless
    it is the unchanged DataFrame that `partition_by_keys(df, keys_col, order_col)`
    returned: then it is used as it is); inside each Spark task the partition's rows go
    through a `shmchan.KeyedExecutor` of `workers_per_task` processes, so rows that do
    not conflict still run in parallel. `num_partitions` defaults to the context's
    `defaultParallelism` (the cores Spark runs tasks on), not to
    `spark.sql.shuffle.partitions` (200 unless set): a task's `workers_per_task`
    processes are kept by its Spark Python worker for the next task it runs (for up to
    45 s idle), but partitions beyond one per core still only add scheduling.
    `fn` gets a `pyspark.sql.Row` of `df`'s columns and runs in a worker process (it is
    cloudpickled: lambdas and closures work).

    Returns a DataFrame of `df`'s columns plus `result` (fn's return value, of
    `result_type`, a Spark DDL type string or DataType) and `attempt` (the Spark task
    attempt that produced the row, 1 first; see `task_context()`). Lazy, like every
    DataFrame: `fn` runs when an action runs it, once per action (cache or write the result
    rather than acting on it twice). The components are computed by this call; how is
    attached as `.components_info`, as by `partition_by_keys`.

    Failures: a worker process that dies is replaced and its row runs again, keeping its
    place in key order, up to `max_attempts` times (then the task fails with
    `shmchan.WorkerDied`); `task_timeout` seconds bounds one row (`shmchan.TaskTimeout`).
    An exception raised by `fn` fails the Spark task. **At-least-once:** when Spark retries
    a failed task, every row of its partition runs again (attempt + 1), including those
    that had already run; rows of other partitions do not. Make `fn` idempotent, using
    `task_context()` and the row's own identity.
    """
    check_options(workers_per_task, max_attempts, num_partitions, fn)
    for taken in (RESULT, ATTEMPT):
        if taken in df.columns:
            raise ColumnError(f"df already has a column {taken!r}, which process_keyed adds")
    info: ComponentsInfo | None
    if partitioned_by(df) == (keys_col, order_col):
        parts = df  # partition_by_keys' own result, unchanged: its partitioning holds
        info = getattr(df, "components_info", None)
    else:
        parts, info = partition_rows(df, keys_col, order_col, num_partitions)
    plan = Plan(
        cols=list(df.columns),
        keys_col=keys_col,
        fn=_dump_function(fn),
        workers=workers_per_task,
        max_attempts=max_attempts,
        task_timeout=task_timeout,
    )
    out = run_plan(parts, plan, list(df.schema.fields), result_type)
    out.components_info = info  # type: ignore[attr-defined]
    return out


def check_options(
    workers_per_task: int, max_attempts: int, num_partitions: int | None, fn: object
) -> None:
    """Refuse the options process_keyed and process_keyed_stream cannot run with."""
    if workers_per_task < 1:
        raise ValueError(f"workers_per_task must be at least 1, got {workers_per_task}")
    if num_partitions is not None and num_partitions < 1:
        raise ValueError(f"num_partitions must be at least 1, got {num_partitions}")
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {type(fn).__name__}")


def partition_rows(
    df: DataFrame, keys_col: str, order_col: str | Sequence[str], num_partitions: int | None
) -> tuple[DataFrame, ComponentsInfo]:
    """`df` partitioned by key components and sorted by `order_col` within partitions,
    into `num_partitions` (default: the context's defaultParallelism) partitions."""
    if num_partitions is None:
        num_partitions = max(df.sparkSession.sparkContext.defaultParallelism, 1)
    parts, info = partition(df, keys_col, order_col, _COMPONENT, num_partitions)
    return parts.drop(_COMPONENT), info


def run_plan(
    parts: DataFrame, plan: Plan, fields: list[StructField], result_type: str | DataType
) -> DataFrame:
    """The DataFrame of `fields` + result + attempt (+ batch_id + row_id on a stream) that
    runs `plan` on every partition of `parts` when an action runs it."""
    spark = parts.sparkSession
    dtype = spark._parse_ddl(result_type) if isinstance(result_type, str) else result_type
    added = [StructField(RESULT, dtype, True), StructField(ATTEMPT, IntegerType(), False)]
    if plan.batch_id is not None:
        added += [
            StructField(BATCH_ID, LongType(), False),
            StructField(ROW_ID, StringType(), False),
        ]
    schema = StructType([*fields, *added])
    return spark.createDataFrame(parts.rdd.mapPartitions(plan.run), schema)


def dump_function(fn: Callable[..., Any]) -> bytes:
    """`fn` pickled for the Spark tasks (see _dump_function)."""
    return _dump_function(fn)


class Plan(NamedTuple):
    """What every Spark task of one process_keyed call needs (pickled into the task).

    On a stream (`batch_id` set) the rows carry two hidden hash columns after `cols`
    (or an identity column, `id_col`), from which each row's `row_id` is made (see
    `RowIds`); the output rows then end with `batch_id` and `row_id` too."""

    cols: list[str]
    keys_col: str
    fn: bytes
    workers: int
    max_attempts: int
    task_timeout: float | None
    batch_id: int | None = None
    id_col: str | None = None

    def run(self, partition: Iterable[Row]) -> Iterator[tuple[Any, ...]]:
        """One Spark task: the partition's rows through a KeyedExecutor, results in order."""
        rows = iter(partition)
        first = next(rows, None)
        if first is None:
            return  # no executor for an empty partition
        spark_ctx = _SparkTaskContext.get()
        ctx = (
            TaskContext(spark_ctx.partitionId(), spark_ctx.attemptNumber() + 1)
            if spark_ctx is not None
            else TaskContext(0, 1)
        )
        ctx = ctx._replace(batch_id=self.batch_id)
        try:
            pickle.loads(self.fn)  # fail here, with the reason, rather than in every worker
        except Exception as e:
            raise RuntimeError(
                f"process_keyed: fn cannot be unpickled in the Spark task ({e!r}); define it "
                "in a module the Spark workers can import, or register that module with "
                "pyspark.cloudpickle.register_pickle_by_value()"
            ) from e
        keys_at = self.cols.index(self.keys_col)
        width = len(self.cols)
        config = Config(self.workers, self.max_attempts, self.task_timeout)
        with borrowed(config, _install) as lent:
            number = lent.post((self.fn, self.cols, ctx))
            items: Iterator[Any]
            if self.batch_id is None:
                items = ((number, tuple(row)) for row in itertools.chain([first], rows))
                run_one: Callable[[Any], Any] = _run_row

                def joined(item: Any, result: Any) -> tuple[Any, ...]:
                    return (*item[1], result, ctx.attempt)

            else:
                ids = RowIds(
                    self.batch_id, None if self.id_col is None else self.cols.index(self.id_col)
                )
                items = (
                    (number, values, row_id)
                    for values, row_id in ids.items(itertools.chain([first], rows), width)
                )
                run_one = _run_identified_row

                def joined(item: Any, result: Any) -> tuple[Any, ...]:
                    return (*item[1], result, ctx.attempt, self.batch_id, item[2])

            def keys_of(item: Any) -> tuple[Any, ...]:  # (plan number, values, ...)
                return message_keys(item[1][keys_at])

            try:
                # Rows go in as batches of `map`, in order; the next batch is submitted
                # before the results of the one before it are awaited, so the workers
                # never run dry.
                ex = lent.executor
                in_flight: deque[tuple[list[Any], Iterator[Any]]] = deque()
                for batch in _batches(items, BATCH_PER_WORKER * self.workers):
                    in_flight.append((batch, ex.map(run_one, batch, keys=keys_of)))
                    if len(in_flight) > 1:
                        batch, results = in_flight.popleft()
                        yield from map(joined, batch, results)
                while in_flight:
                    batch, results = in_flight.popleft()
                    yield from map(joined, batch, results)
            finally:
                lent.withdraw(number)


class RowIds:
    """Each row's `row_id` on a stream, the same every time the micro-batch runs.

    With an identity column: its value, as a string (the user promises it is unique).
    Otherwise "<batch>-<hash>-<n>": the hash is Spark's xxhash64 and hash (96 bits) of all
    the row's columns, computed in the JVM as two hidden columns, and n counts the rows
    of this task with the same hash before it. Identical rows share keys and so a
    partition; they are interchangeable, so whichever of them gets n = 0, the set of ids
    of a batch is the same on every run. A micro-batch reads the same input on every run
    (Spark replays it from the offsets in the checkpoint), so its ids are stable."""

    def __init__(self, batch_id: int, id_at: int | None) -> None:
        self.batch_id = batch_id
        self.id_at = id_at
        self.seen: dict[tuple[int, int], int] = {}

    def items(self, rows: Iterable[Row], width: int) -> Iterator[tuple[tuple[Any, ...], str]]:
        for row in rows:
            values = tuple(row)
            yield values[:width], self.of(values, width)

    def of(self, values: tuple[Any, ...], width: int) -> str:
        if self.id_at is not None:
            return str(values[self.id_at])
        h64, h32 = values[width], values[width + 1]
        n = self.seen.get((h64, h32), 0)
        self.seen[(h64, h32)] = n + 1
        return f"{self.batch_id}-{h64 & 0xFFFFFFFFFFFFFFFF:016x}{h32 & 0xFFFFFFFF:08x}-{n}"


def _batches(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    """The items, `size` at a time."""
    while batch := list(itertools.islice(items, size)):
        yield batch


def _dump_function(fn: Callable[..., Any]) -> bytes:
    """cloudpickle `fn`; by value when Spark's workers could not import its module.

    cloudpickle pickles a module-level function or class by reference (module + name).
    That fails in a Spark worker when the module was importable here only because this
    process put its directory on sys.path at run time (pytest's rootdir, a notebook's
    own folder), so such a module is pickled by value instead.
    """
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    by_value = (
        module is not None
        and module.__name__ != "__main__"
        and module.__name__ not in cloudpickle.list_registry_pickle_by_value()
        and not _on_worker_path(module)
    )
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return bytes(cloudpickle.dumps(fn))
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


@functools.cache
def _worker_path() -> tuple[str, ...]:
    """sys.path of a fresh interpreter started here (what Spark's local workers get)."""
    out = subprocess.run(
        [sys.executable, "-c", "import os, sys; print(os.pathsep.join(sys.path))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return tuple(os.path.realpath(p or os.curdir) for p in out.stdout.strip().split(os.pathsep))


def _on_worker_path(module: types.ModuleType) -> bool:
    top = sys.modules.get(module.__name__.partition(".")[0])
    where = getattr(top, "__file__", None)
    if where is None:
        return True  # built-in, namespace or frozen: leave it to cloudpickle
    root = os.path.dirname(where)
    if os.path.basename(where) == "__init__.py":
        root = os.path.dirname(root)
    return os.path.realpath(root) in _worker_path()


def _install(plans: str) -> None:
    """The executor's initializer: where this worker finds the plans of its tasks (the
    path they share, their number appended)."""
    _installed["plans"] = plans
    _installed["number"] = None


def _load(number: int) -> None:
    """Install the plan of task `number` in this worker: its function, its row type and
    its task context (each task of a reused executor posts its own)."""
    with open(_installed["plans"] + str(number), "rb") as f:
        fn, cols, ctx = pickle.load(f)
    _installed["fn"] = pickle.loads(fn)
    _installed["row"] = Row(*cols)
    _installed["number"] = number
    _context.value = ctx


def _run_row(item: tuple[int, tuple[Any, ...]]) -> Any:
    """Run the task's function on one row: (plan number, the row's values)."""
    if item[0] != _installed["number"]:
        _load(item[0])
    return _installed["fn"](_installed["row"](*item[1]))


def _run_identified_row(item: tuple[int, tuple[Any, ...], str]) -> Any:
    """Run the task's function on one row of a stream, with its row id in the context."""
    number, values, row_id = item
    if number != _installed["number"]:
        _load(number)
    base = _context.value
    _context.value = base._replace(row_id=row_id)
    try:
        return _installed["fn"](_installed["row"](*values))
    finally:
        _context.value = base
