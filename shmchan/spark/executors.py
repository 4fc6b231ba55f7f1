"""The KeyedExecutors of one Spark Python worker, kept from one task to the next.

PySpark runs a Python worker's tasks one after another in the same process (the
default, spark.python.worker.reuse=true), so the worker processes a KeyedExecutor
started for one `process_keyed` task can serve the next, instead of every task paying
for `workers_per_task` process starts and stops.

    task starts:  borrow(config) -> an idle executor of that configuration, else a new one
    task runs:    its rows, each carrying the number of the task's plan (`post`): a
                  worker that has not loaded that plan yet reads it from its file in
                  PLANS_DIR (function, column names, task context), once
    task ends:    every row ran and returned, nothing queued or running, and the Python
                  worker runs further tasks (Spark says so in its environment) -> idle;
                  an exception, or a task Spark stopped reading early -> shut down,
                  so a retried task never meets a busy or broken executor
    idle for IDLE_SECONDS -> shut down by a reaper thread (Spark kills a Python worker
                  idle for a minute, with no chance to clean up)
    interpreter exit -> the idle ones shut down; a fork -> the child forgets them

Invariant: an executor is either lent to exactly one running task or idle with no task
of its own queued or running, so two tasks' rows never share its key locks.

Reusing an executor starts no executor, and so does not sweep the channels that killed
executors left behind (a new executor does that): `borrow` sweeps them itself when it
reuses one, so what a killed task left is gone once the next task on the node starts
(the plan file of a task killed while it ran too: plan files are named after their
creator's liveness token).
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from .. import ChannelNotFound, list_channels, liveness, unlink
from ..pool import KeyedExecutor

PLANS_DIR = os.path.join(tempfile.gettempdir(), "shmchan-spark-plans")
IDLE_SECONDS = 45.0  # an idle executor lives this long (Spark kills idle workers at 60 s)
MAX_IDLE = 2  # idle executors kept per Python worker, the least recently used go first
# Set by Spark in its Python workers' environment when they run task after task
# (spark.python.worker.reuse): a worker that runs one task and exits keeps nothing.
REUSE_ENV = "SPARK_REUSE_WORKER"

# The channels of a KeyedExecutor: kx-<its creator's liveness token, hex>-<n>-tasks|results.
_EXECUTOR_CHANNEL = re.compile(r"kx-([0-9a-f]+)-\d+-(?:tasks|results)")


class Config(NamedTuple):
    """What an executor is started with (what a reused one must match)."""

    workers: int
    max_attempts: int
    task_timeout: float | None


class Lent:
    """A KeyedExecutor and where its tasks' plans are posted (files `<plans><number>`,
    each removed when its task ends)."""

    def __init__(self, config: Config, install: Callable[[str], None]) -> None:
        self.config = config
        # One directory for every process's plans, none per executor: a Python worker
        # killed while idle (as Spark stops idle ones) leaves nothing behind in it.
        os.makedirs(PLANS_DIR, exist_ok=True)
        creator = f"{liveness.current_token():x}"
        self.plans = os.path.join(PLANS_DIR, f"{creator}-{uuid.uuid4().hex[:12]}-")
        self.numbers = itertools.count(1)
        self.executor = KeyedExecutor(
            max_workers=config.workers,
            initializer=install,
            initargs=(self.plans,),
            max_attempts=config.max_attempts,
            task_timeout=config.task_timeout,
        )

    def post(self, plan: Any) -> int:
        """Write `plan` for the workers to load; its number, which the rows carry."""
        number = next(self.numbers)
        path = self.plans + str(number)
        with open(path + ".tmp", "wb") as f:
            pickle.dump(plan, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(path + ".tmp", path)  # a worker sees all of it or nothing
        return number

    def withdraw(self, number: int) -> None:
        try:
            os.unlink(self.plans + str(number))
        except FileNotFoundError:
            pass

    def idle(self) -> bool:
        """Nothing of a task queued or running (every map's results were taken)."""
        s = self.executor.stats()
        return s.queued == 0 and s.running == 0

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


_lock = threading.Lock()
_idle: list[tuple[float, Lent]] = []  # (idle since, executor), oldest first
_reaper: threading.Thread | None = None
_forked_away: list[Any] = []  # a forked child's copies of its parent's executors: not ours
starts = 0  # executors this process started (for tests and the bench)


@contextmanager
def borrowed(config: Config, install: Callable[[str], None]) -> Iterator[Lent]:
    """An executor of `config` for one Spark task: an idle one, else a new one (its
    workers run `install(plan directory)` first). Kept for the next task only if the
    task's `with` block ended normally and the executor has nothing left to run."""
    global starts
    lent = _take(config)
    if lent is not None and not _usable(lent):
        lent.close()
        lent = None
    if lent is None:
        lent = Lent(config, install)  # (a new executor sweeps dead executors' channels)
        starts += 1
    else:
        _sweep_dead_executors()
    _sweep_dead_plans()
    clean = False
    try:
        yield lent
        clean = True
    finally:
        if clean and os.environ.get(REUSE_ENV) and _usable(lent):
            _give_back(lent)
        else:
            lent.close()


def _usable(lent: Lent) -> bool:
    try:
        return lent.idle()
    except Exception:  # its manager failed: not for another task
        return False


def _take(config: Config) -> Lent | None:
    with _lock:
        for i in range(len(_idle) - 1, -1, -1):  # the most recently used first
            if _idle[i][1].config == config:
                return _idle.pop(i)[1]
    return None


def _give_back(lent: Lent) -> None:
    global _reaper
    with _lock:
        _idle.append((time.monotonic(), lent))
        evicted = [e for _, e in _idle[:-MAX_IDLE]]
        del _idle[:-MAX_IDLE]
        if _reaper is None:
            _reaper = threading.Thread(target=_reap, name="shmchan-spark-reaper", daemon=True)
            _reaper.start()
    for e in evicted:
        e.close()


def _reap() -> None:
    """Shut down the executors idle for IDLE_SECONDS; end when none is left idle."""
    global _reaper
    while True:
        time.sleep(IDLE_SECONDS / 4)
        now = time.monotonic()
        with _lock:
            old = [e for since, e in _idle if now - since >= IDLE_SECONDS]
            _idle[:] = [(since, e) for since, e in _idle if now - since < IDLE_SECONDS]
            if not _idle and not old:
                _reaper = None
                return
        for e in old:
            e.close()


def close_idle() -> None:
    """Shut down every idle executor of this process now (also run at exit)."""
    with _lock:
        idle = [e for _, e in _idle]
        _idle.clear()
    for e in idle:
        e.close()


def _sweep_dead_executors() -> None:
    """Unlink the channels of executors whose creating process died."""
    for name in list_channels():
        m = _EXECUTOR_CHANNEL.fullmatch(name)
        if m and not liveness.is_alive(int(m.group(1), 16)):
            try:
                unlink(name)
            except ChannelNotFound:
                pass  # another process removed it first


def _sweep_dead_plans() -> None:
    """Remove the plan files of tasks whose process died (killed mid-task)."""
    try:
        names = os.listdir(PLANS_DIR)
    except FileNotFoundError:
        return
    for name in names:
        creator = name.partition("-")[0]
        try:
            dead = not liveness.is_alive(int(creator, 16))
        except ValueError:
            continue  # not a plan file
        if dead:
            try:
                os.unlink(os.path.join(PLANS_DIR, name))
            except FileNotFoundError:
                pass  # another process removed it first


def _forget_after_fork() -> None:
    global _lock, _reaper, starts
    _lock = threading.Lock()  # another thread may have held it at the fork
    _forked_away.extend(_idle)  # kept referenced: dropping them would shut them down
    _idle.clear()
    _reaper = None
    starts = 0


atexit.register(close_idle)
os.register_at_fork(after_in_child=_forget_after_fork)
