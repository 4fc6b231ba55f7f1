"""Spark tasks as producers into a node-local channel (`send_partitions`).

Each Spark task opens the channel by name on the node it runs on and sends its rows in
batches (`Sender.send_many`). The channel's producer-crash guarantees are what make a task
that Spark kills mid-partition harmless: a batch it was sending is delivered whole or not
at all, its reservations are reclaimed, and the consumer never waits for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from pyspark.sql import DataFrame, Row

from ..channel import Channel, Sender
from .errors import ColumnError
from .keygraph import key_ids

__all__ = ["send_partitions"]

BATCH = 256  # rows per send_many call


def send_partitions(
    df: DataFrame,
    channel_name: str,
    keys_col: str,
    payload_col: str,
    *,
    timeout: float | None = None,
) -> int:
    """Send every row of `df` into the channel `channel_name` on the node its task runs on:
    `payload_col`'s value as the payload (bytes travel raw, anything else is pickled) and
    `keys_col`'s key, or array of keys, as the message's keys. Returns the number of rows
    sent by the tasks that succeeded.

    The channel must exist on every node that runs a task (with a consumer serving it, or
    enough room); its `max_keys` must fit the widest row. Each send waits at most `timeout`
    seconds for room (`shmchan.Full` then fails the task; None waits as long as it takes).
    Every row is sent once per successful task. A task that fails or is killed after
    sending some of its rows leaves those rows in the channel (each whole), and Spark's
    retry of that task sends them again: downstream, expect at-least-once and deduplicate
    on something in the payload if that matters.
    """
    for c in (keys_col, payload_col):
        if c not in df.columns:
            raise ColumnError(f"no column {c!r} (columns: {', '.join(df.columns)})")
    key_ids(df, keys_col)  # refuses a keys column of an unusable type, here and now
    spark = df.sparkSession
    if (spark.sparkContext.master or "").startswith("local"):
        Channel.open(channel_name).close()  # ChannelNotFound now rather than in every task
    sent = spark.sparkContext.accumulator(0)
    rows = df.select(df[keys_col].alias("k"), df[payload_col].alias("p"))

    def send_partition(it: Iterator[Row]) -> None:
        sent.add(send_rows(channel_name, ((row.k, row.p) for row in it), timeout))

    rows.foreachPartition(send_partition)
    return int(sent.value)


def send_rows(
    channel_name: str, rows: Iterable[tuple[Any, Any]], timeout: float | None = None
) -> int:
    """Send `(keys, payload)` pairs into `channel_name` in batches; return how many.

    (This is what each Spark task of `send_partitions` runs.)
    """
    tx = Sender.open(channel_name)
    count = 0
    try:
        batch: list[tuple[object, tuple[Any, ...]]] = []
        for keys, payload in rows:
            batch.append((_payload(payload), message_keys(keys)))
            if len(batch) == BATCH:
                tx.send_many(batch, timeout=timeout)
                count += len(batch)
                batch.clear()
        if batch:
            tx.send_many(batch, timeout=timeout)
            count += len(batch)
    finally:
        tx.close()
    return count


def message_keys(keys: Any) -> tuple[Any, ...]:
    """A row's key value (one key, a list of keys, or None) as a message's keys."""
    if keys is None:
        return ()
    if isinstance(keys, list | tuple):
        return tuple(bytes(k) if isinstance(k, bytearray) else k for k in keys if k is not None)
    return (bytes(keys) if isinstance(keys, bytearray) else keys,)


def _payload(value: Any) -> object:
    return bytes(value) if isinstance(value, bytearray) else value
