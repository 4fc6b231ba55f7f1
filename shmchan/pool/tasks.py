"""A KeyedExecutor's record of a submitted call (Task), its future (KeyedFuture), and
the results of one map() call (MapBatch).

The manager (manager.py) changes a task's state and resolves it; the caller's threads
create tasks (executor.py) and read a map's results in order. A KeyedFuture holds no
reference to its executor, only to the manager: an executor dropped with futures still
alive shuts down as usual.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, Future
from typing import Any, Protocol

from _shmchan_chunks import scatter

from .. import remote

__all__ = ["PENDING", "KeyedFuture", "MapBatch", "Owner", "Raised", "Task", "new_call"]

log = logging.getLogger("shmchan.pool")


class Owner(Protocol):
    """What a KeyedFuture needs of the manager that owns its task."""

    thread: threading.Thread

    def cancel(self, tasks: Iterable[Task]) -> int: ...


class Pending:
    """The mark of a map result not yet there."""


PENDING = Pending()


class Raised:
    """A map result that is an exception."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class MapBatch:
    """The results of one map() call, filled in by the manager, read in order by the
    caller's iterator (lighter than a Future per item)."""

    __slots__ = (
        "results", "cond", "waiting", "closed", "owners", "ready", "raised_at", "_order",
        "_firsts", "_done", "_next", "dropped",
    )  # fmt: skip

    def __init__(self, n: int, owners: list[list[int]] | None = None) -> None:
        self.results: list[Any] = [PENDING] * n
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
        """Manager side: result `index` is `value` (a Raised for an exception)."""
        self.results[index] = value
        if self.waiting == index:
            with self.cond:
                self.cond.notify()

    def resolve_chunk(self, chunk: int, values: list[Any], raised: int | None) -> None:
        """Manager side: the results of chunk `chunk`'s items, in order; `raised` is the
        first item whose value is a Raised, if any."""
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
                while (value := self.results[index]) is PENDING:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError
                    self.cond.wait(left)
            finally:
                self.waiting = -1
        return value


class Task:
    """A submitted call, from submit until it is resolved: a future (submit) or one
    slot of a map() batch.

    Its states, changed only under the manager's lock (manager.py): queued (in the
    task channel or the manager's hands), handed (given to a worker that has not
    adopted it: `handed` says where, and the manager can still take it back), started
    (a worker adopted it; a task that runs again after its worker died stays started),
    cancelled (it never runs). A task leaves the manager's `tasks` once resolved or cancelled."""

    __slots__ = (
        "future", "batch", "index", "fn", "keys", "tid", "started", "cancelled", "handed",
        "deaths", "last_death", "timed_out",
    )  # fmt: skip

    def __init__(
        self,
        fn: object,
        keys: tuple[Any, ...],
        future: KeyedFuture | None,
        batch: MapBatch | None = None,
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
        """After the manager cancelled it (outside its lock: callbacks run here)."""
        self.fn = None  # (the caller may keep the future: it must not keep fn alive)
        if self.future is not None:
            Future.cancel(self.future)
            # CANCELLED -> CANCELLED_AND_NOTIFIED, as an executor does: what waits on it
            # in concurrent.futures.wait() or as_completed() hears of it only then.
            self.future.set_running_or_notify_cancel()
        else:
            self._resolve_all(Raised(CancelledError()))

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
                    values[i] = Raised(remote.unpack(values[i]))
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
            self._resolve_all(Raised(exc))

    def _resolve_all(self, value: Raised) -> None:
        batch = self.batch
        if batch is not None:
            for index in [self.index] if batch.owners is None else batch.owners[self.index]:
                batch.resolve(index, value)


class KeyedFuture(Future):  # type: ignore[type-arg]  # (Future is generic only in stubs)
    """A KeyedExecutor's future. cancel() succeeds until a worker has started the task
    (it takes the task back from a worker that holds it unstarted). A done-callback run
    by the manager thread that raises, whatever it raises, is logged: it must not stop
    the thread that resolves every other future."""

    def __init__(self, owner: Owner) -> None:
        super().__init__()
        self._kx_owner = owner
        self._kx_task: Task | None = None

    def cancel(self) -> bool:
        task = self._kx_task
        if task is None:
            return super().cancel()
        return self._kx_owner.cancel([task]) == 1 or self.cancelled()

    def add_done_callback(self, fn: Callable[[Future[Any]], object]) -> None:
        owner = self._kx_owner

        def guarded(future: Future[Any]) -> None:
            try:
                fn(future)
            except BaseException:
                if threading.current_thread() is not owner.thread:
                    raise
                log.exception("shmchan.KeyedExecutor: a done-callback of %r raised", future)

        super().add_done_callback(guarded)


def new_call(owner: Owner, fn: object, keys: tuple[Any, ...]) -> tuple[KeyedFuture, Task]:
    """The future of a submit and the task it stands for."""
    future = KeyedFuture(owner)
    task = future._kx_task = Task(fn, keys, future)
    return future, task
