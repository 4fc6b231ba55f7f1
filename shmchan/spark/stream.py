"""process_keyed_stream: process_keyed on every micro-batch of a Structured Streaming query.

Data flow of one query:

    source (files, rate, Kafka, ...) --readStream--> micro-batch N (Spark's batchId)
        |  foreachBatch, on the driver, one batch at a time, in batchId order
        v
    the batch's rows + a stable row id (RowIds: an identity column, or a hash of the
    row's values and a count of identical rows)
        |  partition_by_keys + one KeyedExecutor per Spark task, as process_keyed
        v
    result rows (input columns, result, attempt, batch_id, row_id), persisted once
        |  the sink: `<path>/batch_id=N` overwritten, or the user's callback(df, N)
        v
    the handler returns; Spark writes batch N to the checkpoint's commit log

Order. Within a batch, process_keyed's promise: rows sharing a key (transitively) never
run at once and run in `order_col` order. Across batches: foreachBatch calls the handler
for batch N+1 only after the handler of batch N returned, and the handler returns only
after every row of N ran, so all of batch N's rows of a key run before batch N+1's.

Failures. Spark re-runs a batch whose commit it did not write: after a driver crash or
restart (from the offsets logged in the checkpoint: the same input rows), and a task's
rows when the task fails (a retry, or the query fails and is restarted). A row may
therefore run more than once: execution is at-least-once. Its `row_id` and `batch_id`
are the same on every run, so an effect that `fn` records under the row id (an insert
that ignores a row id it already has, done in the same transaction as the effect) takes
place once: effects are exactly-once for an `fn` idempotent by row id. The path sink
overwrites the directory of batch N, so it too holds each row once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark import StorageLevel
from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.types import DataType

from .errors import ColumnError
from .keyed import (
    ATTEMPT,
    BATCH_ID,
    RESULT,
    ROW_ID,
    Plan,
    check_options,
    dump_function,
    partition_rows,
    run_plan,
)

__all__ = ["process_keyed_stream", "Sink"]

Sink = str | Callable[[DataFrame, int], None]
"""Where the result rows of each micro-batch go: a directory (written as
`<path>/batch_id=<N>` in `sink_format`, overwritten when a batch runs again), or a
callable `(result_df, batch_id)`, as foreachBatch's function."""

_H64 = "__shmchan_h64"
_H32 = "__shmchan_h32"


def process_keyed_stream(
    stream_df: DataFrame,
    keys_col: str,
    fn: Callable[[Row], Any],
    order_col: str | Sequence[str],
    *,
    checkpoint: str,
    sink: Sink,
    trigger: str | dict[str, Any] | None = None,
    id_col: str | None = None,
    result_type: str | DataType = "string",
    workers_per_task: int = 4,
    max_attempts: int = 3,
    task_timeout: float | None = None,
    num_partitions: int | None = None,
    sink_format: str = "parquet",
    query_name: str | None = None,
) -> StreamingQuery:
    """Start a streaming query that runs `fn(row)` on every row of `stream_df` with
    shmchan's fifo promise, micro-batch after micro-batch, and writes the results to `sink`.

    `stream_df` is a streaming DataFrame (`spark.readStream...`). Each micro-batch runs as
    `process_keyed(batch, keys_col, fn, order_col, ...)` (same options, same promise):
    rows sharing a key, directly or transitively, never run at the same time and run in
    `order_col` order; and every row of batch N runs before any row of batch N+1.

    `checkpoint`: the query's checkpoint directory (required: it is what makes a restart
    carry on where the query stopped). `trigger`: None (the next batch as soon as the last
    one is done), a processing-time interval such as "10 seconds", or a dict of
    `DataStreamWriter.trigger` arguments (`{"availableNow": True}` processes what is
    there and stops; continuous triggers cannot run foreachBatch and are refused).

    `sink`: a directory path, written as `<path>/batch_id=<N>` in `sink_format` (read it
    back with `spark.read.parquet(path)`, which gives `batch_id` from the directory names),
    or a callable `(result_df, batch_id)`. The result rows hold `stream_df`'s columns,
    `result` (of `result_type`), `attempt`, `batch_id` and `row_id`. `fn` runs once per
    row per run of the batch, before the sink is called (the rows are persisted, so a
    callback may act on them more than once); a callback must commit by batch id (replace
    what an earlier run of the same batch wrote) for the sink to hold each row once.

    Row identity: inside `fn`, `task_context()` gives the row's `batch_id` and `row_id`.
    With `id_col`, the row id is that column's value as a string (it must be unique in the
    stream); otherwise it is "<batch>-<hash of the row's values>-<n>", n counting identical
    rows of the batch, so it is stable as long as the source replays a batch with the
    same values (Spark's file, rate and Kafka sources do; a column computed with
    `current_timestamp()` or `rand()` does not: name an `id_col` then).

    Guarantees: execution is at-least-once (a row runs again when its Spark task is
    retried or the query restarts before committing its batch); effects are exactly-once
    when `fn` makes its effect idempotent by `row_id`, e.g. an insert into a table whose
    primary key is the row id, in the same transaction as the effect.

    Returns the running `StreamingQuery` (`awaitTermination()`, `stop()`,
    `recentProgress`, `exception()`). An exception raised by `fn` fails the batch and
    the query; restart it with the same checkpoint to carry on from that batch.
    """
    if not stream_df.isStreaming:
        raise TypeError(
            "process_keyed_stream needs a streaming DataFrame (spark.readStream...); "
            "for a batch DataFrame use process_keyed"
        )
    check_options(workers_per_task, max_attempts, num_partitions, fn)
    named = [keys_col, *([order_col] if isinstance(order_col, str) else order_col)]
    for col in named + ([] if id_col is None else [id_col]):
        if col not in stream_df.columns:
            raise ColumnError(f"no column {col!r} (columns: {', '.join(stream_df.columns)})")
    for taken in (RESULT, ATTEMPT, BATCH_ID, ROW_ID, _H64, _H32):
        if taken in stream_df.columns:
            raise ColumnError(
                f"stream_df already has a column {taken!r}, which process_keyed_stream adds"
            )
    if not checkpoint:
        raise ValueError("checkpoint must name the query's checkpoint directory")
    if not (isinstance(sink, str) and sink) and not callable(sink):
        raise TypeError("sink must be a directory path or a callable (result_df, batch_id)")
    triggers = _trigger_options(trigger)

    handler = _BatchHandler(
        keys_col=keys_col,
        fn=dump_function(fn),
        order_col=order_col,
        fields=list(stream_df.schema.fields),
        id_col=id_col,
        result_type=result_type,
        workers=workers_per_task,
        max_attempts=max_attempts,
        task_timeout=task_timeout,
        num_partitions=num_partitions,
        sink=sink,
        sink_format=sink_format,
    )
    hashed = [F.col(f"`{c}`") for c in stream_df.columns]
    prepared = stream_df
    if id_col is None:
        prepared = stream_df.select(
            *hashed, F.xxhash64(*hashed).alias(_H64), F.hash(*hashed).alias(_H32)
        )
    writer = prepared.writeStream.foreachBatch(handler).option("checkpointLocation", checkpoint)
    if triggers:
        writer = writer.trigger(**triggers)
    if query_name is not None:
        writer = writer.queryName(query_name)
    return writer.start()


def _trigger_options(trigger: str | dict[str, Any] | None) -> dict[str, Any]:
    if trigger is None:
        return {}
    if isinstance(trigger, str):
        return {"processingTime": trigger}
    if isinstance(trigger, dict):
        if "continuous" in trigger:
            raise ValueError(
                "a continuous trigger cannot run foreachBatch: use processingTime, "
                "availableNow or once"
            )
        return dict(trigger)
    raise TypeError(
        f"trigger must be None, an interval such as '10 seconds' or a dict, "
        f"not {type(trigger).__name__}"
    )


@dataclass(frozen=True, kw_only=True)
class _BatchHandler:
    """foreachBatch's function: one micro-batch through process_keyed, then the sink."""

    keys_col: str
    fn: bytes
    order_col: str | Sequence[str]
    fields: list[Any]
    id_col: str | None
    result_type: str | DataType
    workers: int
    max_attempts: int
    task_timeout: float | None
    num_partitions: int | None
    sink: Sink
    sink_format: str

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        # Read once: partition_by_keys reads its input twice (key graph, then labels).
        batch = batch.persist(StorageLevel.MEMORY_AND_DISK)
        out: DataFrame | None = None
        try:
            parts, _ = partition_rows(batch, self.keys_col, self.order_col, self.num_partitions)
            plan = Plan(
                cols=[f.name for f in self.fields],
                keys_col=self.keys_col,
                fn=self.fn,
                workers=self.workers,
                max_attempts=self.max_attempts,
                task_timeout=self.task_timeout,
                batch_id=batch_id,
                id_col=self.id_col,
            )
            out = run_plan(parts, plan, self.fields, self.result_type)
            out = out.persist(StorageLevel.MEMORY_AND_DISK)
            out.count()  # runs fn on every row, once, before the sink sees the rows
            if callable(self.sink):
                self.sink(out, batch_id)
            else:
                target = f"{self.sink.rstrip('/')}/{BATCH_ID}={batch_id}"
                out.drop(BATCH_ID).write.mode("overwrite").format(self.sink_format).save(target)
        finally:
            if out is not None:
                out.unpersist()
            batch.unpersist()
