"""A Spark batch with the fifo guarantee: transfers applied in order per account.

200 transfers between 20 accounts, each keyed by the two accounts it touches, run through
`shmchan.spark.process_keyed` on an offline local session: rows that share an account
never run at the same time and run in `id` order, while the others run in parallel. Each
row's function returns the transfer's position among its source account's transfers,
which depends on the order; the result is checked against a serial replay.

Run it with `python examples/spark_batch.py` (needs `pip install '.[spark]'` and Java 17+).
"""

import os
import sys
import tempfile

from shmchan import spark as ss

COUNTERS = os.path.join(tempfile.gettempdir(), f"spark-batch-{os.getpid()}")


def apply(row) -> int:  # type: ignore[no-untyped-def]
    """Counts the transfers seen from row.src so far, in a file per account. Without the
    fifo guarantee two rows of one account could interleave and lose a count."""
    path = os.path.join(COUNTERS, str(row.src))
    seen = int(open(path).read()) if os.path.exists(path) else 0
    with open(path, "w") as f:
        f.write(str(seen + 1))
    return seen


def main() -> int:
    os.makedirs(COUNTERS, exist_ok=True)
    rows = [
        (i, i % 20, (i * 7 + 3) % 20, [f"acct:{i % 20}", f"acct:{(i * 7 + 3) % 20}"])
        for i in range(200)
    ]
    spark = ss.session("shmchan-example", master="local[2]")
    try:
        df = spark.createDataFrame(rows, "id long, src int, dst int, keys array<string>")
        out = ss.process_keyed(df, "keys", apply, "id", result_type="int", workers_per_task=2)
        got = {r.id: r.result for r in out.collect()}
    finally:
        ss.stop(spark)
    expected, seen = {}, {}
    for i, src, _dst, _keys in rows:  # the serial replay, in id order
        expected[i] = seen.get(src, 0)
        seen[src] = expected[i] + 1
    print(f"{len(got)} rows; same as the serial replay: {got == expected}")
    for name in os.listdir(COUNTERS):
        os.unlink(os.path.join(COUNTERS, name))
    os.rmdir(COUNTERS)
    return 0 if got == expected else 1


if __name__ == "__main__":
    sys.exit(main())
