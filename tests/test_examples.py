"""Every program in examples/ runs to completion, as a newcomer runs it, and cleans up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from procs import child_env

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT = 120  # seconds; each takes a few, this only catches a hang
SPARK_TIMEOUT = 600  # a JVM and a Spark job on a busy 2-core machine


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def run_example(
    name: str, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**child_env(), **(env or {})},
    )


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("quickstart.py", "while acct:1 is held: None"),
        ("orders.py", ""),
        ("worker_pool.py", "a worker died once: True"),
        ("fanout.py", "refunds.eu         -> nowhere"),
        ("stuck_key.py", "waits on key acct:2 behind seq 2"),
        ("async_service.py", "all events applied: True"),
    ],
)
def test_example_runs_and_leaves_nothing_behind(name: str, says: str) -> None:
    result = run_example(name, TIMEOUT)
    assert result.returncode == 0, result
    assert says in result.stdout
    assert "Traceback" not in result.stderr


def test_examples_leave_no_channels_behind() -> None:
    before = shm_entries()
    for name in ("quickstart.py", "fanout.py", "stuck_key.py"):
        assert run_example(name, TIMEOUT).returncode == 0, name
    left = {e for e in shm_entries() - before if e.startswith(("shmchan", "sem.shmchan"))}
    ours = {
        e
        for e in left
        if any(w in e for w in ("quickstart", "audit", "billing", "orders-", "stuck"))
    }
    assert not ours, ours


@pytest.mark.timeout(SPARK_TIMEOUT + 30)
def test_spark_batch_example_matches_the_serial_replay() -> None:
    pytest.importorskip("pyspark")
    result = run_example("spark_batch.py", SPARK_TIMEOUT)
    assert result.returncode == 0, result
    assert "same as the serial replay: True" in result.stdout


@pytest.mark.timeout(2 * SPARK_TIMEOUT + 30)
def test_spark_stream_example_records_each_row_once_across_runs(tmp_path: Any) -> None:
    pytest.importorskip("pyspark")
    env = {"SHMCHAN_EXAMPLE_DIR": str(tmp_path)}
    first = run_example("spark_stream.py", SPARK_TIMEOUT, env=env)
    assert first.returncode == 0, first
    assert "ledger: 30 rows" in first.stdout
    again = run_example("spark_stream.py", SPARK_TIMEOUT, env=env)  # from the checkpoint
    assert again.returncode == 0, again
    assert "ledger: 30 rows" in again.stdout
