"""KeyedExecutor: what goes wrong around the tasks (initializers, callbacks, deaths)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_pool import (  # noqa: F401 - no_leftovers is autouse
    WAIT,
    append_line,
    gated,
    no_leftovers,
    square,
)

import shmchan
from shmchan.pool import manager
from shmchan.pool.workerset import WorkerSet

BOUND = 30  # seconds a test here waits for what the fixed executor does at once


@pytest.fixture
def executors() -> Iterator[list[shmchan.KeyedExecutor]]:
    """Executors a test makes; whatever the test did, their managers are stopped after it
    (on a hang, by dropping every task, so that the manager has nothing left to wait for)."""
    made: list[shmchan.KeyedExecutor] = []
    yield made
    for ex in made:
        core = ex._manager
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


@pytest.mark.timeout(3 * BOUND)
def test_workers_killed_before_any_task_never_break_an_executor_without_initializer(
    executors: list[shmchan.KeyedExecutor],
) -> None:
    # The executor is never "broken" by deaths. Only an initializer (user code
    # that runs before any task) can make workers unable to start; without one, new
    # workers killed again and again before their first task are just replaced.
    ex = shmchan.KeyedExecutor(1)
    executors.append(ex)
    killed: set[int] = set()
    deadline = time.monotonic() + BOUND
    while len(killed) < 4 * manager._EARLY_DEATHS and time.monotonic() < deadline:
        for w in list(ex._manager.workers.slots):
            if w is not None and w.process.pid not in killed:
                killed.add(w.process.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.process.pid, signal.SIGKILL)
        time.sleep(0.001)
    assert len(killed) >= 4 * manager._EARLY_DEATHS
    assert ex.submit(square, 7).result(timeout=BOUND) == 49


# ------------------------------------------------------------------ callbacks


@pytest.mark.timeout(3 * BOUND)
def test_done_callbacks_that_submit_do_not_block_the_manager_on_a_full_channel(
    executors: list[shmchan.KeyedExecutor],
) -> None:
    # Callbacks run in the manager thread, the only one that empties the task channel:
    # a submit there must not wait for room in it. A tiny channel, kept full by a
    # thread that submits more than it holds, while every callback submits a follow-up.
    ex = shmchan.KeyedExecutor(1, capacity=4096)
    executors.append(ex)
    n = 300
    follow_ups: list[concurrent.futures.Future[int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def again(fut: concurrent.futures.Future[int]) -> None:
        try:
            f = ex.submit(square, fut.result(), keys=("k", str(fut.result() % 4)))
        except BaseException as e:  # pragma: no cover - shows up in the assertion below
            errors.append(e)
            return
        with lock:
            follow_ups.append(f)

    firsts: list[concurrent.futures.Future[int]] = []

    def submit_all() -> None:
        for i in range(n):
            f = ex.submit(square, i, keys=("k", str(i % 4)))
            f.add_done_callback(again)
            firsts.append(f)

    feeder = threading.Thread(target=submit_all, daemon=True)
    feeder.start()
    feeder.join(BOUND)
    assert not feeder.is_alive(), "submits stopped: the manager is stuck in a callback"
    concurrent.futures.wait(firsts, timeout=BOUND)
    assert all(f.done() for f in firsts)
    assert not errors
    with lock:
        assert len(follow_ups) == n
        done, _ = concurrent.futures.wait(follow_ups, timeout=BOUND)
    assert len(done) == n
    assert sorted(f.result() for f in follow_ups) == sorted((i * i) ** 2 for i in range(n))
    assert _shutdown_within(ex, BOUND)


@pytest.mark.timeout(3 * BOUND)
def test_a_submit_after_a_callbacks_submit_runs_after_it(
    executors: list[shmchan.KeyedExecutor], tmp_path: Path
) -> None:
    # The callback's submit finds the task channel full and waits in the manager's
    # backlog; a submit the caller makes after it, on the same key, must still run after.
    ex = shmchan.KeyedExecutor(1, capacity=4096)
    executors.append(ex)
    gate, log = str(tmp_path / "gate"), str(tmp_path / "log")
    submitted = threading.Event()
    backlogged: list[bool] = []
    line = "callback" + "." * 2500  # more than the room a filler's dispatch frees

    def from_callback(fut: concurrent.futures.Future[Any]) -> None:
        ex.submit(append_line, log, line, keys=("log",))
        backlogged.append(bool(ex._manager.backlog))
        submitted.set()

    first = ex.submit(gated, gate, keys=("gate",))
    first.add_done_callback(from_callback)
    fillers: list[concurrent.futures.Future[Any]] = []

    def fill() -> None:  # more than the channel holds, all behind the gate
        for _ in range(200):
            fillers.append(ex.submit(gated, gate, keys=("gate",)))

    feeder = threading.Thread(target=fill, daemon=True)
    feeder.start()
    deadline = time.monotonic() + BOUND
    while (st := ex._manager.task_ch.stats()).capacity - st.used_bytes >= 1600:
        assert time.monotonic() < deadline, "the task channel never filled"
        time.sleep(0.01)
    Path(gate).touch()
    assert submitted.wait(BOUND)
    assert backlogged == [True]  # the callback's task found no room
    last = ex.submit(append_line, log, "caller", keys=("log",))
    assert last.result(timeout=BOUND).split() == [line, "caller"]
    feeder.join(BOUND)
    concurrent.futures.wait(fillers, timeout=BOUND)
    assert _shutdown_within(ex, BOUND)


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
    core = ex._manager
    ended = WorkerSet.ended

    def ended_after_redelivery(self: WorkerSet) -> list[Any]:
        out = ended(self)
        if out:
            core.rx_tasks.maintain()  # the dead holder's task is redelivered
            core.wake_tx.send(b"")  # something on the result channel
        return out

    monkeypatch.setattr(WorkerSet, "ended", ended_after_redelivery)
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


def mark_then_nap(path: str, seconds: float) -> int:
    """Count a run in the file `path`, then sleep; the number of runs so far."""
    with open(path, "a") as f:
        f.write("x")
    time.sleep(seconds)
    return Path(path).read_text().count("x")


@pytest.mark.timeout(3 * BOUND)
def test_a_timeout_kill_that_lands_on_the_next_task_does_not_count_against_it(
    executors: list[shmchan.KeyedExecutor], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The manager reads which task a worker runs and since when, finds it past
    # task_timeout and kills the worker; but the worker may have moved on to its next
    # task in between. Stage that: the first time the manager looks while the second
    # task runs, it is shown the first task (already done) as running for ages.
    runs = str(tmp_path / "runs")
    running = WorkerSet.running
    staged: list[int] = []

    def stale_running(self: WorkerSet, w: Any) -> tuple[int, int] | None:
        now = running(self, w)
        if now is not None and not staged and w.process.exitcode is None and Path(runs).exists():
            staged.append(now[0])
            return now[0] - 1, 0  # the task before, started long ago
        return now

    monkeypatch.setattr(WorkerSet, "running", stale_running)
    ex = shmchan.KeyedExecutor(1, max_attempts=1, task_timeout=10)
    executors.append(ex)
    first = ex.submit(square, 4, keys=("k",))
    assert first.result(timeout=BOUND) == 16
    second = ex.submit(mark_then_nap, runs, 0.5, keys=("k",))
    # killed through no fault of its own, it runs again instead of failing
    assert second.result(timeout=BOUND) == 2
    assert staged
    assert _shutdown_within(ex, BOUND)


# ------------------------------------------------------------------ cancelling


def touch(path: str) -> str:
    Path(path).touch()
    return path


class ExitAtUnpickle:
    """A result whose unpickling in the caller raises SystemExit."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_exit_now, ())


def _exit_now() -> None:
    raise SystemExit(3)


def exit_at_unpickle() -> ExitAtUnpickle:
    return ExitAtUnpickle()


@pytest.mark.timeout(3 * BOUND)
def test_a_done_callback_that_raises_system_exit_leaves_every_future_resolved(
    executors: list[shmchan.KeyedExecutor],
) -> None:
    ex = shmchan.KeyedExecutor(2)
    executors.append(ex)
    fs = []
    for i in range(200):  # results arrive in batches: each batch meets the callbacks
        f = ex.submit(square, i)
        f.add_done_callback(lambda _f: sys.exit(1))
        fs.append(f)
    done, pending = concurrent.futures.wait(fs, timeout=BOUND)
    assert not pending
    assert [f.result() for f in fs] == [i * i for i in range(200)]
    assert ex.submit(square, 3).result(timeout=BOUND) == 9  # the manager lives on


@pytest.mark.timeout(3 * BOUND)
def test_a_result_whose_unpickling_raises_system_exit_fails_only_its_future(
    executors: list[shmchan.KeyedExecutor],
) -> None:
    ex = shmchan.KeyedExecutor(2)
    executors.append(ex)
    bad = ex.submit(exit_at_unpickle)
    good = [ex.submit(square, i) for i in range(50)]
    with pytest.raises(shmchan.Error, match="unpickled.*SystemExit"):
        bad.result(timeout=BOUND)
    assert [f.result(timeout=BOUND) for f in good] == [i * i for i in range(50)]
    assert ex.submit(square, 3).result(timeout=BOUND) == 9


@pytest.mark.timeout(3 * BOUND)
def test_a_manager_that_dies_fails_every_pending_future(
    executors: list[shmchan.KeyedExecutor], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The last line of defence: whatever kills the manager midway through a batch of
    # results, no future is left pending (result() without a timeout would block).
    def broken(self: Any, *args: Any) -> bool:
        raise SystemExit("the manager died")

    ex = shmchan.KeyedExecutor(2)
    executors.append(ex)
    assert ex.submit(square, 2).result(timeout=BOUND) == 4
    monkeypatch.setattr(manager.Manager, "settle", broken)
    fs = [ex.submit(square, i) for i in range(20)]
    done, pending = concurrent.futures.wait(fs, timeout=BOUND)
    assert not pending
    assert any(isinstance(f.exception(), shmchan.Error) for f in fs)


_NO_GUARD = """
import sys
sys.path[:0] = [{root!r}]
import shmchan
ex = shmchan.KeyedExecutor(2, mp_context="spawn")
print(ex.submit(abs, -1).result(timeout={bound!r}))
"""


@pytest.mark.timeout(3 * BOUND)
def test_spawn_workers_that_cannot_start_break_the_executor_and_name_the_guard(
    tmp_path: Path,
) -> None:
    # A script without `if __name__ == "__main__":`: every spawned worker imports it
    # again, tries to start an executor of its own while bootstrapping, and exits.
    script = tmp_path / "no_guard.py"
    root = str(Path(__file__).resolve().parent.parent)
    script.write_text(_NO_GUARD.format(root=root, bound=BOUND))
    p = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=2 * BOUND
    )
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert "InitializerFailed" in last and '__name__ == "__main__"' in last, last
