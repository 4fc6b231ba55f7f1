"""KeyedExecutor: a concurrent.futures.Executor whose tasks carry keys (see the
package docstring for its data flow)."""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import pickle
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import CancelledError, Executor, Future, InvalidStateError
from typing import Any

from _shmchan_chunks import one_key_chunks, pick, scatter

from .. import errors, liveness, remote
from ..channel import Channel, Handle, adopt, split_hand_over
from .common import (
    BATCH,
    CHUNK_BATCH,
    DEFAULT_CAPACITY,
    TICK,
    InitializerFailed,
    as_keys,
    check_map_keys,
    check_submit_keys,
    exit_status,
    get_context,
    name_of,
    new_channel_stem,
    pickle_part,
    reap_dead_executors,
)
from .progress import ProgressBar
from .protocol import (
    CALL,
    CHUNK,
    CHUNK_STAR,
    EXIT_INIT_FAILED,
    EXIT_PARENT_GONE,
    ONE,
    RAISED,
    READY,
    RESULT_HEADER,
    RUNNING,
    SLOT,
    STAR,
    TASK_HEADER,
    WAKE_TASK,
)
from .stats import ExecutorStats
from .worker import executor_worker
from .workerset import WorkerProcess, WorkerSet

_ONE_KEY = frozenset({int, str, bytes})  # the types of a value that is one key
# New workers that may die in a row, per worker slot, before running any task (killed
# by a signal in the initializer, say) before the executor counts itself broken (only
# when it has an initializer: without one, deaths are never its own).
_EARLY_DEATHS = 3
# Seconds a worker runs one task before the tasks waiting in its hands may be taken
# back for an idle worker (see _Core.rebalance).
_STEAL_AFTER = 0.1

log = logging.getLogger("shmchan.pool")


class _Pending:
    """The mark of a map result not yet there."""


_PENDING = _Pending()


class _Raised:
    """A map result that is an exception."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _MapBatch:
    """The results of one map() call, filled in by the manager, read in order by the
    caller's iterator (lighter than a Future per item)."""

    __slots__ = (
        "results", "cond", "waiting", "closed", "owners", "ready", "raised_at", "_order",
        "_firsts", "_done", "_next", "dropped",
    )  # fmt: skip

    def __init__(self, n: int, owners: list[list[int]] | None = None) -> None:
        self.results: list[Any] = [_PENDING] * n
        self.cond = threading.Condition(threading.Lock())
        self.waiting = -1  # the index the caller waits for
        self.closed = False  # the iterator was closed: run nothing more of it
        self.dropped: Any = None  # the finalizer of an iterator dropped before it started
        self.owners = owners  # in chunks: the items of chunk i are owners[i]
        # In chunks, results[:ready] are all there and none before raised_at is an
        # exception, so that the caller can take them as a block. `ready` is the first
        # item of the first chunk, in the order of first items, not yet resolved.
        self.ready = 0
        self.raised_at = n
        if owners is not None:
            self._order = sorted(range(len(owners)), key=lambda c: owners[c][0])
            self._firsts = [owners[c][0] for c in self._order]
            self._done = bytearray(len(owners))
            self._next = 0

    def resolve(self, index: int, value: Any) -> None:
        """Manager side: result `index` is `value` (a _Raised for an exception)."""
        self.results[index] = value
        if self.waiting == index:
            with self.cond:
                self.cond.notify()

    def resolve_chunk(self, chunk: int, values: list[Any], raised: int | None) -> None:
        """Manager side: the results of chunk `chunk`'s items, in order; `raised` is the
        first item whose value is a _Raised, if any."""
        assert self.owners is not None
        results = self.results
        scatter(results, self.owners[chunk], values)
        if raised is not None:
            self.raised_at = min(self.raised_at, raised)
        done, order, p = self._done, self._order, self._next
        done[chunk] = 1
        while p < len(order) and done[order[p]]:
            p += 1
        self._next = p
        self.ready = self._firsts[p] if p < len(order) else len(results)
        if self.waiting >= 0:  # (the caller checks again which one it waits for)
            with self.cond:
                self.cond.notify()

    def wait(self, index: int, deadline: float | None) -> Any:
        """Caller side: wait for result `index` (TimeoutError past `deadline`)."""
        with self.cond:
            self.waiting = index
            try:
                while (value := self.results[index]) is _PENDING:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError
                    self.cond.wait(left)
            finally:
                self.waiting = -1
        return value


class _Task:
    """A submitted call, from submit until it is resolved: a future (submit) or one
    slot of a map() batch.

    Its states, changed only under the core's lock: queued (in the task channel or the
    manager's hands), handed (given to a worker that has not adopted it: `handed` says
    where, and the manager can still take it back), started (a worker adopted it; a
    task that runs again after its worker died stays started), cancelled (it never
    runs). A task leaves the core's `tasks` once resolved or cancelled."""

    __slots__ = (
        "future", "batch", "index", "fn", "keys", "tid", "started", "cancelled", "handed",
        "deaths", "last_death", "timed_out",
    )  # fmt: skip

    def __init__(
        self,
        fn: object,
        keys: tuple[Any, ...],
        future: _Future | None,
        batch: _MapBatch | None = None,
        index: int = 0,
    ) -> None:
        self.future = future
        self.batch = batch
        self.index = index  # the batch slot (a map item), or the chunk (batch.owners)
        self.fn = fn
        self.keys = keys
        self.tid = 0
        self.started = False  # a worker adopted it (it runs or ran)
        self.cancelled = False  # it never runs
        # While given to a worker that has not adopted it: (its entry in the worker's
        # `given`, the hand-over's bytes, its place in them).
        self.handed: tuple[list[Any], bytes, int] | None = None
        self.deaths = 0  # workers that died while running it
        self.last_death = ""
        self.timed_out = False  # the last death was a task_timeout kill

    def resolve_cancelled(self) -> None:
        """After the core cancelled it (outside the core's lock: callbacks run here)."""
        self.fn = None  # (the caller may keep the future: it must not keep fn alive)
        if self.future is not None:
            Future.cancel(self.future)
            # CANCELLED -> CANCELLED_AND_NOTIFIED, as an executor does: what waits on it
            # in concurrent.futures.wait() or as_completed() hears of it only then.
            self.future.set_running_or_notify_cancel()
        else:
            self._resolve_all(_Raised(CancelledError()))

    def set_result(self, value: Any) -> None:
        self.fn = None
        if self.future is not None:
            self.future.set_result(value)
        elif self.batch is None:
            pass
        elif self.batch.owners is not None:  # a chunk: (values, failed), see protocol.py
            values, failed = value
            raised = None
            if failed:
                for i in failed:
                    values[i] = _Raised(remote.unpack(values[i]))
                raised = self.batch.owners[self.index][min(failed)]
            self.batch.resolve_chunk(self.index, values, raised)
        else:
            self.batch.resolve(self.index, value)

    def set_exception(self, exc: BaseException) -> None:
        self.fn = None
        if self.future is not None:
            if not self.future.done():
                self.future.set_exception(exc)
        else:
            self._resolve_all(_Raised(exc))

    def _resolve_all(self, value: _Raised) -> None:
        batch = self.batch
        if batch is not None:
            for index in [self.index] if batch.owners is None else batch.owners[self.index]:
                batch.resolve(index, value)


class _Future(Future):  # type: ignore[type-arg]  # (Future is generic only in stubs)
    """A KeyedExecutor's future. cancel() succeeds until a worker has started the task
    (it takes the task back from a worker that holds it unstarted). A done-callback run
    by the manager thread that raises, whatever it raises, is logged: it must not stop
    the thread that resolves every other future."""

    def __init__(self, core: _Core) -> None:
        super().__init__()
        self._kx_core = core
        self._kx_task: _Task | None = None

    def cancel(self) -> bool:
        task = self._kx_task
        if task is None:
            return super().cancel()
        return self._kx_core.cancel([task]) == 1 or self.cancelled()

    def add_done_callback(self, fn: Callable[[Future[Any]], object]) -> None:
        core = self._kx_core

        def guarded(future: Future[Any]) -> None:
            try:
                fn(future)
            except BaseException:
                if threading.current_thread() is not getattr(core, "thread", None):
                    raise
                log.exception("shmchan.KeyedExecutor: a done-callback of %r raised", future)

        super().add_done_callback(guarded)


class _Core:
    """Everything a KeyedExecutor owns; the manager thread runs `run`."""

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
        self.tasks: dict[int, _Task] = {}
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
        self.dropped_maps: list[list[_Task]] = []  # see drop_map
        self.terminate_at = 0.0
        self.seen_running: dict[int, int] = {}  # worker slot -> its RUNNING word, last seen
        self.timeout_kills: dict[int, int] = {}  # worker pid -> seq of the task it overran
        # Task messages sent from the manager thread (by a done-callback) that found the
        # task channel full: the manager is what empties it, so it must not wait for
        # room; it sends them, in order, as room appears (see post() and flush()).
        self.backlog: collections.deque[tuple[int, bytes, tuple[Any, ...]]] = collections.deque()
        self.drained = threading.Condition(self.lock)  # notified when the backlog empties
        self.functions: dict[object, tuple[int, bytes]] = {}  # see pickled()
        self.function_ids = itertools.count(1)
        reap_dead_executors()
        stem = new_channel_stem()
        # A worker adopts a task only when it starts it (until then the manager can take
        # it back), so a task may wait in a worker's hands behind a long one: the
        # manager, not the hand-over deadline, gives back what a dead worker held.
        self.task_ch = Channel.create(
            f"{stem}-tasks", capacity, max_keys=64, max_messages=16384, handover=3600
        )
        try:
            self.result_ch = Channel.create(
                f"{stem}-results", capacity, max_keys=0, max_messages=8192, serializer="raw"
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

    # -- caller side -------------------------------------------------------------------
    def check_open(self) -> None:
        if isinstance(self.broken, InitializerFailed):
            raise InitializerFailed(str(self.broken)) from None
        if self.broken is not None:
            raise errors.Error(f"KeyedExecutor's manager failed: {self.broken!r}") from self.broken
        if self.shutdown_requested:
            raise RuntimeError("cannot schedule new futures after shutdown")

    def pickled(self, fn: object) -> tuple[int, bytes]:
        """(the function's id, pickle(fn)); remembered for plain functions, which pickle
        by reference (so their pickle never changes), not for objects, which pickle
        their state: each of their pickles gets a new id (see protocol.py)."""
        plain = type(fn) in (types.FunctionType, types.BuiltinFunctionType)
        got = self.functions.get(fn) if plain else None
        if got is None:
            got = (next(self.function_ids), pickle_part(fn, "the function", fn))
            if plain:
                if len(self.functions) >= 256:
                    self.functions.clear()
                self.functions[fn] = got
        return got

    def submit(
        self, fn: object, args: tuple[Any, ...], kwargs: dict[str, Any], keys: object
    ) -> Future[Any]:
        """One call: the lean path of KeyedExecutor.submit."""
        fid, blob = self.pickled(fn)
        body = pickle_part((args, kwargs), "the arguments", fn)
        keys = as_keys(keys)
        future = _Future(self)
        task = future._kx_task = _Task(fn, keys, future)
        with self.lock:
            self.check_open()
            tid = task.tid = self.next_tid
            self.next_tid = tid + 1
            self.tasks[tid] = task
        message = TASK_HEADER.pack(tid, fid, len(blob), CALL) + blob + body
        try:
            if self.backlog or threading.current_thread() is self.thread:
                if self.post([(tid, message, keys)]):
                    return future
            self.tx.send(message, keys=keys)
        except BaseException as e:
            self.tasks.pop(tid, None)
            self.explain(e)
            self.check_open()  # broken meanwhile: say why rather than "closed"
            raise
        if self.sleeping:
            self.wake()
        return future

    def submit_many(
        self,
        fn: Callable[..., Any],
        kind: int,
        args: list[Any],
        keys: list[tuple[Any, ...]],
        batch: _MapBatch,
    ) -> list[_Task]:
        """A map's tasks: fn over each of `args` (the body of a `kind` message, see
        protocol.py) with keys[i], one send_many per BATCH of them; task i fills slot i
        of `batch`, or for a chunk the slots batch.owners[i]."""
        out: list[_Task] = []
        fid, blob = self.pickled(fn)
        head = TASK_HEADER.pack
        nblob = len(blob)
        dumps = pickle.dumps
        # Chunks go out a few at a time, so that the workers start on the first ones
        # while the rest are pickled.
        step = BATCH if batch.owners is None else CHUNK_BATCH
        for start in range(0, len(args), step):
            part = args[start : start + step]
            part_keys = keys[start : start + step]
            try:
                bodies = [dumps(a, 5) for a in part]
            except Exception:
                for a in part:  # which one, said as submit says it
                    pickle_part(a, "the arguments", fn)
                raise
            tasks = [_Task(fn, k, None, batch, i) for i, k in enumerate(part_keys, start)]
            with self.lock:
                self.check_open()
                first = self.next_tid
                self.next_tid += len(tasks)
                for tid, task in enumerate(tasks, first):
                    task.tid = tid
                self.tasks.update(zip(range(first, first + len(tasks)), tasks, strict=True))
            messages = [
                (tid, head(tid, fid, nblob, kind) + blob + body, k)
                for tid, body, k in zip(itertools.count(first), bodies, part_keys)
            ]
            try:
                if not (
                    (self.backlog or threading.current_thread() is self.thread)
                    and self.post(messages)
                ):
                    self.tx.send_many([(m, k) for _, m, k in messages])
            except BaseException as e:
                for tid in range(first, first + len(tasks)):
                    self.tasks.pop(tid, None)
                self.cancel(out)
                self.explain(e)
                raise
            self.wake()
            out += tasks
        return out

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

    def cancel(self, tasks: Iterable[_Task]) -> int:
        """Cancel each of `tasks` that no worker has started (any thread); how many of
        them are cancelled now. A task handed to a worker that has not adopted it is
        taken back by adopting it here: the core lets exactly one adoption win, so
        either the worker never runs it, or it runs and the task counts as started."""
        done: list[_Task] = []
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

    def mark_started(self, task: _Task) -> None:
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

    # -- the manager thread ------------------------------------------------------------
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

    def wake(self) -> None:
        """Called after a send into the task channel: wake a manager waiting for results."""
        if self.sleeping:
            self.sleeping = False
            self.wake_tx.send(b"")

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
        arrived: list[tuple[_Task, int, int, int]] = []  # task, status, start, end
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
        stopped: list[_Task] = []
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

    def drop_map(self, tasks: list[_Task]) -> None:
        """A map iterator was dropped before its first item (any thread, at garbage
        collection, maybe with the lock held: the manager cancels its tasks)."""
        self.dropped_maps.append(tasks)
        with contextlib.suppress(errors.Error):
            self.wake()

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
        failed: list[_Task] = []
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

    def fail(self, task: _Task) -> None:
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
        _live_cores.discard(self)

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


_live_cores: weakref.WeakSet[_Core] = weakref.WeakSet()


def _at_exit() -> None:
    # Before the interpreter joins the manager threads: let them finish and clean up,
    # unless the program is ending by Ctrl-C (the interpreter keeps the uncaught
    # exception in sys.last_value): then stop them now, as the `with` block's exit does.
    interrupted = isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
    for core in list(_live_cores):
        core.request_shutdown(cancel_futures=interrupted, terminate=interrupted)


getattr(threading, "_register_atexit")(_at_exit)  # noqa: B009 - private, as concurrent.futures
# A forked child (a fork-started worker, any os.fork) inherits copies of this process's
# executors, their locks as they were at the fork: they are not its own, and its exit
# (multiprocessing runs the threading at-exit hooks) must not try to shut them down.
os.register_at_fork(after_in_child=_live_cores.clear)


def _key_tuples(raw: list[Any]) -> list[tuple[Any, ...]]:
    """Each item's keys as a tuple, from what `keys(item)` gave."""
    if set(map(type, raw)) <= _ONE_KEY:  # the usual case: one key each
        return [(k,) for k in raw]
    return [as_keys(k) for k in raw]


def _chunks(key_lists: list[tuple[Any, ...]], size: int) -> list[list[int]]:
    """Group item indices into chunks of at most `size` items with the same keys, listed
    in an order that keeps every key's items in input order.

    A chunk stays open while items with its keys arrive; an item whose keys meet an open
    chunk of other keys closes that chunk first (so open chunks never share a key, and a
    chunk is listed before any later item on its keys)."""
    out: list[list[int]] = []
    open_: dict[frozenset[Any], list[int]] = {}
    holder: dict[Any, frozenset[Any]] = {}  # key -> the open chunk that has it

    def close(keys: frozenset[Any]) -> None:
        out.append(open_.pop(keys))
        for k in keys:
            del holder[k]

    for i, keys in enumerate(key_lists):
        mine = frozenset(keys)
        for k in mine:
            other = holder.get(k)
            if other is not None and other != mine:
                close(other)
        chunk = open_.get(mine)
        if chunk is None:
            chunk = open_[mine] = []
            for k in mine:
                holder[k] = mine
        chunk.append(i)
        if len(chunk) >= size:
            close(mine)
    for leftover in list(open_):
        close(leftover)
    return out


class KeyedExecutor(Executor):
    """A concurrent.futures.Executor whose tasks carry keys: tasks sharing a key never
    run at the same time and run in submission order; a worker that dies is replaced and
    its task runs again (see the module docstring and the worker pools guide)."""

    def __init__(
        self,
        max_workers: int | None = None,
        mp_context: Any = None,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        max_attempts: int = 3,
        task_timeout: float | None = None,
        max_tasks_per_child: int | None = None,
        *,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        if max_workers is None:
            max_workers = len(os.sched_getaffinity(0)) or 1
        for what, value in (("max_workers", max_workers), ("max_attempts", max_attempts)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{what} must be greater than 0 (an int), got {value!r}")
        if max_tasks_per_child is not None and (
            not isinstance(max_tasks_per_child, int) or max_tasks_per_child < 1
        ):
            raise ValueError(
                f"max_tasks_per_child must be a positive int or None, got {max_tasks_per_child!r}"
            )
        if task_timeout is not None and not task_timeout > 0:
            raise ValueError(
                f"task_timeout must be a positive number of seconds or None, got {task_timeout!r}"
            )
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be callable")
        ctx = get_context(mp_context)  # (an unpicklable initializer fails in Process.start)
        self._max_workers = max_workers
        self._core = _Core(
            max_workers,
            ctx,
            initializer,
            tuple(initargs),
            max_attempts,
            task_timeout,
            max_tasks_per_child,
            capacity,
        )
        _live_cores.add(self._core)
        # An executor dropped without shutdown() finishes its work and cleans up.
        weakref.finalize(self, _Core.request_shutdown, self._core, False)

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, keys: Any = (), **kwargs: Any
    ) -> Future[Any]:
        """Run fn(*args, **kwargs) in a worker once no earlier task with one of `keys`
        is unfinished; a Future of its result.

        `keys` are the task's keys themselves: one str, bytes or int, or a tuple or list
        of them (none by default). It is the executor's argument and never reaches fn:
        to give fn a keyword argument named `keys`, bind it with functools.partial,
        e.g. ``submit(functools.partial(fn, keys=fn_keys), x, keys=("acct:1",))``.
        Inside fn, `shmchan.pool.current()` gives the task's seq, attempt and keys."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        check_submit_keys(keys)
        return self._core.submit(fn, args, kwargs, keys)

    def map(
        self,
        fn: Callable[..., Any],
        *iterables: Iterable[Any],
        keys: Callable[..., Any] | None = None,
        timeout: float | None = None,
        chunksize: int = 1,
        progress: bool = False,
    ) -> Iterator[Any]:
        """Like Executor.map: fn over the items, results lazily in input order.

        `keys` is a function of one item that returns its keys (one str, bytes or int,
        or a tuple or list of them); with several iterables it gets the tuple of items.
        For the same keys on every item, `keys=lambda item: "k"`. With chunksize > 1 a
        task runs that many items in order and holds all their keys. `timeout` counts
        from this call. progress=True draws a progress bar on stderr.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        check_map_keys(keys)
        if not isinstance(chunksize, int) or chunksize < 1:
            raise ValueError(f"chunksize must be a positive int, got {chunksize!r}")
        end = None if timeout is None else time.monotonic() + timeout
        self._core.check_open()
        single = len(iterables) == 1
        items = list(iterables[0]) if single else list(zip(*iterables, strict=False))
        n = len(items)
        raw = None if keys is None else list(map(keys, items))
        owners: list[list[int]] | None = None
        if chunksize == 1:
            args: list[Any] = items
            key_tuples = [()] * n if raw is None else _key_tuples(raw)
            kind = ONE if single else STAR
        else:
            # Items with the same keys share a chunk, so that chunks of different keys
            # still run in parallel (a chunk holds all its items' keys while it runs).
            if raw is None:
                owners = [list(range(i, min(i + chunksize, n))) for i in range(0, n, chunksize)]
                chunk_keys: list[tuple[Any, ...]] = [()] * len(owners)
            else:
                owners = one_key_chunks(raw, chunksize)
                if owners is not None:
                    chunk_keys = [(raw[idxs[0]],) for idxs in owners]
                else:
                    key_lists = [as_keys(k) for k in raw]
                    owners = _chunks(key_lists, chunksize)
                    chunk_keys = [key_lists[idxs[0]] for idxs in owners]
            args = [pick(items, idxs) for idxs in owners]
            key_tuples = chunk_keys
            kind = CHUNK if single else CHUNK_STAR
        del items, raw
        batch = _MapBatch(n, owners)
        tasks = self._core.submit_many(fn, kind, args, key_tuples, batch)
        results = self._results(batch, tasks, end, n if progress else None)
        # An iterator dropped before its first item never ran its `finally` (which
        # cancels what has not started): this does it then.
        batch.dropped = weakref.finalize(results, self._core.drop_map, tasks)
        return results

    def _results(
        self, batch: _MapBatch, tasks: list[_Task], end: float | None, total: int | None
    ) -> Iterator[Any]:
        batch.dropped.detach()  # started: the `finally` below cancels from now on
        bar = None if total is None else ProgressBar(total)
        results = batch.results
        n = len(results)
        index = 0
        try:
            while index < n:
                stop = min(batch.ready, batch.raised_at)
                if stop > index + 1 and bar is None:  # a block, all there: no check per item
                    # Handed out as taken from the deque: the iterator keeps no result
                    # the caller has had (it may drop it and expect it collected).
                    block = collections.deque(results[index:stop])
                    block.append(_PENDING)
                    results[index:stop] = itertools.repeat(None, stop - index)
                    index = stop
                    yield from iter(block.popleft, _PENDING)
                    continue
                value = results[index]
                if value is _PENDING:
                    value = batch.wait(index, end)
                results[index] = None  # the caller has it: do not keep it alive
                index += 1
                if type(value) is _Raised:
                    raise value.exc
                if bar is not None:
                    bar.advance(self._core.retried)
                box = [value]
                del value
                yield box.pop()  # (no local keeps it while the caller has it)
        finally:
            batch.closed = True
            # What has not started will not run (closed, dropped, or interrupted).
            self._core.cancel(t for t in tasks if not t.started and not t.cancelled)
            if bar is not None:
                bar.close()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new tasks; with cancel_futures, cancel those no worker has started (the
        one an idle worker is already taking up still runs, as with ProcessPoolExecutor);
        with wait, return once every task finished and the workers and channels are
        gone. Ctrl-C while waiting stops the executor now (see __exit__)."""
        self._core.request_shutdown(cancel_futures)
        if wait and self._core.thread is not threading.current_thread():
            try:
                self._core.thread.join()
            except KeyboardInterrupt:
                self._core.request_shutdown(True, terminate=True)
                raise

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        """shutdown(wait=True); after a KeyboardInterrupt in the block, first stop: cancel
        what has not started and kill the workers (with task_timeout set, once the
        running tasks end or reach it); the futures of the tasks stopped fail."""
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            # Ctrl-C: leave now. Nothing more starts; the running tasks are stopped (at
            # once, or when they reach task_timeout if one is set) and count as not done.
            self._core.request_shutdown(True, terminate=True)
        self.shutdown(wait=True)

    def stats(self) -> ExecutorStats:
        """Tasks queued, running, done, retried, failed; held keys; the workers."""
        return self._core.stats()
