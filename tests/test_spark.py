"""shmchan.spark on a local[2] SparkSession (one per module: a JVM takes seconds to start).

Components are checked against a union-find over the same rows in Python; process_keyed
against a serial replay of an order-dependent workload; send_partitions against a consumer
counting what arrives.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
from pyspark.sql import SparkSession

import shmchan
from shmchan import spark as ss
from tests.procs import child_env


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    s = ss.session("shmchan-tests", master="local[2]")
    try:
        yield s
    finally:
        ss.stop(s)


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
