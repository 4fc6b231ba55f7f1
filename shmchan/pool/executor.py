"""KeyedExecutor: a concurrent.futures.Executor whose tasks carry keys; the caller's
side of it (submit, map and its chunks, shutdown). Its manager thread, which owns every
task's bookkeeping, is manager.py; its data flow is drawn there."""

from __future__ import annotations

import collections
import itertools
import os
import pickle
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from typing import Any

from _shmchan_chunks import one_key_chunks, pick

from .common import (
    BATCH,
    CHUNK_BATCH,
    DEFAULT_CAPACITY,
    as_keys,
    check_map_keys,
    check_submit_keys,
    get_context,
    pickle_part,
)
from .manager import Manager
from .progress import ProgressBar
from .protocol import CALL, CHUNK, CHUNK_STAR, ONE, STAR, TASK_HEADER
from .stats import ExecutorStats
from .tasks import PENDING, MapBatch, Raised, Task, new_call

_ONE_KEY = frozenset({int, str, bytes})  # the types of a value that is one key


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
        self._functions: dict[object, tuple[int, bytes]] = {}  # see _pickled()
        self._function_ids = itertools.count(1)
        self._manager = Manager(
            max_workers,
            ctx,
            initializer,
            tuple(initargs),
            max_attempts,
            task_timeout,
            max_tasks_per_child,
            capacity,
        )
        # An executor dropped without shutdown() finishes its work and cleans up.
        weakref.finalize(self, Manager.request_shutdown, self._manager, False)

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
        manager = self._manager
        fid, blob = self._pickled(fn)
        body = pickle_part((args, kwargs), "the arguments", fn)
        task_keys = as_keys(keys)
        future, task = new_call(manager, fn, task_keys)
        tid = manager.register([task])
        message = TASK_HEADER.pack(tid, fid, len(blob), CALL) + blob + body
        try:
            manager.send([(tid, message, task_keys)])
        except BaseException as e:
            manager.forget(tid, 1)
            manager.explain(e)
            manager.check_open()  # broken meanwhile: say why rather than "closed"
            raise
        return future

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
        self._manager.check_open()
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
        batch = MapBatch(n, owners)
        tasks = self._submit_many(fn, kind, args, key_tuples, batch)
        results = self._results(batch, tasks, end, n if progress else None)
        # An iterator dropped before its first item never ran its `finally` (which
        # cancels what has not started): this does it then.
        batch.dropped = weakref.finalize(results, self._manager.drop_map, tasks)
        return results

    def _pickled(self, fn: object) -> tuple[int, bytes]:
        """(the function's id, pickle(fn)); remembered for plain functions, which pickle
        by reference (so their pickle never changes), not for objects, which pickle
        their state: each of their pickles gets a new id (see protocol.py)."""
        plain = type(fn) in (types.FunctionType, types.BuiltinFunctionType)
        got = self._functions.get(fn) if plain else None
        if got is None:
            got = (next(self._function_ids), pickle_part(fn, "the function", fn))
            if plain:
                if len(self._functions) >= 256:
                    self._functions.clear()
                self._functions[fn] = got
        return got

    def _submit_many(
        self,
        fn: Callable[..., Any],
        kind: int,
        args: list[Any],
        keys: list[tuple[Any, ...]],
        batch: MapBatch,
    ) -> list[Task]:
        """A map's tasks: fn over each of `args` (the body of a `kind` message, see
        protocol.py) with keys[i], one send per BATCH of them; task i fills slot i of
        `batch`, or for a chunk the slots batch.owners[i]."""
        manager = self._manager
        out: list[Task] = []
        fid, blob = self._pickled(fn)
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
            tasks = [Task(fn, k, None, batch, i) for i, k in enumerate(part_keys, start)]
            first = manager.register(tasks)
            messages = [
                (tid, head(tid, fid, nblob, kind) + blob + body, k)
                for tid, body, k in zip(itertools.count(first), bodies, part_keys)
            ]
            try:
                manager.send(messages)
            except BaseException as e:
                manager.forget(first, len(tasks))
                manager.cancel(out)
                manager.explain(e)
                raise
            out += tasks
        return out

    def _results(
        self, batch: MapBatch, tasks: list[Task], end: float | None, total: int | None
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
                    block.append(PENDING)
                    results[index:stop] = itertools.repeat(None, stop - index)
                    index = stop
                    yield from iter(block.popleft, PENDING)
                    continue
                value = results[index]
                if value is PENDING:
                    value = batch.wait(index, end)
                results[index] = None  # the caller has it: do not keep it alive
                index += 1
                if type(value) is Raised:
                    raise value.exc
                if bar is not None:
                    bar.advance(self._manager.retried)
                box = [value]
                del value
                yield box.pop()  # (no local keeps it while the caller has it)
        finally:
            batch.closed = True
            # What has not started will not run (closed, dropped, or interrupted).
            self._manager.cancel(t for t in tasks if not t.started and not t.cancelled)
            if bar is not None:
                bar.close()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new tasks; with cancel_futures, cancel those no worker has started (the
        one an idle worker is already taking up still runs, as with ProcessPoolExecutor);
        with wait, return once every task finished and the workers and channels are
        gone. Ctrl-C while waiting stops the executor now (see __exit__)."""
        self._manager.request_shutdown(cancel_futures)
        if wait and self._manager.thread is not threading.current_thread():
            try:
                self._manager.thread.join()
            except KeyboardInterrupt:
                self._manager.request_shutdown(True, terminate=True)
                raise

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        """shutdown(wait=True); after a KeyboardInterrupt in the block, first stop: cancel
        what has not started and kill the workers (with task_timeout set, once the
        running tasks end or reach it); the futures of the tasks stopped fail."""
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            # Ctrl-C: leave now. Nothing more starts; the running tasks are stopped (at
            # once, or when they reach task_timeout if one is set) and count as not done.
            self._manager.request_shutdown(True, terminate=True)
        self.shutdown(wait=True)

    def stats(self) -> ExecutorStats:
        """Tasks queued, running, done, retried, failed; held keys; the workers."""
        return self._manager.stats()
