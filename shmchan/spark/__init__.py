"""shmchan.spark: the channel's promise on Apache Spark, through PySpark (the `[spark]` extra).

Rows that share a key never run at the same time, and run in order, past one machine:

    from shmchan import spark as ss

    spark = ss.session()                                   # offline local[*], loopback only
    parts = ss.partition_by_keys(df, "keys", "ts")         # + a `component` column
    out = ss.process_keyed(df, "keys", fn, "ts", result_type="boolean")
    query = ss.process_keyed_stream(stream_df, "keys", fn, "ts",      # every micro-batch
                                    checkpoint="/data/ckpt", sink="/data/out")
    ss.send_partitions(df, "orders", "keys", "payload")    # Spark tasks as channel producers

`partition_by_keys` computes the connected components of the key graph (shmchan/spark/
keygraph.py); `process_keyed` runs each partition through a KeyedExecutor (keyed.py);
`process_keyed_stream` does it for every micro-batch of a Structured Streaming query
(stream.py); `send_partitions` makes Spark tasks producers into a node-local channel
(producers.py). Processing is at-least-once across Spark task retries; on a stream,
`task_context().row_id` makes effects exactly-once for a function idempotent by it.
"""

try:
    import pyspark as _pyspark  # noqa: F401 - only to fail early with a useful message
except ImportError as _missing:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "shmchan.spark needs PySpark, which comes with the 'spark' extra: "
        "pip install 'shmchan[spark]' (and Java 17 or newer)",
        name="pyspark",
    ) from _missing

from .errors import ColumnError
from .keyed import TaskContext, process_keyed, task_context
from .keygraph import DRIVER_THRESHOLD, Components, ComponentsInfo, components, partition_by_keys
from .producers import send_partitions
from .session import session, stop
from .stream import Sink, process_keyed_stream

__all__ = [
    "session",
    "stop",
    "partition_by_keys",
    "components",
    "Components",
    "ComponentsInfo",
    "process_keyed",
    "process_keyed_stream",
    "Sink",
    "task_context",
    "TaskContext",
    "DRIVER_THRESHOLD",
    "send_partitions",
    "ColumnError",
]
