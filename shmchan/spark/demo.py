"""`python -m shmchan demo --spark`: bank transfers processed on Spark equal a serial replay.

The transfers dataset is built with Spark: accounts grouped in branches of ten, transfers
between two accounts of a branch (the row's keys are both accounts), deposits and
withdrawals on one account, with the overdraft rule of the channel demo (shmchan.bank.apply),
so the outcome depends on the order. `partition_by_keys` puts every branch's rows in one
partition in id order; `process_keyed` applies each row to balances kept in one file per
account, from the KeyedExecutor workers of each Spark task, with no lock of their own.
The demo then replays the rows one at a time in id order and checks every decision and
the final balances, and prints rows/s, the components, the largest one, the rounds and
the time of each stage. With --stream the rows land as files in a watched directory and
process_keyed_stream applies them micro-batch by micro-batch (run_stream).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from pyspark.sql import Row, SparkSession
from pyspark.sql.streaming.listener import StreamingQueryProgress

from .. import bank
from .keyed import process_keyed
from .keygraph import partition_by_keys
from .session import session, stop
from .stream import process_keyed_stream

__all__ = ["run", "run_stream", "BRANCH"]

BRANCH = 10  # accounts per branch: transfers stay within a branch
SCHEMA = "id long, kind string, src int, dst int, amount int, keys array<string>"

EXIT_OK = 0
EXIT_MISMATCH = 1


def _rows(seed: int, accounts: int, ids: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
    """The operations with these ids (ints, or rows with an `id`): deterministic for a
    seed, whatever the partitioning."""
    for r in ids:
        i = int(getattr(r, "id", r))
        rng = random.Random(seed * 1_000_003 + i)
        amount = rng.randint(1, bank.MAX_AMOUNT)
        a = rng.randrange(accounts)
        lo = a - a % BRANCH
        size = min(BRANCH, accounts - lo)
        draw = rng.random()
        if draw < 0.8 and size > 1:
            b = lo + (a - lo + rng.randrange(1, size)) % size  # another account of a's branch
            yield (i, bank.TRANSFER, a, b, amount, [f"acct:{a}", f"acct:{b}"])
        elif draw < 0.9:
            yield (i, bank.DEPOSIT, a, -1, amount // 2 + 1, [f"acct:{a}"])
        else:
            yield (i, bank.WITHDRAW, a, -1, amount, [f"acct:{a}"])


class FileBalances:
    """Balances in one file per account, indexable like a list (what bank.apply needs)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def _path(self, account: int) -> str:
        return os.path.join(self.directory, f"acct-{account}")

    def __getitem__(self, account: int) -> int:
        with open(self._path(account)) as f:
            return int(f.read())

    def __setitem__(self, account: int, value: int) -> None:
        with open(self._path(account), "w") as f:
            f.write(str(value))

    def reset(self, accounts: int) -> None:
        for a in range(accounts):
            self[a] = bank.INITIAL_BALANCE


class Apply:
    """process_keyed's fn: apply one row's operation to the file balances; True if accepted."""

    def __init__(self, directory: str) -> None:
        self.balances = FileBalances(directory)

    def __call__(self, row: Row) -> bool:
        op = (row.kind, row.src, row.dst, row.amount, 0, row.id)
        return bank.apply(self.balances, op)  # type: ignore[arg-type]  # uses [] and []= only


def run(args: argparse.Namespace, spark: SparkSession | None = None) -> int:
    """Run the Spark demo with the channel demo's parsed options (--messages, --accounts,
    --workers, --seed); return the exit code. Without `spark`, it starts `session()` (the
    master from SPARK_MASTER, default local[*]) and stops it at the end."""
    n, accounts, workers, seed = args.messages, args.accounts, args.workers, args.seed
    stages: list[tuple[str, float]] = []
    clock = time.perf_counter()

    def stage(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        stages.append((name, now - clock))
        clock = now

    print(
        f"shmchan demo --spark: {n} transfers/deposits/withdrawals, {accounts} accounts in "
        f"branches of {BRANCH}, {workers} workers per Spark task"
    )
    directory = tempfile.mkdtemp(prefix="shmchan-spark-demo-")
    own = spark is None
    if spark is None:
        spark = session("shmchan-demo")
    try:
        print(f"spark:      {spark.version}, master {spark.sparkContext.master}", flush=True)
        stage("start Spark")
        ids = spark.range(n).rdd.mapPartitions(lambda it: _rows(seed, accounts, it))
        df = spark.createDataFrame(ids, SCHEMA).cache()
        df.count()
        stage("build the dataset")

        parts = partition_by_keys(df, "keys", "id").cache()
        sizes = [r["count"] for r in parts.groupBy("component").count().collect()]
        info = parts.components_info
        stage("partition by keys")

        FileBalances(directory).reset(accounts)
        out = process_keyed(
            parts, "keys", Apply(directory), "id", result_type="boolean", workers_per_task=workers
        )
        got = {r.id: r.result for r in out.select("id", "result").collect()}
        stage("process_keyed")
        processing = stages[-1][1]

        ops = sorted(df.collect(), key=lambda r: r.id)
        expected_balances, expected = bank.replay(
            ((r.id, (r.kind, r.src, r.dst, r.amount, 0, r.id)) for r in ops), accounts
        )
        balances = [FileBalances(directory)[a] for a in range(accounts)]
        problems = bank.compare(expected_balances, expected, balances, got)
        if len(got) != n:
            problems.append(f"{len(got)} results for {n} rows")
        stage("serial replay + check")
    finally:
        if own:
            stop(spark)
        shutil.rmtree(directory, ignore_errors=True)

    accepted = sum(got.values())
    print(f"rows:       {n} (accepted {accepted}, rejected {n - accepted})")
    print(
        f"components: {len(sizes)}, the largest {max(sizes, default=0)} rows "
        f"({info.method}/{info.algorithm}: {info.rounds} rounds, {info.edges} edges, "
        f"{info.seconds:.2f} s)"
    )
    print(f"throughput: {n / max(processing, 1e-9):,.0f} rows/s in process_keyed")
    for name, seconds in stages:
        print(f"  {name:<22} {seconds:8.2f} s")
    return _verdict(problems, "the Spark result")


def _verdict(problems: list[str], what: str) -> int:
    """Print whether `what` equals the serial replay; return the exit code."""
    if problems:
        print(f"MISMATCH: {what} differs from the serial replay in id order:")
        for p in problems:
            print(f"  {p}")
        return EXIT_MISMATCH
    print("OK: every decision and the final balances equal the serial replay in id order")
    return EXIT_OK


STREAM_FILES = 10  # the transfers land in the watched directory as this many files


def run_stream(args: argparse.Namespace, spark: SparkSession | None = None) -> int:
    """`demo --spark --stream`: the same transfers, landing as JSON files in a directory
    that a Structured Streaming query watches; process_keyed_stream applies each
    micro-batch while the files arrive. Prints each micro-batch (rows, latency), then
    checks every decision and the final balances against a serial replay in id order."""
    n, accounts, workers, seed = args.messages, args.accounts, args.workers, args.seed
    per_file = -(-n // STREAM_FILES)
    print(
        f"shmchan demo --spark --stream: {n} transfers/deposits/withdrawals in "
        f"{STREAM_FILES} files, {accounts} accounts in branches of {BRANCH}, "
        f"{workers} workers per Spark task"
    )
    scratch = tempfile.mkdtemp(prefix="shmchan-spark-stream-demo-")
    watched = os.path.join(scratch, "in")
    balances_dir = os.path.join(scratch, "balances")
    os.mkdir(watched)
    os.mkdir(balances_dir)
    FileBalances(balances_dir).reset(accounts)
    ops = list(_rows(seed, accounts, range(n)))
    got: dict[int, bool] = {}
    own = spark is None
    query = None
    feeder = None
    try:
        if spark is None:
            spark = session("shmchan-demo-stream")
        print(f"spark:      {spark.version}, master {spark.sparkContext.master}", flush=True)

        def sink(df: Any, batch_id: int) -> None:
            got.update((r.id, r.result) for r in df.select("id", "result").collect())

        stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 2).json(watched)
        query = process_keyed_stream(
            stream,
            "keys",
            Apply(balances_dir),
            "id",
            checkpoint=os.path.join(scratch, "checkpoint"),
            sink=sink,
            result_type="boolean",
            workers_per_task=workers,
        )
        feeder = threading.Thread(
            target=_feed, args=(watched, ops, per_file), name="feeder", daemon=True
        )
        started = time.perf_counter()
        feeder.start()
        deadline = time.monotonic() + max(args.timeout, 300.0)
        shown = 0
        while len(got) < n:
            if query.exception() is not None:
                print(f"FAILED: the query stopped: {query.exception()}")
                return EXIT_MISMATCH
            if time.monotonic() > deadline:
                print(f"FAILED: {len(got)} of {n} rows processed before the timeout")
                return EXIT_MISMATCH
            shown = _show_progress(query.recentProgress, shown)
            time.sleep(0.2)
        elapsed = time.perf_counter() - started
        _show_progress(query.recentProgress, shown)
    finally:
        if query is not None:
            query.stop()
        if feeder is not None:
            feeder.join(30)
        if own and spark is not None:
            stop(spark)
        balances = [FileBalances(balances_dir)[a] for a in range(accounts)]
        shutil.rmtree(scratch, ignore_errors=True)

    expected_balances, expected = bank.replay(
        ((op[0], (op[1], op[2], op[3], op[4], 0, op[0])) for op in ops), accounts
    )
    problems = bank.compare(expected_balances, expected, balances, got)
    accepted = sum(got.values())
    print(f"rows:       {n} (accepted {accepted}, rejected {n - accepted})")
    print(f"throughput: {n / max(elapsed, 1e-9):,.0f} rows/s from the first file to the last row")
    return _verdict(problems, "the streamed result")


def _feed(directory: str, ops: list[tuple[Any, ...]], per_file: int) -> None:
    """Land the operations as JSON-lines files, in id order, one every 0.3 s; each is
    written beside the directory and renamed into it, so the query sees it whole."""
    fields = ("id", "kind", "src", "dst", "amount", "keys")
    for i in range(0, len(ops), per_file):
        tmp = os.path.join(os.path.dirname(directory), f".transfers-{i:09d}.json")
        with open(tmp, "w") as f:
            for op in ops[i : i + per_file]:
                f.write(json.dumps(dict(zip(fields, op, strict=True))) + "\n")
        os.rename(tmp, os.path.join(directory, f"transfers-{i:09d}.json"))
        time.sleep(0.3)


def _show_progress(progress: Sequence[StreamingQueryProgress], shown: int) -> int:
    """Print the micro-batches finished since `shown` (their batch ids); return the new mark."""
    for p in progress:
        batch, rows = int(p.batchId), int(p.numInputRows)
        if batch < shown or rows == 0:
            continue
        ms = p.durationMs.get("triggerExecution", 0)
        print(f"  batch {batch:>3}: {rows:>6} rows in {ms / 1000:6.2f} s", flush=True)
        shown = batch + 1
    return shown
