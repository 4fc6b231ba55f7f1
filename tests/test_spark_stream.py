"""process_keyed_stream on a local[2] SparkSession: order within and across micro-batches,
stable row ids, and effects exactly once across a killed driver and a killed Python worker.

The effect of every row is an insert into a ledger (sqlite) whose primary key is the row
id that task_context() gives: an effect idempotent by row id, so "exactly once" means
every input row has exactly one ledger entry (a row id that changed between two runs of a
row would show as two). Every run of a row is also appended to a log, which shows that
rows did run more than once (at-least-once execution).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter, defaultdict
from typing import Any

import pytest
from pyspark.sql import SparkSession

from shmchan import spark as ss
from tests.procs import child_env, run_shmchan
from tests.test_spark import shared_session

pytestmark = pytest.mark.timeout(600)

SCHEMA = "n long, keys array<string>"
KEYS = 4


@pytest.fixture(scope="module")
def spark(pytestconfig: pytest.Config) -> SparkSession:
    return shared_session(pytestconfig)  # the run's session, shared with test_spark.py


# --------------------------------------------------------------------------- helpers


def rows_of(first: int, count: int) -> list[dict[str, Any]]:
    """Rows n = first..first+count-1: one key, or two for every fifth row (links keys)."""
    out = []
    for n in range(first, first + count):
        keys = [f"k{n % KEYS}"]
        if n % 5 == 0:
            keys.append(f"k{(n + 1) % KEYS}")
        out.append({"n": n, "keys": keys})
    return out


def land(directory: str, name: str, rows: list[dict[str, Any]]) -> None:
    """Write a JSON-lines file into the watched directory atomically (rename)."""
    tmp = os.path.join(os.path.dirname(directory), f".{name}.tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.rename(tmp, os.path.join(directory, name))
    time.sleep(0.02)  # the file source takes files oldest first: give each its own mtime


class Ledger:
    """fn: log the run, then record the row's effect once under its row id (sqlite)."""

    def __init__(self, directory: str, pause: float = 0.0, kill_worker_at: int = -1) -> None:
        self.directory = directory
        self.pause = pause
        self.kill_worker_at = kill_worker_at

    @property
    def db(self) -> str:
        return os.path.join(self.directory, "ledger.db")

    def create(self) -> None:
        with sqlite3.connect(self.db) as con:
            con.execute("PRAGMA journal_mode=WAL")
            con.execute(
                "CREATE TABLE ledger (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                "row_id TEXT UNIQUE NOT NULL, n INTEGER, keys TEXT, batch_id INTEGER)"
            )

    def __call__(self, row: Any) -> str:
        ctx = ss.task_context()
        with open(os.path.join(self.directory, "runs"), "a") as f:
            f.write(f"{row.n} {ctx.batch_id} {ctx.row_id} {os.getpid()}\n")
        if row.n == self.kill_worker_at:
            marker = os.path.join(self.directory, "killed")
            if not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getppid(), signal.SIGKILL)  # the Spark task's Python worker
                time.sleep(30)
        time.sleep(self.pause)
        con = sqlite3.connect(self.db, timeout=60)
        try:
            with con:  # one transaction: the effect and its row id together
                con.execute(
                    "INSERT OR IGNORE INTO ledger (row_id, n, keys, batch_id) VALUES (?, ?, ?, ?)",
                    (ctx.row_id, row.n, ",".join(row.keys), ctx.batch_id),
                )
        finally:
            con.close()
        return str(ctx.row_id)

    def entries(self) -> list[tuple[int, str, int, str, int]]:
        with sqlite3.connect(self.db) as con:
            return con.execute("SELECT seq, row_id, n, keys, batch_id FROM ledger").fetchall()

    def runs(self) -> Counter[int]:
        path = os.path.join(self.directory, "runs")
        if not os.path.exists(path):
            return Counter()
        with open(path) as f:
            return Counter(int(line.split()[0]) for line in f if line.strip())


def assert_exactly_once_in_key_order(ledger: Ledger, total: int) -> None:
    entries = ledger.entries()
    assert sorted(n for _, _, n, _, _ in entries) == list(range(total)), "lost or doubled"
    per_key: dict[str, list[int]] = defaultdict(list)
    for _, _, n, keys, _ in sorted(entries):
        for k in keys.split(","):
            per_key[k].append(n)
    for k, ns in per_key.items():
        assert ns == sorted(ns), f"rows of {k} took effect out of order"


def reader(spark: SparkSession, watched: str) -> Any:
    return spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(watched)


# --------------------------------------------------------------------------- in-process


def test_batches_run_in_key_order_and_the_path_sink_holds_each_row_once(
    spark: SparkSession, tmp_path: Any
) -> None:
    watched = tmp_path / "in"
    watched.mkdir()
    for i in range(3):
        land(str(watched), f"part-{i}.json", rows_of(20 * i, 20))
    ledger = Ledger(str(tmp_path))
    ledger.create()
    out = str(tmp_path / "out")
    query = ss.process_keyed_stream(
        reader(spark, str(watched)),
        "keys",
        ledger,
        "n",
        checkpoint=str(tmp_path / "ckpt"),
        sink=out,
        trigger={"availableNow": True},
    )
    assert query.awaitTermination(180), "the availableNow query did not finish"
    assert query.exception() is None
    assert_exactly_once_in_key_order(ledger, 60)
    by_n = {n: (row_id, batch) for _, row_id, n, _, batch in ledger.entries()}
    assert {batch for _, batch in by_n.values()} == {0, 1, 2}  # a file per micro-batch
    # every row of batch N took effect before any row of batch N+1
    seqs = sorted(ledger.entries())
    assert [b for _, _, _, _, b in seqs] == sorted(b for _, _, _, _, b in seqs)

    written = spark.read.parquet(out).collect()
    assert sorted(r.n for r in written) == list(range(60))
    assert {r.n: (r.row_id, r.batch_id) for r in written} == by_n
    assert all(r.result == r.row_id and r.attempt == 1 for r in written)


def test_a_callback_sink_and_an_identity_column(spark: SparkSession, tmp_path: Any) -> None:
    got: list[tuple[int, list[tuple[int, str, str]]]] = []

    def sink(df: Any, batch_id: int) -> None:
        got.append((batch_id, sorted((r.n, r.row_id, r.result) for r in df.collect())))

    stream = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", 50)
        .option("numPartitions", 2)
        .load()
        .selectExpr("value AS n", "array(concat('k', value % 3)) AS keys")
    )
    query = ss.process_keyed_stream(
        stream,
        "keys",
        lambda row: f"{ss.task_context().batch_id}:{row.n}",
        "n",
        checkpoint=str(tmp_path / "ckpt"),
        sink=sink,
        id_col="n",
        trigger="1 second",
    )
    try:
        deadline = time.monotonic() + 120
        while sum(len(rows) for _, rows in got) < 40:
            assert query.exception() is None, query.exception()
            assert time.monotonic() < deadline, "the rate stream produced too few rows"
            time.sleep(0.5)
    finally:
        query.stop()
    for batch_id, rows in got:
        for n, row_id, result in rows:
            assert row_id == str(n)  # the identity column is the row id
            assert result == f"{batch_id}:{n}"  # task_context().batch_id in fn
    ns = [n for _, rows in got for n, _, _ in rows]
    assert len(ns) == len(set(ns))


def test_bad_arguments_are_refused_at_once(spark: SparkSession, tmp_path: Any) -> None:
    batch = spark.createDataFrame([(1, ["a"])], SCHEMA)
    with pytest.raises(TypeError, match="process_keyed"):
        ss.process_keyed_stream(batch, "keys", str, "n", checkpoint="c", sink="s")
    watched = tmp_path / "in"
    watched.mkdir()
    stream = reader(spark, str(watched))
    common: dict[str, Any] = {"checkpoint": str(tmp_path / "c"), "sink": str(tmp_path / "s")}
    with pytest.raises(ss.ColumnError, match="nope"):
        ss.process_keyed_stream(stream, "nope", str, "n", **common)
    with pytest.raises(ss.ColumnError, match="nope"):
        ss.process_keyed_stream(stream, "keys", str, "n", id_col="nope", **common)
    with pytest.raises(ValueError, match="continuous"):
        ss.process_keyed_stream(
            stream, "keys", str, "n", trigger={"continuous": "1 second"}, **common
        )
    with pytest.raises(TypeError, match="sink"):
        ss.process_keyed_stream(stream, "keys", str, "n", checkpoint="c", sink=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="workers_per_task"):
        ss.process_keyed_stream(stream, "keys", str, "n", workers_per_task=0, **common)


def test_a_killed_python_worker_mid_batch_still_gives_each_effect_once(
    spark: SparkSession, tmp_path: Any
) -> None:
    """fn kills its Spark task's Python worker once, mid-batch: the batch fails and with it
    the query; restarted from the checkpoint, the batch runs again (rows that had already
    run run twice) and every row's effect is in the ledger once, in key order."""
    watched = tmp_path / "in"
    watched.mkdir()
    for i in range(2):
        land(str(watched), f"part-{i}.json", rows_of(24 * i, 24))
    ledger = Ledger(str(tmp_path), kill_worker_at=36)  # in the second batch
    ledger.create()

    def start() -> Any:
        return ss.process_keyed_stream(
            reader(spark, str(watched)),
            "keys",
            ledger,
            "n",
            checkpoint=str(tmp_path / "ckpt"),
            sink=str(tmp_path / "out"),
            trigger={"availableNow": True},
            workers_per_task=2,
        )

    query = start()
    with pytest.raises(Exception, match="(?i)python worker|crash|exited"):
        query.awaitTermination(180)
    assert (tmp_path / "killed").exists()
    first = ledger.runs()
    assert 24 <= len(first) < 48, "the kill should come in the middle of the second batch"

    query = start()
    assert query.awaitTermination(180), "the restarted query did not finish"
    assert query.exception() is None
    assert_exactly_once_in_key_order(ledger, 48)
    runs = ledger.runs()
    assert runs[36] == 2  # the killed row ran again; its effect is in the ledger once
    assert all(runs[n] == 1 for n in range(24))  # batch 0 was committed: not run again
    written = spark.read.parquet(str(tmp_path / "out")).collect()
    assert sorted(r.n for r in written) == list(range(48))


# --------------------------------------------------------------------------- demo


def test_the_streaming_demo_matches_its_serial_replay(
    spark: SparkSession, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from shmchan import demo
    from shmchan.spark import demo as spark_demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--spark", "--stream", "--messages", "300", "--accounts", "30"])
    assert spark_demo.run_stream(args, spark=spark) == 0
    out = capsys.readouterr().out
    assert "OK: every decision and the final balances equal the serial replay" in out
    assert "in 10 files" in out
    assert re.search(r"batch +\d+: +\d+ rows in +[\d.]+ s", out), out


def test_demo_stream_needs_spark() -> None:
    out = run_shmchan("demo", "--stream", timeout=60)
    assert out.returncode == 2 and "--spark" in out.stderr


# --------------------------------------------------------------------------- killed driver


def stream_job(directory: str) -> None:
    """The driver of test_a_killed_driver...: runs the query until its input is done."""
    spark = ss.session("shmchan-stream-driver", master="local[2]")
    watched = os.path.join(directory, "in")
    query = ss.process_keyed_stream(
        reader(spark, watched),
        "keys",
        Ledger(directory, pause=0.08),
        "n",
        checkpoint=os.path.join(directory, "ckpt"),
        sink=os.path.join(directory, "out"),
        trigger={"availableNow": True},
        workers_per_task=4,
    )
    query.awaitTermination()
    if query.exception() is not None:
        raise SystemExit(f"query failed: {query.exception()}")
    print("done", flush=True)
    ss.stop(spark)


def _start_driver(directory: str) -> subprocess.Popen[str]:
    code = "import sys; from tests.test_spark_stream import stream_job; stream_job(sys.argv[1])"
    return subprocess.Popen(
        [sys.executable, "-c", code, directory],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the JVM and workers die with it
    )


def test_a_killed_driver_mid_batch_still_gives_each_effect_once(tmp_path: Any) -> None:
    """SIGKILL the query's driver (with its JVM and workers, as a lost machine) while a
    batch is half done; the restarted query re-runs that batch from the checkpoint, and
    every row's effect is in the ledger exactly once, in key order."""
    directory = str(tmp_path)
    watched = tmp_path / "in"
    watched.mkdir()
    per_file, files = 32, 3
    for i in range(files):
        land(str(watched), f"part-{i}.json", rows_of(per_file * i, per_file))
    ledger = Ledger(directory)
    ledger.create()
    total = per_file * files

    driver = _start_driver(directory)
    try:
        deadline = time.monotonic() + 240
        while True:  # wait until the second batch is partly done
            done = [n for _, _, n, _, _ in ledger.entries()]
            if sum(per_file <= n < 2 * per_file for n in done) >= 4:
                break
            assert driver.poll() is None, driver.communicate()[0]
            assert time.monotonic() < deadline, "the driver never reached its second batch"
            time.sleep(0.05)
        os.killpg(driver.pid, signal.SIGKILL)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(30)
    before = ledger.runs()
    assert len(before) < total, "the kill came too late: every row had run"

    again = _start_driver(directory)
    try:
        output, _ = again.communicate(timeout=240)
    finally:
        if again.poll() is None:
            os.killpg(again.pid, signal.SIGKILL)
            again.wait(30)
    assert again.returncode == 0 and "done" in output, output
    assert_exactly_once_in_key_order(ledger, total)
    runs = ledger.runs()
    assert any(runs[n] > 1 for n in range(per_file, 2 * per_file)), (
        "the interrupted batch should have run again"
    )
    assert all(runs[n] == 1 for n in range(per_file))  # the committed batch did not
