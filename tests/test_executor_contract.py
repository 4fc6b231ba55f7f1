"""KeyedExecutor keeps the concurrent.futures contract where ProcessPoolExecutor sets the
floor: a task is running only once a worker started it, and until then cancel() wins;
shutdown(cancel_futures=True), closing a map and Ctrl-C in the caller stop what has not
started. Each is measured beside ProcessPoolExecutor (counts, printed) and bounded with
slack: the machine is shared, so no test here depends on timing beyond "before the
tasks could have finished"."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path

import pytest
from test_pool import WAIT, _until, gated, no_leftovers  # noqa: F401 - no_leftovers is autouse

import shmchan
from shmchan.pool import manager

ROOT = Path(__file__).resolve().parent.parent


def logged_sleep(log: str, i: int, seconds: float) -> int:
    """Sleep, then append `i` to the file `log` (a line per task that ran to its end)."""
    time.sleep(seconds)
    with open(log, "a") as f:
        f.write(f"{i}\n")
    return i


def _ran(log: str) -> int:
    return len(Path(log).read_text().split()) if os.path.exists(log) else 0


Maker = Callable[[], Executor]
PEERS: dict[str, Maker] = {
    "ProcessPoolExecutor": lambda: ProcessPoolExecutor(2),
    "KeyedExecutor": lambda: shmchan.KeyedExecutor(2),
}


@pytest.fixture
def ex() -> Iterator[shmchan.KeyedExecutor]:
    e = shmchan.KeyedExecutor(1)
    yield e
    e.shutdown(wait=True, cancel_futures=True)


def test_a_task_waiting_in_a_workers_hands_is_not_running_and_cancels(
    ex: shmchan.KeyedExecutor, tmp_path: Path
) -> None:
    log, gate = str(tmp_path / "log"), str(tmp_path / "gate")
    blocker = ex.submit(gated, gate, "blocker")
    behind = [ex.submit(logged_sleep, log, i, 0) for i in range(8)]
    _until(blocker.running)
    # The manager hands tasks to a worker ahead of time: these wait there, behind the
    # blocker, not started.
    _until(lambda: ex._manager.workers.outstanding() == 9)
    assert not any(f.running() for f in behind)
    assert ex.stats().running == 1
    assert all(f.cancel() for f in behind)
    assert all(f.cancelled() for f in behind)
    Path(gate).touch()
    assert blocker.result(timeout=WAIT) == "blocker"
    assert ex.submit(logged_sleep, log, 99, 0).result(timeout=WAIT) == 99
    assert Path(log).read_text().split() == ["99"]  # no cancelled task ran


def test_a_cancel_that_loses_to_the_worker_says_so_and_the_task_runs(
    ex: shmchan.KeyedExecutor, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Stage the race the other way: the worker adopts the task (starts it) just before
    # cancel() tries to take it back. Either side may win; the loser must know it.
    log, gate = str(tmp_path / "log"), str(tmp_path / "gate")
    real = manager.Manager.take_back

    def late(data: bytes, i: int) -> shmchan.Handle | None:
        Path(gate).touch()  # the blocker ends: the worker goes on to the task
        _until(lambda: _ran(log) == 1)  # it has run it
        return real(data, i)

    monkeypatch.setattr(manager.Manager, "take_back", staticmethod(late))
    blocker = ex.submit(gated, gate, "blocker")
    task = ex.submit(logged_sleep, log, 1, 0)
    _until(blocker.running)
    _until(lambda: ex._manager.workers.outstanding() == 2)
    assert task.cancel() is False
    assert task.result(timeout=WAIT) == 1
    assert not task.cancelled()


def _shutdown_counts(make: Maker, log: str) -> tuple[int, int]:
    e = make()
    try:
        fs = [e.submit(logged_sleep, log, i, 0.2) for i in range(40)]
        time.sleep(0.5)
        e.shutdown(wait=False, cancel_futures=True)
        concurrent.futures.wait([f for f in fs if not f.cancelled()], timeout=WAIT)
        return sum(f.cancelled() for f in fs), _ran(log)
    finally:
        e.shutdown(wait=True)


def test_shutdown_cancel_futures_cancels_what_has_not_started(tmp_path: Path) -> None:
    counts = {name: _shutdown_counts(make, str(tmp_path / name)) for name, make in PEERS.items()}
    print("40 tasks of 0.2 s, 2 workers, shutdown(cancel_futures=True) after 0.5 s:")
    for name, (cancelled, ran) in counts.items():
        print(f"  {name}: cancelled {cancelled}, ran {ran}")
    cancelled, ran = counts["KeyedExecutor"]
    assert cancelled >= 25 and cancelled + ran == 40


def _map_close_count(make: Maker, log: str) -> int:
    e = make()
    try:
        results = e.map(logged_sleep, [log] * 100, range(100), [0.02] * 100)
        assert next(results) == 0
        results.close()  # type: ignore[attr-defined]
    finally:
        e.shutdown(wait=True)
    return _ran(log)


def test_closing_a_map_iterator_cancels_what_has_not_started(tmp_path: Path) -> None:
    counts = {name: _map_close_count(make, str(tmp_path / name)) for name, make in PEERS.items()}
    print(f"map over 100 items, one result taken, iterator closed: ran {counts}")
    assert counts["KeyedExecutor"] <= 25


def test_dropping_a_map_iterator_cancels_what_has_not_started(tmp_path: Path) -> None:
    log = str(tmp_path / "log")
    e = shmchan.KeyedExecutor(2)
    try:
        results = e.map(logged_sleep, [log] * 100, range(100), [0.02] * 100)
        assert next(results) == 0
        del results  # collected at once (no cycle): the generator closes
    finally:
        e.shutdown(wait=True)
    assert _ran(log) <= 25


# ------------------------------------------------------------------ Ctrl-C in the caller

_SCRIPT = """
import sys, time
sys.path[:0] = [{tests!r}, {root!r}]
from test_executor_contract import logged_sleep
from concurrent.futures import ProcessPoolExecutor
import shmchan

def make():
    if {peer!r} == "ProcessPoolExecutor":
        return ProcessPoolExecutor(2)
    return shmchan.KeyedExecutor(2, task_timeout={timeout!r})

if __name__ == "__main__":
    log = {log!r}
    n = 20
    if {mode!r} == "map":
        with make() as ex:
            print("ready", flush=True)
            for _ in ex.map(logged_sleep, [log] * n, range(n), [0.5] * n):
                pass
    elif {mode!r} == "result":
        ex = make()
        fs = [ex.submit(logged_sleep, log, i, 0.5) for i in range(n)]
        print("ready", flush=True)
        fs[-1].result()
    else:  # "with": interrupted in the with block's exit, waiting for the tasks
        with make() as ex:
            for i in range(n):
                ex.submit(logged_sleep, log, i, 0.5)
            print("ready", flush=True)
"""


def _interrupt(
    peer: str,
    mode: str,
    tmp_path: Path,
    timeout: float | None = None,
    twice: bool = False,
    bound: float = WAIT,
) -> tuple[float, int]:
    """Run the script, Ctrl-C it once two tasks ended; (seconds until it was gone, or inf
    if it was still there after `bound` seconds and had to be killed; tasks that ran to
    their end). 20 tasks of 0.5 s on 2 workers: 4.5 s more to finish them."""
    log = str(tmp_path / f"{peer}-{mode}")
    script = _SCRIPT.format(
        tests=str(ROOT / "tests"),
        root=str(ROOT),
        peer=peer,
        log=log,
        mode=mode,
        timeout=timeout,
    )
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # (SIGINT to the script and its workers, as a terminal's)
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        _until(lambda: _ran(log) >= 2)
        os.killpg(p.pid, signal.SIGINT)
        sent = time.monotonic()
        if twice:
            time.sleep(0.2)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        try:
            p.wait(bound)
        except subprocess.TimeoutExpired:
            return float("inf"), _ran(log)
        return time.monotonic() - sent, _ran(log)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        _until(lambda: _group_gone(p.pid))


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("mode", ["map", "result", "with"])
def test_ctrl_c_in_the_caller_leaves_at_once(mode: str, tmp_path: Path) -> None:
    # (ProcessPoolExecutor may hang there: it is given 10 s, then killed)
    peer_gone, peer_ran = _interrupt("ProcessPoolExecutor", mode, tmp_path, bound=10)
    gone, ran = _interrupt("KeyedExecutor", mode, tmp_path)
    print(
        f"Ctrl-C in {mode}, 20 tasks of 0.5 s: ProcessPoolExecutor gone after "
        f"{peer_gone:.1f} s, {peer_ran} ran; KeyedExecutor gone after {gone:.1f} s, {ran} ran"
    )
    # The remaining tasks needed 4.5 s more: the process left before they could end.
    assert ran < 20 and gone < 4.5


def test_ctrl_c_with_a_task_timeout_waits_for_the_running_tasks_at_most(tmp_path: Path) -> None:
    gone, ran = _interrupt("KeyedExecutor", "map", tmp_path, timeout=3.0)
    print(f"Ctrl-C in map with task_timeout=3: gone after {gone:.1f} s, {ran} ran")
    assert ran <= 6 and gone < 3.0 + 4.5


def test_a_second_ctrl_c_never_hangs(tmp_path: Path) -> None:
    gone, ran = _interrupt("KeyedExecutor", "with", tmp_path, twice=True)
    print(f"Ctrl-C twice in the with block's exit: gone after {gone:.1f} s, {ran} ran")
    assert ran < 20 and gone < 4.5


def test_tasks_waiting_behind_a_long_task_move_to_an_idle_worker(tmp_path: Path) -> None:
    # Tasks are handed to workers ahead of time, spread over them; those that landed
    # behind a long task would hold their keys (and everything behind those) until it
    # ends. An idle worker takes them over.
    gate = str(tmp_path / "gate")
    e = shmchan.KeyedExecutor(2)
    try:
        slow = e.submit(gated, gate, "slow", keys="slow")
        _until(slow.running)
        fs = [e.submit(logged_sleep, str(tmp_path / "log"), i, 0.01, keys=i % 8) for i in range(40)]
        done, pending = concurrent.futures.wait(fs, timeout=WAIT)
        stolen = getattr(e._manager, "stolen", "-")
        print(f"done beside a long task: {len(done)} of 40, taken over: {stolen}")
        assert not pending and not slow.done()
    finally:
        Path(gate).touch()
        e.shutdown(wait=True)


def test_a_map_iterator_dropped_before_its_first_item_cancels_its_tasks(tmp_path: Path) -> None:
    log, gate = str(tmp_path / "log"), str(tmp_path / "gate")
    e = shmchan.KeyedExecutor(1)
    try:
        blocker = e.submit(gated, gate, "blocker")
        _until(blocker.running)
        results = e.map(logged_sleep, [log] * 20, range(20), [0] * 20)
        del results  # never iterated
        _until(lambda: e.stats().cancelled == 20)
        Path(gate).touch()
        assert blocker.result(timeout=WAIT) == "blocker"
        assert e.submit(logged_sleep, log, 99, 0).result(timeout=WAIT) == 99
    finally:
        e.shutdown(wait=True)
    assert Path(log).read_text().split() == ["99"]


def test_wait_hears_of_a_cancel_made_while_it_waits(
    ex: shmchan.KeyedExecutor, tmp_path: Path
) -> None:
    gate = str(tmp_path / "gate")
    blocker = ex.submit(gated, gate, "blocker")
    behind = ex.submit(logged_sleep, str(tmp_path / "log"), 1, 0)
    _until(blocker.running)
    waited: list[set[concurrent.futures.Future[int]]] = []
    t = threading.Thread(
        target=lambda: waited.append(concurrent.futures.wait([behind], timeout=WAIT).done)
    )
    t.start()
    time.sleep(0.2)  # (wait() is waiting by now, or sees it cancelled at once: both pass)
    ex.shutdown(wait=False, cancel_futures=True)
    t.join(WAIT)
    Path(gate).touch()
    assert waited == [{behind}] and behind.cancelled()
