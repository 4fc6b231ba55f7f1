"""An offline SparkSession for one machine: local[*], loopback only, no UI, a checkpoint dir.

Every other function of shmchan.spark works on any session; this one only saves a new user
the settings that make Spark start without a network or a cluster.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import tempfile

from pyspark import SparkContext
from pyspark.sql import SparkSession

__all__ = ["session", "stop"]

LOOPBACK = "127.0.0.1"


def session(app_name: str = "shmchan", master: str | None = None) -> SparkSession:
    """A SparkSession that works offline on this machine.

    The master is `master`, else the environment's `SPARK_MASTER`, else `local[*]`.
    Spark binds to 127.0.0.1 only (`SPARK_LOCAL_IP`, `spark.driver.bindAddress`,
    `spark.driver.host`), runs its Python workers with this interpreter
    (`PYSPARK_PYTHON=sys.executable`, so they import the same shmchan), has no web UI,
    uses a shuffle width of twice the local cores, and checkpoints into a temporary
    directory removed at exit. If a session is already active, Spark returns it and
    only the settings that can change at run time apply. Stop it with `stop(spark)`
    (or `spark.stop()`, which leaves the JVM running until this process exits).
    """
    master = master or os.environ.get("SPARK_MASTER") or "local[*]"
    os.environ["SPARK_LOCAL_IP"] = LOOPBACK
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    cores = os.cpu_count() or 1
    spark = (
        SparkSession.builder.appName(app_name)
        .master(master)
        .config("spark.driver.bindAddress", LOOPBACK)
        .config("spark.driver.host", LOOPBACK)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(2 * cores))
        .config("spark.default.parallelism", str(2 * cores))
        # Python workers are reused between tasks: a task's start-up stays cheap.
        .config("spark.python.worker.reuse", "true")
        .getOrCreate()
    )
    sc = spark.sparkContext
    sc.setLogLevel("ERROR")
    if not sc.getCheckpointDir():
        directory = tempfile.mkdtemp(prefix="shmchan-spark-checkpoints-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        sc.setCheckpointDir(directory)
    return spark


def stop(spark: SparkSession, timeout: float = 30.0) -> None:
    """Stop `spark` and the JVM behind it (PySpark's own `stop()` keeps the JVM until exit).

    Afterwards a new `session()` starts a fresh JVM. Waits at most `timeout` seconds for
    the JVM to exit, then kills it.
    """
    spark.stop()
    gateway = SparkContext._gateway
    if gateway is None:
        return
    proc = getattr(gateway, "proc", None)
    with contextlib.suppress(Exception):
        gateway.shutdown()
    SparkContext._gateway = None
    SparkContext._jvm = None
    if proc is None:
        return
    with contextlib.suppress(Exception):
        if proc.stdin is not None:
            proc.stdin.close()  # the gateway JVM exits when its stdin closes
    try:
        proc.wait(timeout)
    except Exception:
        proc.kill()
        proc.wait(timeout)
