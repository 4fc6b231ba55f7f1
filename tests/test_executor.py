"""KeyedExecutor: what goes wrong around the tasks (initializers, callbacks, deaths)."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Iterator

import pytest
from test_pool import WAIT, no_leftovers, square  # noqa: F401 - no_leftovers is autouse

import shmchan

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
