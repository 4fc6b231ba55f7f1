"""Keyed processing of a Structured Streaming query, with effects exactly once.

Files of transfers land in a directory; `process_keyed_stream` runs `apply` on every row,
micro-batch after micro-batch, with rows sharing an account never at once and in id order.
`apply` records its effect in a sqlite ledger whose primary key is the row id that
`task_context()` gives: run it again after a crash (same checkpoint) and nothing is
recorded twice. Needs the [spark] extra and Java 17+.

Run it with `python examples/spark_stream.py` (a second run carries on from the checkpoint).
"""

import json
import os
import sqlite3
import tempfile

from shmchan import spark as ss

# where the watched directory, the checkpoint, the ledger and the results go
HERE = os.environ.get("SHMCHAN_EXAMPLE_DIR") or os.path.join(
    tempfile.gettempdir(), "shmchan-example-stream"
)


class Apply:
    """The effect: a ledger line per row, inserted once whatever the number of runs."""

    def __init__(self, db: str) -> None:
        self.db = db

    def __call__(self, row: object) -> str:
        ctx = ss.task_context()  # batch_id and row_id: the same on every run of this row
        con = sqlite3.connect(self.db, timeout=60)
        try:
            with con:  # the effect and its row id in one transaction
                con.execute(
                    "INSERT OR IGNORE INTO ledger VALUES (?, ?, ?)",
                    (ctx.row_id, row.id, row.amount),  # type: ignore[attr-defined]
                )
        finally:
            con.close()
        return "recorded"


def main() -> None:
    watched = os.path.join(HERE, "in")
    os.makedirs(watched, exist_ok=True)
    db = os.path.join(HERE, "ledger.db")
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE IF NOT EXISTS ledger (row_id TEXT PRIMARY KEY, id, amount)")
    for f in range(3):  # three files of transfers between accounts 0..4
        path = os.path.join(watched, f"transfers-{f}.json")
        with open(path + ".tmp", "w") as out:
            for i in range(f * 10, f * 10 + 10):
                keys = [f"acct:{i % 5}", f"acct:{(i + 1) % 5}"]
                out.write(json.dumps({"id": i, "amount": i, "keys": keys}) + "\n")
        os.replace(path + ".tmp", path)  # whole files only: the query may be watching

    spark = ss.session("example-stream")
    stream = spark.readStream.schema("id long, amount long, keys array<string>").json(watched)
    query = ss.process_keyed_stream(
        stream,
        "keys",
        Apply(db),
        "id",
        id_col="id",  # the data has its own identity: the row id is this column
        checkpoint=os.path.join(HERE, "checkpoint"),
        sink=os.path.join(HERE, "results"),  # <path>/batch_id=N, replaced if N runs again
        trigger={"availableNow": True},  # process what is there, then stop
    )
    query.awaitTermination()
    with sqlite3.connect(db) as con:
        (rows,) = con.execute("SELECT count(*) FROM ledger").fetchone()
    print(f"ledger: {rows} rows, one per transfer; results in {HERE}/results")
    ss.stop(spark)


if __name__ == "__main__":
    main()
