"""KeyedExecutor: what goes wrong around the tasks (initializers, callbacks, deaths)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_pool import WAIT, no_leftovers, square  # noqa: F401 - no_leftovers is autouse

import shmchan
from shmchan.pool.workers import _Workers

BOUND = 30  # seconds a test here waits for what the fixed executor does at once


@pytest.fixture
def executors() -> Iterator[list[shmchan.KeyedExecutor]]:
    """Executors a test makes; whatever the test did, their managers are stopped after it
    (on a hang, by dropping every task, so that the manager has nothing left to wait for)."""
    made: list[shmchan.KeyedExecutor] = []
    yield made
    for ex in made:
        core = ex._core
        core.request_shutdown(cancel_futures=True)
        core.thread.join(BOUND)
        if core.thread.is_alive():  # the bug under test kept it busy: make it finish
            core.tasks.clear()
            with contextlib.suppress(shmchan.Error):
                core.task_ch.shutdown()  # (wakes a send stuck on a full task channel)
            core.thread.join(WAIT)


def _shutdown_within(ex: shmchan.KeyedExecutor, seconds: float) -> bool:
    """shutdown(wait=True) in a thread; True if it returned within `seconds`."""
    t = threading.Thread(target=ex.shutdown, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


# ------------------------------------------------------------------ task functions


def no_database() -> None:
    raise ConnectionError("no database")


def exit_in_init() -> None:
    os._exit(9)


def count_then_die_first_time(path: str) -> int:
    """Count a run in the file `path`; the first run kills its own worker."""
    with open(path, "a") as f:
        f.write("x")
    runs = Path(path).read_text().count("x")
    if runs == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return runs


# ------------------------------------------------------------------ initializers


@pytest.mark.timeout(3 * BOUND)
def test_an_initializer_that_raises_fails_the_futures_and_refuses_submits(
    executors: list[shmchan.KeyedExecutor],
) -> None:
    ex = shmchan.KeyedExecutor(2, initializer=no_database)
    executors.append(ex)
    futures = [ex.submit(square, i, keys=("k",)) for i in range(5)]
    futures.append(ex.submit(square, 9))
    for fut in futures:
        with pytest.raises(shmchan.InitializerFailed, match="no_database"):
            fut.result(timeout=BOUND)
    with pytest.raises(shmchan.InitializerFailed):
        ex.submit(square, 1)
    with pytest.raises(shmchan.InitializerFailed):
        ex.map(square, [1, 2])
    assert _shutdown_within(ex, BOUND)


@pytest.mark.timeout(3 * BOUND)
def test_an_initializer_that_raises_lets_shutdown_return_with_nothing_submitted(
    executors: list[shmchan.KeyedExecutor],
) -> None:
    ex = shmchan.KeyedExecutor(1, initializer=no_database)
    executors.append(ex)
    fut = ex.submit(square, 3)
    assert _shutdown_within(ex, BOUND)
    assert isinstance(fut.exception(timeout=0), shmchan.InitializerFailed)


@pytest.mark.timeout(3 * BOUND)
def test_workers_that_always_die_in_the_initializer_break_the_executor(
    executors: list[shmchan.KeyedExecutor],
) -> None:
    ex = shmchan.KeyedExecutor(2, initializer=exit_in_init)
    executors.append(ex)
    fut = ex.submit(square, 3, keys="k")
    with pytest.raises(shmchan.InitializerFailed, match="exited with code 9"):
        fut.result(timeout=BOUND)
    assert _shutdown_within(ex, BOUND)
    assert isinstance(fut.exception(), concurrent.futures.BrokenExecutor)


# ------------------------------------------------------------------ deaths


@pytest.mark.timeout(3 * BOUND)
def test_a_task_failed_for_good_does_not_run_again(
    executors: list[shmchan.KeyedExecutor], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The manager has just seen its worker die while running the task's last attempt.
    # Stage the worst case for what it does before it counts that death: the channel has
    # already redelivered the dead worker's task (attempt + 1) and a result is waiting.
    # Collecting that result must not hand the redelivered copy to another worker: the
    # task is about to fail with WorkerDied, and then it must not run.
    ex = shmchan.KeyedExecutor(2, max_attempts=1)
    executors.append(ex)
    core = ex._core
    ended = _Workers.ended

    def ended_after_redelivery(self: _Workers) -> list[Any]:
        out = ended(self)
        if out:
            core.rx_tasks.maintain()  # the dead holder's task is redelivered
            core.wake_tx.send(b"")  # something on the result channel
        return out

    monkeypatch.setattr(_Workers, "ended", ended_after_redelivery)
    runs = str(tmp_path / "runs")
    calls: list[concurrent.futures.Future[int]] = []
    fut = ex.submit(count_then_die_first_time, runs, keys=("k",))
    fut.add_done_callback(calls.append)
    with pytest.raises(shmchan.WorkerDied, match="failed 1 time"):
        fut.result(timeout=BOUND)
    # the next task on the key runs after whatever became of the redelivered copy
    assert ex.submit(square, 3, keys=("k",)).result(timeout=BOUND) == 9
    assert _shutdown_within(ex, BOUND)
    assert Path(runs).read_text() == "x"  # it ran once, as the future says
    assert calls == [fut]
