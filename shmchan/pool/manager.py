"""KeyedExecutor's manager: the one thread that owns the executor's bookkeeping.

Data flow (each channel named for what flows through it):

    caller's threads          manager thread (Manager.run)            worker processes
    (executor.py)

    submit / map: register()
    the tasks, then send()
    task messages with the
    user's keys (protocol.py)
        --> [task channel] -- recv_many: handles whose keys are free and whose
                               predecessors on them finished -->
                                  dispatch / give: handle references (hand_over)
                                      --pipe--> reader thread: inbox
                                                main thread: adopt one, run fn
                              [result channel] <-- result message (task id + value)
                              collect: resolve the futures,        then release the task's
                              release the finished handles         handle: its keys go to
    futures, map results  <--                                      the next task in line
    cancel() -- takes a task back from a worker that has not adopted it (under `lock`)

Every change of a task's state happens here, under `lock`: register (queued), record
(handed to a worker, still revocable), mark_started (a worker adopted it: RUNNING),
cancel (never runs), and the manager thread resolves it (collect, bury, fail, run's
failure path). A task leaves `tasks` only once resolved or cancelled.

A future is RUNNING once a worker adopted its task (the worker adopts each task right
before running it). Until then the task is in transit and cancel() takes it back by
adopting it in the executor's process: the channel lets exactly one adoption win, so a
cancelled task never runs. The same take-back moves the tasks waiting behind a long
task in one worker's hands to an idle worker (rebalance).

Done-callbacks run in the manager thread, which is what empties the task channel: a
submit made there never waits for room in it (what finds it full waits in the manager's
backlog and goes out, in order, as room appears; submits from other threads wait for
that backlog to empty first, so none overtakes it).

A worker that dies (any exit, signal, OOM kill) still holds, or was about to adopt, the
handles it was given. The manager sees the death, nacks them (the channel redelivers
each with attempt + 1 ahead of everything behind it on its keys, so the keys are never
free in between), replaces the worker, and runs them again. The task that was running
when its worker died counts an attempt; after `max_attempts` its future fails with
WorkerDied (TaskTimeout if the last attempt ran past task_timeout) and its handle is
released. Nothing else is lost and the executor keeps working.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import pickle
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import InvalidStateError
from typing import Any

from .. import errors, liveness, remote
from ..channel import Channel, Handle, adopt, split_hand_over
from .common import (
    BATCH,
    TICK,
    InitializerFailed,
    exit_status,
    name_of,
    new_channel_stem,
    reap_dead_executors,
)
from .protocol import (
    EXIT_INIT_FAILED,
    EXIT_PARENT_GONE,
    RAISED,
    READY,
    RESULT_HEADER,
    RUNNING,
    SLOT,
    TASK_HEADER,
    WAKE_TASK,
)
from .stats import ExecutorStats
from .tasks import Task
from .worker import executor_worker
from .workerset import WorkerProcess, WorkerSet

__all__ = ["Manager"]

# New workers that may die in a row, per worker slot, before running any task (killed
# by a signal in the initializer, say) before the executor counts itself broken (only
# when it has an initializer: without one, deaths are never its own).
_EARLY_DEATHS = 3
# Seconds a worker runs one task before the tasks waiting in its hands may be taken
# back for an idle worker (see Manager.rebalance).
_STEAL_AFTER = 0.1

log = logging.getLogger("shmchan.pool")


class Manager:
    """A KeyedExecutor's bookkeeping, its channels and workers, and the thread (`run`)
    that keeps them. The caller's threads come in only through the entry points below
    (register, send, cancel, request_shutdown, ...), which take `lock` for what they
    change; the rest runs in the manager thread."""

    def __init__(
        self,
        max_workers: int,
        ctx: Any,
        initializer: Callable[..., object] | None,
        initargs: tuple[Any, ...],
        max_attempts: int,
        task_timeout: float | None,
        max_tasks_per_child: int | None,
        capacity: int,
    ) -> None:
        self.max_attempts = max_attempts
        self.timeout_ns = None if task_timeout is None else int(task_timeout * 1e9)
        self.task_timeout = task_timeout
        self.lock = threading.Lock()
        self.tasks: dict[int, Task] = {}
        self.next_tid = 1
        self.shutdown_requested = False
        self.broken: BaseException | None = None  # why the manager stopped, if it failed
        self.breaking: InitializerFailed | None = None  # workers cannot start: stop now
        self.early_deaths = 0  # new workers that died in a row before running anything
        self.initializer = initializer
        self.max_workers = max_workers
        self.done = self.retried = self.failed = self.cancelled = 0
        self.sleeping = False  # the manager waits on the result channel (see wake())
        self.spare: list[list[Any]] = []  # [handle, task id] taken, no worker had room yet
        self.reclaimed: list[Handle] = []  # taken back from workers by cancel(): release
        self.terminating = False  # Ctrl-C: stop now (see request_shutdown)
        self.cancel_requested = False  # shutdown(cancel_futures=True): see housekeeping
        self.stolen = 0  # tasks taken back from a busy worker for an idle one, ever
        self.dropped_maps: list[list[Task]] = []  # see drop_map
        self.terminate_at = 0.0
        self.seen_running: dict[int, int] = {}  # worker slot -> its RUNNING word, last seen
        self.timeout_kills: dict[int, int] = {}  # worker pid -> seq of the task it overran
        # Task messages sent from the manager thread (by a done-callback) that found the
        # task channel full: the manager is what empties it, so it must not wait for
        # room; it sends them, in order, as room appears (see post() and flush()).
        self.backlog: collections.deque[tuple[int, bytes, tuple[Any, ...]]] = collections.deque()
        self.drained = threading.Condition(self.lock)  # notified when the backlog empties
        reap_dead_executors()
        stem = new_channel_stem()
        # A worker adopts a task only when it starts it (until then the manager can take
        # it back), so a task may wait in a worker's hands behind a long one: the
        # manager, not the hand-over deadline, gives back what a dead worker held.
        self.task_ch = Channel.create(
            f"{stem}-tasks",
            capacity,
            max_keys=64,
            max_messages=16384,
            handover=3600,
            temporary=True,  # gone with the last of the executor and its workers
        )
        try:
            self.result_ch = Channel.create(
                f"{stem}-results",
                capacity,
                max_keys=0,
                max_messages=8192,
                serializer="raw",
                temporary=True,
            )
        except BaseException:
            self._unlink(self.task_ch)
            raise
        try:
            self.tx = self.task_ch.sender()
            self.wake_tx = self.result_ch.sender()
            self.rx_tasks = self.task_ch.receiver()
            self.rx_results = self.result_ch.receiver()
            self.workers = WorkerSet(
                ctx,
                max_workers,
                executor_worker,
                (self.result_ch.name, liveness.current_token(), initializer, initargs),
                max_tasks_per_child,
            )
            self.workers.start_all()
        except BaseException:
            self.teardown()
            raise
        self.thread = threading.Thread(target=self.run, name="shmchan-KeyedExecutor", daemon=False)
        self.thread.start()
        _live_managers.add(self)

    # -- entry points for the caller's threads (also used by the manager thread) --------
    def check_open(self) -> None:
        """Raise what submit and map raise once the executor takes no new tasks."""
        if isinstance(self.broken, InitializerFailed):
            raise InitializerFailed(str(self.broken)) from None
        if self.broken is not None:
            raise errors.Error(f"KeyedExecutor's manager failed: {self.broken!r}") from self.broken
        if self.shutdown_requested:
            raise RuntimeError("cannot schedule new futures after shutdown")

    def register(self, tasks: list[Task]) -> int:
        """Give `tasks` consecutive ids and enter them in `tasks` (check_open() first,
        under the lock: a submit either sees `broken` or has its tasks in the list, which
        run() fails); the first id."""
        with self.lock:
            self.check_open()
            first = self.next_tid
            self.next_tid = first + len(tasks)
            for tid, task in enumerate(tasks, first):
                task.tid = tid
            self.tasks.update(zip(range(first, first + len(tasks)), tasks, strict=True))
        return first

    def forget(self, first: int, n: int) -> None:
        """Take back register()'s entries of tasks whose messages could not be sent."""
        for tid in range(first, first + n):
            self.tasks.pop(tid, None)

    def send(self, messages: list[tuple[int, bytes, tuple[Any, ...]]]) -> None:
        """Send (task id, task message, keys) into the task channel, in order, then wake
        the manager if it sleeps. From the manager thread (a done-callback's submit)
        nothing waits for room: see post()."""
        if self.backlog or threading.current_thread() is self.thread:
            if self.post(messages):
                return
        if len(messages) == 1:
            _, message, keys = messages[0]
            self.tx.send(message, keys=keys)
        else:
            self.tx.send_many([(m, k) for _, m, k in messages])
        if self.sleeping:
            self.wake()

    def post(self, messages: list[tuple[int, bytes, tuple[Any, ...]]]) -> bool:
        """Send (task id, message, keys) without waiting for room if this is the manager
        thread (what finds no room goes to the backlog); True if done. In another thread
        while the backlog holds messages: wait until it is sent, then False (the caller
        sends as usual), so that a later submit never overtakes an earlier one."""
        if threading.current_thread() is not self.thread:
            with self.lock:
                while self.backlog and self.broken is None and self.thread.is_alive():
                    self.drained.wait(TICK)
            return False
        if not self.backlog:
            try:
                self.tx.send_many([(m, k) for _, m, k in messages], timeout=0)
                return True
            except errors.Full as e:
                messages = messages[len(e.seqs) :]
        self.backlog.extend(messages)
        return True

    def flush(self) -> bool:
        """Manager thread: send what the backlog holds, in order, while the task channel
        has room; False if none went. A message that cannot be sent at all fails its
        task, as it would have failed its submit."""
        backlog, sent = self.backlog, False
        while backlog:
            tid, message, keys = backlog[0]
            try:
                self.tx.send(message, keys=keys, timeout=0)
            except errors.Full:
                break
            except errors.Error as e:
                task = self.tasks.pop(tid, None)
                if task is not None:
                    try:
                        self.explain(e)
                    except errors.Error as explained:
                        e = explained
                    with contextlib.suppress(InvalidStateError):
                        task.set_exception(e)
                        self.failed += 1
            backlog.popleft()
            sent = True
        if sent and not backlog:
            with self.lock:
                self.drained.notify_all()
        return sent

    def explain(self, e: BaseException) -> None:
        """A task too large for the task channel: say how to make room."""
        if isinstance(e, errors.MessageTooLarge):
            raise errors.MessageTooLarge(
                f"{e}; a KeyedExecutor's channels hold {self.task_ch.capacity} bytes "
                "each: pass capacity= for larger tasks and results"
            ) from None

    def cancel(self, tasks: Iterable[Task]) -> int:
        """Cancel each of `tasks` that no worker has started (any thread); how many of
        them are cancelled now. A task handed to a worker that has not adopted it is
        taken back by adopting it here: the core lets exactly one adoption win, so
        either the worker never runs it, or it runs and the task counts as started."""
        done: list[Task] = []
        count = 0
        with self.lock:
            for task in tasks:
                if task.cancelled:
                    count += 1
                    continue
                if task.started or self.tasks.get(task.tid) is not task:
                    continue  # running, or resolved
                if task.handed is not None:
                    entry, data, i = task.handed
                    h = self.take_back(data, i)
                    if h is None:  # the worker adopted it first: it runs
                        self.mark_started(task)
                        continue
                    entry[0] = None  # the worker skips it; its copy is not ours to release
                    task.handed = None
                    self.reclaimed.append(h)
                task.cancelled = True
                del self.tasks[task.tid]
                self.cancelled += 1
                done.append(task)
                count += 1
        for task in done:
            task.resolve_cancelled()
        if self.reclaimed and self.sleeping:
            with contextlib.suppress(errors.Error):
                self.wake()
        return count

    @staticmethod
    def take_back(data: bytes, i: int) -> Handle | None:
        """Adopt the i-th handle of a hand-over back into this process; None if a worker
        adopted it first (or it is gone: released, redelivered)."""
        try:
            h = adopt(split_hand_over(data)[i])[0]
            h.data  # noqa: B018 - a no-op handle (adopted elsewhere first) raises Closed
        except (errors.HandoverExpired, errors.Closed):
            return None
        return h

    def mark_started(self, task: Task) -> None:
        """Under the lock: a worker adopted `task`; its future says RUNNING from now on."""
        task.started = True
        task.handed = None
        f = task.future
        if f is not None and not f.running() and not f.done():
            f.set_running_or_notify_cancel()

    def request_shutdown(self, cancel_futures: bool, terminate: bool = False) -> None:
        """No new tasks; with cancel_futures, cancel those not started. terminate (a
        KeyboardInterrupt in the caller): also stop the running ones, the workers are
        killed now (with a task_timeout, once the running tasks end or reach it), and
        their futures fail."""
        with self.lock:
            self.shutdown_requested = True
            if terminate and not self.terminating:
                self.terminate_at = time.monotonic() + (self.task_timeout or 0.0)
                self.terminating = True
            self.cancel_requested |= cancel_futures
        if terminate:
            self.cancel(list(self.tasks.values()))
        # Wake a manager waiting for tasks, so that it closes down now rather than at its
        # next tick: a message for task id 0, which no task has, so dispatch drops it. A
        # full task channel needs no wake-up (the manager is busy taking from it). Best
        # effort: without it the manager still notices within its tick.
        with contextlib.suppress(errors.Error):
            self.tx.send(WAKE_TASK, timeout=0)
            self.wake()

    def wake(self) -> None:
        """Called after a send into the task channel: wake a manager waiting for results."""
        if self.sleeping:
            self.sleeping = False
            self.wake_tx.send(b"")

    def drop_map(self, tasks: list[Task]) -> None:
        """A map iterator was dropped before its first item (any thread, at garbage
        collection, maybe with the lock held: the manager cancels its tasks)."""
        self.dropped_maps.append(tasks)
        with contextlib.suppress(errors.Error):
            self.wake()

    # -- the manager thread --------------------------------------------------------------
    def run(self) -> None:
        try:
            self.loop()
        except BaseException as e:
            failure = (
                e
                if isinstance(e, InitializerFailed)
                else errors.Error(f"KeyedExecutor's manager failed: {e!r}")
            )
            # Under the lock: a submit either sees `broken` or has its task in the list.
            with self.lock:
                self.broken = e
                tasks = list(self.tasks.values())
                self.tasks.clear()
            for task in tasks:  # (a task stays in the list until it is resolved)
                try:  # (not settle(): this must hold whatever failed before)
                    task.set_exception(failure)
                except BaseException:  # noqa: S110 - cancelled meanwhile, or a callback
                    pass
        finally:
            self.teardown()

    def settle(self, how: Callable[[Any], None], value: Any) -> bool:
        """Resolve a task by how(value); whatever that raises (InvalidStateError: it was
        cancelled meanwhile; anything a done-callback raised past its guard) is logged,
        never the end of the manager. False if it raised."""
        try:
            how(value)
            return True
        except InvalidStateError:
            return False
        except BaseException:
            log.exception("shmchan.KeyedExecutor: resolving a future raised")
            return False

    def loop(self) -> None:
        next_check = 0.0
        while True:
            if self.breaking is not None:
                raise self.breaking
            while self.dropped_maps:
                self.cancel(t for t in self.dropped_maps.pop() if not t.started)
            busy = self.collect(0)
            busy |= self.dispatch(0)
            if self.backlog:
                busy |= self.flush()
            if self.reclaimed:
                self.release_reclaimed()
            self.note_running()
            now = time.monotonic()
            if now >= next_check or self.shutdown_requested:
                next_check = now + TICK
                if self.housekeeping():
                    return
            if busy:
                continue
            if self.workers.outstanding():
                # Results (and with them free keys: we release a task's handle when its
                # result arrives) come on the result channel; a submit that finds us
                # sleeping there sends an empty wake-up message (see wake()).
                self.sleeping = True
                try:
                    if not self.dispatch(0):
                        self.collect(TICK)
                finally:
                    self.sleeping = False
            elif self.workers.capacity():
                self.dispatch(TICK)  # only a submit can bring work now
            else:
                time.sleep(0.001)  # every worker is being replaced

    def release_reclaimed(self) -> None:
        """Release the handles cancel() took back: their keys go to the next in line."""
        with self.lock:
            hs, self.reclaimed = self.reclaimed, []
        self.rx_tasks.release_many(hs)

    def note_running(self) -> None:
        """Mark the tasks the workers are running now as started (their futures say
        RUNNING; one that ran between two looks is marked by its result)."""
        words, seen = self.workers.words, self.seen_running
        for w in self.workers.slots:
            if w is None:
                continue
            word = words[SLOT * w.index + RUNNING]
            if word == seen.get(w.index, 0):
                continue
            seen[w.index] = word
            if not word:
                continue
            for entry in w.given:
                h = entry[0]
                if h is not None and h.seq == word - 1:
                    task = self.tasks.get(entry[1])
                    if task is not None and not task.started:
                        with self.lock:
                            self.mark_started(task)
                    break

    def collect(self, timeout: float, dispatch: bool = True) -> bool:
        """Resolve the futures of the results that arrived; False if none did. With
        `dispatch`, the tasks their results free go to the workers first (see below)."""
        try:
            b = self.rx_results.recv_batch(BATCH, timeout=timeout)
        except errors.Empty:
            return False
        with b:  # results are copied out at once: their space goes back to the workers
            data = memoryview(b.joined())
            lengths = b.lengths.tolist()
        header, unpack = RESULT_HEADER.size, RESULT_HEADER.unpack_from
        counts: dict[int, int] = {}  # worker pid -> its FINISHED count in its last result
        tasks = self.tasks
        arrived: list[tuple[Task, int, int, int]] = []  # task, status, start, end
        seen: set[int] = set()
        end = 0
        if lengths:
            self.early_deaths = 0  # workers do start
        for size in lengths:
            start, end = end, end + size
            if size < header:
                continue  # wake()'s empty message
            tid, _seq, pid, counts[pid], status = unpack(data, start)
            task = tasks.get(tid)
            # (None, or seen: a second result of a task that ran again)
            if task is not None and tid not in seen:
                seen.add(tid)
                arrived.append((task, status, start + header, end))
        if arrived:
            with self.lock:
                for task, *_ in arrived:
                    if not task.started:
                        self.mark_started(task)
        finished: list[Handle] = []
        by_pid = self.workers.by_pid
        for pid, count in counts.items():
            w = by_pid.get(pid)
            if w is not None:
                w.catch_up(count, finished)
        # The worker releases a task's handle right after sending its result; releasing
        # it here too (a no-op for whichever comes second) frees its keys at once, and
        # the tasks next in line on them go to the workers before the caller hears of
        # these results (they are on their way, and still cancellable until adopted).
        if finished:
            self.rx_tasks.release_many(finished)
        if dispatch:
            self.dispatch(0)
        # Each task leaves `tasks` only once resolved: should the manager fail midway,
        # run() fails every one still there.
        for task, status, start, end in arrived:
            try:
                if status == RAISED:
                    value = remote.unpack(data[start:end])
                else:
                    value = pickle.loads(data[start:end])
            except Exception as e:
                status, value = RAISED, remote.unreadable_result(task.fn, e)
            except BaseException as e:  # (SystemExit from a __reduce__: not the manager's)
                failure = errors.Error(f"the task's result could not be unpickled: {e!r}")
                failure.__cause__ = e
                status, value = RAISED, failure
            if status == RAISED:
                self.settle(task.set_exception, value)
                self.failed += 1
            else:
                batch = task.batch
                if batch is not None and batch.owners is None:  # a map item, inline
                    batch.results[task.index] = value
                    if batch.waiting == task.index:
                        with batch.cond:
                            batch.cond.notify()
                else:
                    self.settle(task.set_result, value)
                self.done += 1
            tasks.pop(task.tid, None)
        return True

    def dispatch(self, timeout: float) -> bool:
        """Take tasks whose keys are free and hand them to workers; False if none came."""
        room = self.workers.capacity()
        if self.spare:
            if room <= 0:
                return False
            spare, self.spare = self.spare, []
            self.give(spare)
            return True
        if room <= 0:
            return False
        try:
            hs = self.rx_tasks.recv_many(min(room, BATCH), timeout=timeout)
        except errors.Empty:
            return False
        if any(h.attempt > 1 for h in hs):
            # Redelivered: maybe its worker died. Count that death before running it again.
            self.reap()
        self.give([[h, TASK_HEADER.unpack_from(h.data)[0]] for h in hs])
        return True

    def give(self, entries: list[list[Any]]) -> None:
        """Hand [handle, task id] entries to the workers (those no worker has room for
        wait in `spare`); drop those whose task is resolved or cancelled. Under the lock,
        so that cancel() sees each task either not handed (then it is dropped here) or
        handed with its hand-over bytes (then it can take it back)."""
        drop: list[Handle] = []
        out: list[list[Any]] = []
        stopped: list[Task] = []
        tasks = self.tasks
        with self.lock:
            for entry in entries:
                task = tasks.get(entry[1])
                if task is None:  # resolved already (failed for good, ran twice, cancelled)
                    drop.append(entry[0])
                elif self.terminating:  # nothing more runs; a started task did not finish
                    del tasks[entry[1]]
                    drop.append(entry[0])
                    stopped.append(task)
                else:
                    if task.started:
                        self.retried += 1
                    out.append(entry)
            if out:
                self.spare += self.workers.give(out, self.record)
        for task in stopped:  # (outside the lock: done-callbacks run here)
            self.settle(task.set_exception, self.terminated())
            self.failed += 1
        if drop:
            self.rx_tasks.release_many(drop)

    def record(self, entries: list[list[Any]], data: bytes) -> None:
        """workers.give's note of a hand-over (under the lock): where each task went."""
        tasks = self.tasks
        for i, entry in enumerate(entries):
            task = tasks.get(entry[1])
            if task is not None and not task.started:
                task.handed = (entry, data, i)

    def terminated(self) -> errors.Error:
        return errors.Error(
            "KeyedExecutor was stopped by KeyboardInterrupt before this task finished "
            "(its worker was terminated)"
        )

    def housekeeping(self) -> bool:
        """Timeouts, deaths, replacements; True once the executor may close down."""
        workers = self.workers
        finished = workers.refresh()
        if finished:
            self.rx_tasks.release_many(finished)
        if self.timeout_ns is not None:
            now = time.monotonic_ns()
            for w in workers.live():
                run = workers.running(w)
                if run is not None and now - run[1] > self.timeout_ns:
                    tid = next((t for h, t in w.given if h is not None and h.seq == run[0]), None)
                    task = self.tasks.get(tid) if tid is not None else None
                    if task is not None:
                        task.timed_out = True
                    self.timeout_kills[w.process.pid] = run[0]
                    w.process.kill()
        if self.terminating and (
            time.monotonic() >= self.terminate_at or not workers.outstanding()
        ):
            workers.shut(kill=True)
            with self.lock:
                left = list(self.tasks.values())
                self.tasks.clear()
            for task in left:
                self.settle(task.set_exception, self.terminated())
                self.failed += 1
            return True
        self.reap()
        self.rebalance()
        if self.cancel_requested:
            self.cancel_requested = False
            self.cancel_unstarted()
        if self.shutdown_requested:
            if not self.tasks and not self.spare and not workers.outstanding():
                return True
        return False

    def rebalance(self) -> None:
        """While a worker is idle, take back the tasks waiting in the hands of a worker
        that has run one task for longer than _STEAL_AFTER, and hand them out again:
        a task waiting behind a long one holds its keys (and the tasks behind those)
        for no reason when another worker could start it now."""
        workers = self.workers
        live = workers.live()
        words = workers.words
        if not any(
            w.taken == w.finished and workers.budget(w) > 0 and not words[SLOT * w.index + RUNNING]
            for w in live
        ):
            return
        limit = time.monotonic_ns() - int(_STEAL_AFTER * 1e9)
        back: list[list[Any]] = []
        with self.lock:
            for w in live:
                run = workers.running(w)
                if run is None or run[1] > limit or len(w.given) < 2:
                    continue
                for entry in list(w.given)[1:]:
                    task = self.tasks.get(entry[1])
                    if task is None or task.handed is None or task.handed[0] is not entry:
                        continue
                    h = self.take_back(task.handed[1], task.handed[2])
                    if h is None:  # it has just started there
                        continue
                    entry[0] = None
                    task.handed = None
                    back.append([h, entry[1]])
        if back:
            self.stolen += len(back)
            self.give(back)

    def cancel_unstarted(self) -> None:
        """shutdown(cancel_futures=True): cancel every task not started, except the one
        an idle worker is picking up (first in its hands: it is starting, as the call a
        ProcessPoolExecutor's worker has taken from its queue is)."""
        starting = set()
        words = self.workers.words
        for w in self.workers.live():
            if not words[SLOT * w.index + RUNNING]:
                first = next((e for e in w.given if e[0] is not None), None)
                if first is not None:
                    starting.add(first[1])
        self.cancel([t for t in list(self.tasks.values()) if t.tid not in starting])

    def bury(self, w: WorkerProcess, code: int | None, running_seq: int | None) -> None:
        """A worker ended: give back what it held; the task it ran counts an attempt.

        Its list may hold two copies of one task: the channel may have redelivered the
        first (dead holder) and we handed the copy to this worker before seeing it dead.
        Giving back a stale copy is a no-op; the death counts once.

        A worker killed for task_timeout may have finished that task and started the
        next one between our look at its RUNNING word and the kill: then the task it
        ran did nothing wrong, and no attempt is counted against it."""
        killed_for = self.timeout_kills.pop(w.process.pid, None)
        if killed_for is not None and killed_for != running_seq:
            running_seq = None
        status = exit_status(code, w.oom)
        give_back: list[Handle] = []
        drop: list[Handle] = []
        counted: set[int] = set()
        failed: list[Task] = []
        with self.lock:  # (against cancel(), which may be taking these back)
            for h, tid in w.given:
                if h is None:  # taken back: not this worker's any more
                    continue
                task = self.tasks.get(tid)
                if task is None:  # resolved: whatever copy this is, nobody must run it
                    drop.append(h)
                    continue
                if task.handed is not None and task.handed[0][0] is h:
                    task.handed = None  # back in the channel: queued again
                if h.seq == running_seq and tid not in counted:
                    counted.add(tid)
                    task.deaths += 1
                    if task.timed_out:
                        status = (
                            f"was killed after running past task_timeout={self.task_timeout:g} s"
                        )
                    task.last_death = f"worker pid {w.process.pid} {status}"
                    if task.deaths >= self.max_attempts:
                        del self.tasks[tid]
                        drop.append(h)  # its keys go to the next in line
                        failed.append(task)
                        continue
                    task.timed_out = False
                give_back.append(h)
            w.given.clear()
        for task in failed:
            self.fail(task)
        if drop:
            self.rx_tasks.release_many(drop)  # a no-op for copies already redelivered
        for h in give_back:
            h.nack()  # redelivered with attempt + 1, ahead of its keys' lines

    def reap(self) -> None:
        """Notice workers that ended and bury them (results they sent first count)."""
        ended = self.workers.ended()
        if ended:
            # Collect without dispatching: the channel may already have redelivered what
            # the dead workers held, and a copy of a task whose death is not counted yet
            # must not go to a worker: its last attempt may have been this one, and then
            # it fails (WorkerDied) and must not run again.
            while self.collect(0, dispatch=False):
                pass
            for w, code, seq in ended:
                self.bury(w, code, seq)
                self.check_start(w, code, seq)
        if self.breaking is not None:
            return  # (no new worker: the loop stops now)
        for i, slot in enumerate(self.workers.slots):
            if slot is None:
                self.workers.start(i)

    def check_start(self, w: WorkerProcess, code: int | None, running_seq: int | None) -> None:
        """A worker ended: if it died before it ran anything, maybe workers cannot start
        at all. Then the manager stops at the top of its loop and run() fails every
        task with InitializerFailed (as a ProcessPoolExecutor breaks): replacing the
        worker again would loop forever and no future would ever finish. Without an
        initializer a worker cannot fail to start by the user's code: however often new
        workers are killed (an operator, the OOM killer, a torture test), the executor
        replaces them and is never broken."""
        if running_seq is not None or w.finished:
            self.early_deaths = 0
            return
        if code == 0 or w.stopping:
            return
        self.early_deaths += 1
        name = name_of(self.initializer)
        status = f"worker pid {w.process.pid} {exit_status(code, w.oom)}"
        ready = self.workers.words[SLOT * w.index + READY]
        if (
            not ready
            and code is not None
            and code > 0
            and code not in (EXIT_INIT_FAILED, EXIT_PARENT_GONE)
        ):
            # It exited by itself before it reached its task loop: it could not start
            # (a worker killed by a signal is not this, and is replaced as usual).
            method = self.workers.ctx.get_start_method()
            hint = (
                "; with the 'spawn' or 'forkserver' start method this is most often a "
                "script that creates the executor when it is imported: each worker "
                "imports the main module again, so the code that creates and uses the "
                'executor must be under `if __name__ == "__main__":`'
                if method != "fork"
                else ""
            )
            why = f"{status} before it started (the worker's traceback says why){hint}"
        elif code == EXIT_INIT_FAILED:
            why = f"the initializer {name}(...) raised ({status}; it logged the traceback)"
        elif self.initializer is not None and self.early_deaths >= _EARLY_DEATHS * self.max_workers:
            why = (
                f"{self.early_deaths} new workers in a row died before running any task "
                f"(initializer {name}), the last one: {status}"
            )
        else:
            return
        self.breaking = InitializerFailed(
            f"KeyedExecutor's workers cannot start: {why}; the executor is broken, its "
            "pending tasks fail and it takes no new ones"
        )

    def fail(self, task: Task) -> None:
        kind = errors.TaskTimeout if task.timed_out else errors.WorkerDied
        task.set_exception(
            kind(
                f"{name_of(task.fn)} with keys {task.keys!r} failed {task.deaths} time(s) "
                f"(max_attempts={self.max_attempts}) because its worker died; "
                f"last time: {task.last_death}"
            )
        )
        self.failed += 1

    def teardown(self) -> None:
        self.backlog.clear()  # (its tasks are resolved: the manager failed, or cancelled)
        with self.lock:
            self.drained.notify_all()
        workers = getattr(self, "workers", None)
        if workers is not None:
            workers.shut(kill=self.broken is not None)
        for name in ("rx_tasks", "rx_results"):
            rx = getattr(self, name, None)
            if rx is not None:
                rx.close()
        for ch in (getattr(self, "task_ch", None), getattr(self, "result_ch", None)):
            if ch is not None:
                self._unlink(ch)
        _live_managers.discard(self)

    @staticmethod
    def _unlink(ch: Channel) -> None:
        try:
            ch.unlink()
        except (errors.ChannelNotFound, errors.Closed):
            pass
        ch.close()

    def stats(self) -> ExecutorStats:
        tasks = list(self.tasks.values())
        # Running: what the workers say they run now (each runs one task at a time).
        workers = self.workers.stats()
        running = min(sum(1 for w in workers if w.state == "busy"), len(tasks))
        try:
            held = self.task_ch.stats().held_keys
        except errors.Closed:
            held = 0
        return ExecutorStats(
            queued=len(tasks) - running,
            running=running,
            done=self.done,
            retried=self.retried,
            failed=self.failed,
            cancelled=self.cancelled,
            held_keys=held,
            workers=workers,
        )


_live_managers: weakref.WeakSet[Manager] = weakref.WeakSet()


def _at_exit() -> None:
    # Before the interpreter joins the manager threads: let them finish and clean up,
    # unless the program is ending by Ctrl-C (the interpreter keeps the uncaught
    # exception in sys.last_value): then stop them now, as the `with` block's exit does.
    interrupted = isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
    for manager in list(_live_managers):
        manager.request_shutdown(cancel_futures=interrupted, terminate=interrupted)


getattr(threading, "_register_atexit")(_at_exit)  # noqa: B009 - private, as concurrent.futures
# A forked child (a fork-started worker, any os.fork) inherits copies of this process's
# executors, their locks as they were at the fork: they are not its own, and its exit
# (multiprocessing runs the threading at-exit hooks) must not try to shut them down.
os.register_at_fork(after_in_child=_live_managers.clear)
