"""shmchan.spark on a local[2] SparkSession (one per test run: a JVM takes seconds to start).

Components are checked against a union-find over the same rows in Python; process_keyed
against a serial replay of an order-dependent workload; send_partitions against a consumer
counting what arrives.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import threading
import time
import types
from collections import defaultdict
from typing import Any

import pytest
from pyspark.sql import SparkSession

import shmchan
from shmchan import liveness
from shmchan import spark as ss
from tests.procs import child_env

# Spark's Python workers cannot import this module (pytest put its directory on sys.path):
# process_keyed ships the functions and classes below by value (keyed._dump_function).
# A session starts in 5-30 s on a busy 2-core machine, and the first test pays for it.
pytestmark = pytest.mark.timeout(600)


def shared_session(config: pytest.Config) -> SparkSession:
    """The local[2] session of this test run, shared by the Spark test modules (each JVM
    start costs 5-30 s): started by the first module that asks, stopped when the run ends."""
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    s = ss.session("shmchan-tests", master="local[2]")
    config.add_cleanup(lambda: ss.stop(s))
    return s


@pytest.fixture(scope="module")
def spark(pytestconfig: pytest.Config) -> SparkSession:
    return shared_session(pytestconfig)


# --------------------------------------------------------------------------- helpers


def reference_components(rows: list[tuple[int, list[str]]]) -> list[set[int]]:
    """Groups of row ids that share a key, transitively: union-find in plain Python."""
    parent: dict[str, str] = {}

    def find(k: str) -> str:
        parent.setdefault(k, k)
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for _, keys in rows:
        for k in keys[1:]:
            parent[find(k)] = find(keys[0])
    groups: dict[Any, set[int]] = defaultdict(set)
    for rid, keys in rows:
        groups[find(keys[0]) if keys else ("alone", rid)].add(rid)
    return sorted(groups.values(), key=min)


def random_rows(seed: int, n: int, keys: int, chain: int) -> list[tuple[int, list[str]]]:
    """Rows with 0-3 random keys, plus a chain of `chain` rows each linking k_i to k_i+1."""
    rng = random.Random(seed)
    rows = [
        (i, [f"k{rng.randrange(keys)}" for _ in range(rng.choice((0, 1, 1, 2, 2, 3)))])
        for i in range(n)
    ]
    rows += [(n + i, [f"c{i}", f"c{i + 1}"]) for i in range(chain)]
    rng.shuffle(rows)
    return rows


def spark_components(df: Any) -> list[set[int]]:
    groups: dict[int, set[int]] = defaultdict(set)
    for r in df.select("id", "component").collect():
        groups[r.component].add(r.id)
    return sorted(groups.values(), key=min)


# --------------------------------------------------------------------------- install


def test_import_without_pyspark_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['pyspark'] = None\n"  # makes `import pyspark` fail
        "try:\n"
        "    import shmchan.spark\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    print('imported')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=child_env()
    )
    assert out.returncode == 0, out.stderr
    assert "shmchan[spark]" in out.stdout


# --------------------------------------------------------------------------- components


@pytest.mark.parametrize("path", ["spark", "driver"])
def test_components_equal_a_union_find(spark: SparkSession, path: str) -> None:
    rows = random_rows(seed=7, n=500, keys=600, chain=300)
    df = spark.createDataFrame(rows, "id long, keys array<string>")
    threshold = 0 if path == "spark" else 10**9
    out = ss.partition_by_keys(df, "keys", "id", driver_threshold=threshold)
    info = out.components_info
    assert info.method == path
    assert spark_components(out) == reference_components(rows)
    if path == "spark":
        assert 1 <= info.rounds <= 20  # the 300-row chain must not take ~300 rounds


@pytest.mark.parametrize(
    ("algorithm", "task_threshold", "rounds"),
    [("local", None, (2, 2)), ("local", 0, (2, 20)), ("stars", None, (1, 20))],
)
def test_components_algorithms_label_as_a_union_find(
    spark: SparkSession, algorithm: str, task_threshold: int | None, rounds: tuple[int, int]
) -> None:
    """Both algorithms on Spark, and the local one finished in one task or by star rounds:
    each vertex labelled with the smallest id of its component, as union-find does."""
    from shmchan.spark import keygraph

    rows = random_rows(seed=5, n=300, keys=400, chain=120)
    df = spark.createDataFrame(rows, "id long, keys array<string>").repartition(3)
    comp = ss.components(
        df, "keys", driver_threshold=0, algorithm=algorithm, task_threshold=task_threshold
    )
    assert (comp.info.method, comp.info.algorithm) == ("spark", algorithm)
    assert rounds[0] <= comp.info.rounds <= rounds[1]
    ids = df.select(keygraph.key_ids(df, "keys").alias("ids")).collect()
    edges = [(k, min(r.ids)) for r in ids for k in r.ids if k != min(r.ids)]
    want = dict(keygraph._union_find(edges))
    got = {r[0]: r[1] for r in comp.labels.collect()}
    assert got == want
    with pytest.raises(ValueError, match="algorithm"):
        ss.components(df, "keys", algorithm="nope")


def test_partitions_hold_whole_components_in_order(spark: SparkSession) -> None:
    rows = random_rows(seed=3, n=400, keys=300, chain=40)
    df = spark.createDataFrame(rows, "id long, keys array<string>")
    out = ss.partition_by_keys(df, "keys", "id", num_partitions=3)
    assert out.rdd.getNumPartitions() == 3
    parts = out.rdd.mapPartitionsWithIndex(
        lambda i, it: [(i, [(r.id, r.component) for r in it])]
    ).collect()
    where: dict[int, int] = {}
    for index, part in parts:
        ids = [rid for rid, _ in part]
        assert ids == sorted(ids)  # sorted by order_col within the partition
        for _, comp in part:
            assert where.setdefault(comp, index) == index  # a component is in one partition
    assert sum(len(p) for _, p in parts) == len(rows)


def test_single_key_and_integer_keys(spark: SparkSession) -> None:
    rows = [(i, i % 7 if i % 5 else None) for i in range(60)]
    df = spark.createDataFrame(rows, "id long, acct long")
    out = ss.partition_by_keys(df, "acct", "id")
    got = spark_components(out)
    want = reference_components([(i, [] if a is None else [str(a)]) for i, a in rows])
    assert got == want


def test_bad_columns_are_refused_at_once(spark: SparkSession) -> None:
    df = spark.createDataFrame([(1, 1.5, [1.0])], "id long, x double, xs array<double>")
    with pytest.raises(ss.ColumnError, match="no column 'nope'"):
        ss.partition_by_keys(df, "nope", "id")
    with pytest.raises(ss.ColumnError, match="keys must be"):
        ss.partition_by_keys(df, "x", "id")
    with pytest.raises(ss.ColumnError, match="keys must be"):
        ss.partition_by_keys(df, "xs", "id")
    with pytest.raises(ss.ColumnError, match="no column 'when'"):
        ss.partition_by_keys(df, "id", "when")


# --------------------------------------------------------------------------- send_partitions


def _drain(rx: Any, expected: int, limit: float) -> list[tuple[tuple[Any, ...], Any]]:
    """Receive until `expected` messages arrived (or `limit` seconds passed)."""
    got: list[tuple[tuple[Any, ...], Any]] = []
    deadline = time.monotonic() + limit
    while len(got) < expected and time.monotonic() < deadline:
        try:
            hs = rx.recv_many(256, timeout=0.2)
        except shmchan.Empty:
            continue
        for h in hs:
            got.append((h.keys, h.payload))
            h.release()
    return got


def test_send_partitions_delivers_every_row_once(spark: SparkSession, make_channel: Any) -> None:
    ch = make_channel(capacity=1 << 20, max_keys=4)
    rows = [(i, [f"k{i % 13}", f"k{(i * 7) % 13}"], f"row {i}") for i in range(3000)]
    df = spark.createDataFrame(rows, "id long, keys array<string>, body string").repartition(5)
    rx = ch.receiver()
    got: list[tuple[tuple[Any, ...], Any]] = []
    consumer = threading.Thread(target=lambda: got.extend(_drain(rx, len(rows), 120)))
    consumer.start()  # the channel holds far less than 3000 rows: senders wait for room
    try:
        sent = ss.send_partitions(df, ch.name, "keys", "body")
    finally:
        consumer.join(130)
        rx.close()
    assert sent == len(rows)
    assert sorted(p for _, p in got) == sorted(body for _, _, body in rows)
    by_body = {body: tuple(dict.fromkeys(keys)) for _, keys, body in rows}
    assert all(keys == by_body[p] for keys, p in got)


def test_send_partitions_bytes_payloads_and_single_keys(
    spark: SparkSession, make_channel: Any
) -> None:
    ch = make_channel()
    rows = [(i, i % 3 if i % 4 else None, bytes([i % 256]) * 10) for i in range(200)]
    df = spark.createDataFrame(rows, "id long, acct long, blob binary")
    assert ss.send_partitions(df, ch.name, "acct", "blob") == len(rows)
    rx = ch.receiver()
    try:
        got = _drain(rx, len(rows), 30)
    finally:
        rx.close()
    want = sorted((() if a is None else (a,), b) for _, a, b in rows)
    assert sorted(got) == want


def test_send_partitions_to_a_missing_channel_fails_at_once(spark: SparkSession) -> None:
    df = spark.createDataFrame([(1, "a", "x")], "id long, k string, p string")
    with pytest.raises(shmchan.ChannelNotFound):
        ss.send_partitions(df, "shmchan-spark-test-no-such-channel", "k", "p")
    with pytest.raises(ss.ColumnError):
        ss.send_partitions(df, "whatever", "k", "nope")


def test_a_killed_sending_task_does_not_wedge_the_channel(
    spark: SparkSession, make_channel: Any
) -> None:
    """Spark kills tasks blocked on a full channel (job cancelled); the rows they sent
    arrive whole and once, and the channel then takes a new job's rows as usual."""
    ch = make_channel(capacity=64 << 10)
    rows = [(i, f"k{i % 5}", f"{i:08d}" * 64) for i in range(2000)]  # ~0.5 KiB payloads
    df = spark.createDataFrame(rows, "id long, k string, p string").repartition(2)
    failed: list[BaseException] = []

    def run() -> None:
        try:
            ss.send_partitions(df, ch.name, "k", "p")
        except BaseException as e:  # noqa: BLE001 - the cancelled job's error, checked below
            failed.append(e)

    job = threading.Thread(target=run)
    job.start()
    deadline = time.monotonic() + 60
    while ch.stats().producers < 2 or ch.stats().used_bytes < (48 << 10):
        assert time.monotonic() < deadline, "the senders never filled the channel"
        time.sleep(0.1)
    spark.sparkContext.cancelAllJobs()
    job.join(60)
    assert not job.is_alive() and failed, "the cancelled job should fail"
    while ch.stats().producers:  # the killed tasks' registrations are reclaimed
        assert time.monotonic() < deadline + 60, "killed senders still count as producers"
        time.sleep(0.1)

    rx = ch.receiver()
    try:
        first = _drain(rx, 10**9, 2)  # everything the killed tasks had sent
        payloads = [p for _, p in first]
        assert 0 < len(payloads) == len(set(payloads))
        assert all(p in {r[2] for r in rows} for p in payloads)
        fresh = [(i, f"k{i % 5}", f"fresh {i}") for i in range(500)]
        df2 = spark.createDataFrame(fresh, "id long, k string, p string")
        got: list[tuple[tuple[Any, ...], Any]] = []
        consumer = threading.Thread(target=lambda: got.extend(_drain(rx, len(fresh), 60)))
        consumer.start()
        assert ss.send_partitions(df2, ch.name, "k", "p", timeout=60) == len(fresh)
        consumer.join(70)
    finally:
        rx.close()
    assert sorted(p for _, p in got) == sorted(p for _, _, p in fresh)


# --------------------------------------------------------------------------- process_keyed


class Bank:
    """An order-dependent workload: transfers with an overdraft rule, balances in files."""

    def __init__(self, directory: str, accounts: int) -> None:
        self.directory = directory
        self.accounts = accounts

    def path(self, account: int) -> str:
        return os.path.join(self.directory, f"acct-{account}")

    def reset(self) -> None:
        for a in range(self.accounts):
            with open(self.path(a), "w") as f:
                f.write("100")

    def balance(self, account: int) -> int:
        with open(self.path(account)) as f:
            return int(f.read())

    def __call__(self, row: Any) -> bool:
        src, dst, amount = row.src, row.dst, row.amount
        have = self.balance(src)
        time.sleep(row.pause)  # widen the window in which a second writer would interfere
        if have < amount:
            return False
        with open(self.path(src), "w") as f:
            f.write(str(have - amount))
        if dst >= 0:
            got = self.balance(dst)
            with open(self.path(dst), "w") as f:
                f.write(str(got + amount))
        return True


def bank_rows(seed: int, n: int, accounts: int) -> list[tuple[Any, ...]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a = rng.randrange(accounts)
        if rng.random() < 0.8:
            b = (a + rng.randrange(1, accounts)) % accounts
            keys = [f"acct:{a}", f"acct:{b}"]
        else:  # a withdrawal
            b, keys = -1, [f"acct:{a}"]
        rows.append((i, a, b, rng.randint(1, 80), rng.choice((0.0, 0.0, 0.002)), keys))
    rng.shuffle(rows)
    return rows


BANK_SCHEMA = "id long, src int, dst int, amount int, pause double, keys array<string>"


def test_process_keyed_equals_a_serial_replay(spark: SparkSession, tmp_path: Any) -> None:
    accounts = 24
    bank = Bank(str(tmp_path), accounts)
    bank.reset()
    rows = bank_rows(seed=11, n=1500, accounts=accounts)
    df = spark.createDataFrame(rows, BANK_SCHEMA)
    out = ss.process_keyed(df, "keys", bank, "id", result_type="boolean", workers_per_task=4)
    assert out.columns == [*df.columns, "result", "attempt"]
    got = out.collect()

    replay = Bank(str(tmp_path / "replay"), accounts)
    os.mkdir(replay.directory)
    replay.reset()
    columns = df.columns
    expected = {}
    for values in sorted(rows):
        row = dict(zip(columns, values, strict=True))
        expected[row["id"]] = replay(types.SimpleNamespace(**{**row, "pause": 0.0}))
    assert {r.id: r.result for r in got} == expected
    assert [bank.balance(a) for a in range(accounts)] == [
        replay.balance(a) for a in range(accounts)
    ]
    assert {r.attempt for r in got} == {1}
    assert sorted(tuple(r)[: len(columns)] for r in got) == sorted(rows)


def test_the_bench_function_counts_each_keys_rows_in_order(
    spark: SparkSession, tmp_path: Any
) -> None:
    """`bench --only spark` compares process_keyed with Spark's recipe through Position:
    each row's result is its place among its key's rows, in id order, on both sides."""
    from pyspark.sql import functions as F

    from shmchan.bench import spark as sb

    keys = 13
    df = spark.range(400).select("id", F.concat(F.lit("k"), F.col("id") % keys).alias("key"))
    want = {i: i // keys for i in range(400)}
    sides = [("keyed", lambda fn: sb._keyed(df, fn)), ("recipe", lambda fn: sb._recipe(df, fn, 3))]
    if sb._have_pandas() is None:  # pandas and pyarrow come with the bench extra
        sides.append(("applyInPandas", lambda fn: sb._pandas(df, fn)))
    for name, run in sides:
        directory = tmp_path / name
        directory.mkdir()
        assert run(sb.Position(str(directory), keys)) == want, name


class Trace:
    """Records when each row ran (start, end, pid) and where (task_context())."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, row: Any) -> str:
        start = time.monotonic()
        time.sleep(0.05)
        ctx = ss.task_context()
        with open(os.path.join(self.directory, f"row-{row.id}"), "w") as f:
            f.write(f"{start} {time.monotonic()} {os.getpid()}")
        return f"{ctx.partition_id}/{ctx.attempt}"


def test_rows_sharing_a_key_never_overlap_and_others_run_in_parallel(
    spark: SparkSession, tmp_path: Any
) -> None:
    # One partition: 4 keys, 10 rows each, plus 10 rows linking two keys.
    rows = [(i, [f"k{i % 4}"]) for i in range(40)]
    rows += [(40 + i, [f"k{i % 4}", f"k{(i + 1) % 4}"]) for i in range(10)]
    df = spark.createDataFrame(rows, "id long, keys array<string>")
    parts = ss.partition_by_keys(df, "keys", "id", num_partitions=1)
    out = ss.process_keyed(parts, "keys", Trace(str(tmp_path)), "id", workers_per_task=4)
    got = out.collect()
    assert {r.result for r in got} == {"0/1"}  # task_context(): partition 0, first attempt

    spans = {}
    for rid, _ in rows:
        with open(tmp_path / f"row-{rid}") as f:
            start, end, pid = f.read().split()
        spans[rid] = (float(start), float(end), int(pid))
    keys = dict(rows)
    overlapping = 0
    for a, (sa, ea, _) in spans.items():
        for b, (sb, eb, _) in spans.items():
            if a < b and sa < eb and sb < ea:
                overlapping += 1
                assert not set(keys[a]) & set(keys[b]), f"rows {a} and {b} share a key"
    assert overlapping > 0, "rows without a common key never ran at the same time"
    for k in {k for ks in keys.values() for k in ks}:
        sharing = sorted(rid for rid, ks in keys.items() if k in ks)
        starts = [spans[rid][0] for rid in sharing]
        assert starts == sorted(starts), f"rows of {k} ran out of id order"
    assert len({pid for _, _, pid in spans.values()}) > 1


class KillMySparkWorker:
    """On row 3: note the executor's channels (named after the Spark task's Python worker,
    their creator), then SIGKILL that worker, as a lost executor or a kill would."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, row: Any) -> str:
        if row.id == 3:
            prefix = f"kx-{liveness.token_of(os.getppid()):x}-"
            names = [n for n in shmchan.list_channels() if n.startswith(prefix)]
            with open(os.path.join(self.directory, "channels"), "w") as f:
                f.write("\n".join(names))
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(30)
        return "ok"


def test_a_killed_task_leaves_no_channels_behind(spark: SparkSession, tmp_path: Any) -> None:
    df = spark.createDataFrame([(i, f"k{i}") for i in range(8)], "id long, k string")
    with pytest.raises(Exception, match="(?i)python worker|crash|exited"):
        fn = KillMySparkWorker(str(tmp_path))
        ss.process_keyed(df.coalesce(1), "k", fn, "id").collect()
    left = set((tmp_path / "channels").read_text().split())
    assert left, "the killed task's executor should have had channels"
    out = ss.process_keyed(df, "k", lambda row: row.k, "id").collect()
    assert sorted(r.result for r in out) == [f"k{i}" for i in range(8)]
    # the next tasks' executors removed them (if nobody else's did first)
    assert not left & set(shmchan.list_channels())


def where_it_ran(row: Any) -> str:
    """The Python worker (the executor's creator), the executor's worker, the context."""
    ctx = ss.task_context()
    return f"{os.getppid()} {os.getpid()} {ctx.partition_id}/{ctx.attempt} {row.k}"


def test_tasks_of_one_python_worker_reuse_its_executor(spark: SparkSession) -> None:
    """A Spark Python worker runs its tasks one after another: the worker processes its
    first process_keyed task started serve its later ones, with each task's own fn."""
    df = spark.range(40).selectExpr("id", "concat('k', id % 5) as k")
    pids: dict[int, set[int]] = defaultdict(set)  # Python worker -> executor workers seen
    calls: dict[int, set[int]] = defaultdict(set)  # Python worker -> the calls it ran
    # Spark hands a task to any idle Python worker (its idle queue goes round), so calls
    # go on until one worker has run two of them, within a bound above the idle workers
    # a local[2] session's earlier tests may have left.
    for call in range(12):
        if any(len(c) > 1 for c in calls.values()):
            break
        out = ss.process_keyed(df, "k", where_it_ran, "id", workers_per_task=2, num_partitions=1)
        got = {}
        for r in out.collect():
            ppid, pid, where, k = r.result.split()
            pids[int(ppid)].add(int(pid))
            calls[int(ppid)].add(call)
            got[r.id] = (where, k)
        assert got == {i: ("0/1", f"k{i % 5}") for i in range(40)}
    assert any(len(c) > 1 for c in calls.values()), f"no Python worker ran two calls: {calls}"
    for ppid, seen in pids.items():
        assert len(seen) <= 2, f"Python worker {ppid} started workers for every task: {seen}"


class FailOnRow5:
    """Record which executor workers ran, and raise on row 5."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, row: Any) -> str:
        with open(os.path.join(self.directory, f"{os.getppid()}-{os.getpid()}"), "w"):
            pass
        if row.id == 5:
            raise ValueError("row 5 fails")
        return row.k


def test_a_failed_task_does_not_hand_its_executor_on(spark: SparkSession, tmp_path: Any) -> None:
    """The executor of a task that failed is shut down, not kept: the next task on that
    Python worker starts fresh workers, and runs every row."""
    df = spark.range(20).selectExpr("id", "concat('k', id % 3) as k")
    with pytest.raises(Exception, match="row 5 fails"):
        ss.process_keyed(df, "k", FailOnRow5(str(tmp_path)), "id", num_partitions=1).collect()
    failed = {tuple(map(int, p.name.split("-"))) for p in tmp_path.iterdir()}
    assert failed
    out = ss.process_keyed(df, "k", where_it_ran, "id", workers_per_task=2, num_partitions=1)
    after = set()
    rows = out.collect()
    for r in rows:
        ppid, pid, _, k = r.result.split()
        assert k == f"k{r.id % 3}"
        after.add((int(ppid), int(pid)))
    assert sorted(r.id for r in rows) == list(range(20))
    assert not failed & after, "the failed task's executor workers ran the next task"


def test_process_keyed_runs_one_partition_per_core_unless_told(spark: SparkSession) -> None:
    """Each partition is a Spark task: by default as many as Spark has cores
    (defaultParallelism), not spark.sql.shuffle.partitions."""
    df = spark.range(60).selectExpr("id", "concat('k', id % 7) as k")
    before = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", "50")
    try:
        out = ss.process_keyed(df, "k", str, "id", workers_per_task=2)
        assert out.rdd.getNumPartitions() == spark.sparkContext.defaultParallelism
        three = ss.process_keyed(df, "k", str, "id", workers_per_task=2, num_partitions=3)
        assert three.rdd.getNumPartitions() == 3
        assert sorted(r.result for r in three.collect()) == sorted(str(r) for r in df.collect())
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", before)


def test_process_keyed_refuses_bad_arguments(spark: SparkSession) -> None:
    df = spark.createDataFrame([(1, "a")], "id long, k string")
    with pytest.raises(ValueError, match="workers_per_task"):
        ss.process_keyed(df, "k", str, "id", workers_per_task=0)
    with pytest.raises(ValueError, match="num_partitions"):
        ss.process_keyed(df, "k", str, "id", num_partitions=0)
    with pytest.raises(ss.ColumnError):
        ss.process_keyed(df, "nope", str, "id")
    with pytest.raises(ss.ColumnError, match="result"):
        ss.process_keyed(df.withColumnRenamed("k", "result"), "result", str, "id")
    with pytest.raises(RuntimeError, match="task_context"):
        ss.task_context()


# --------------------------------------------------------------------------- demo --spark


def test_the_spark_demo_matches_its_serial_replay(
    spark: SparkSession, capsys: pytest.CaptureFixture[str]
) -> None:
    from shmchan import demo
    from shmchan.spark import demo as spark_demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--spark", "--messages", "800", "--accounts", "30"])
    assert spark_demo.run(args, spark=spark) == 0
    out = capsys.readouterr().out
    assert "OK: every decision and the final balances equal the serial replay" in out
    assert "components: 3, the largest" in out  # three branches of ten accounts
    for stage in ("build the dataset", "partition by keys", "process_keyed", "serial replay"):
        assert stage in out


def test_demo_spark_on_the_command_line_parses() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shmchan", "demo", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert out.returncode == 0 and "--spark" in out.stdout
