"""The main loop of a KeyedExecutor or KeyedPool worker process.

A worker is handed key-locked handles by its manager (the pool's process, which is the
channel's receiver). The handles travel by pickling through a pipe that carries nothing
but those references, a few bytes each; the task or message itself is read from shared
memory through the handle.

    manager --(pickled handles: pipe)--> reader thread --> inbox
                                                             |
    main thread: take a handle, run it, [executor: send the result into the result
    channel], release the handle  <--------------------------'

A watcher thread checks every PARENT_CHECK_SECONDS, from before the initializer to
the worker's end, that the manager's process lives (its liveness token: pid and start
time), and exits the worker once it does not: nobody wants its results any more, and
what it holds goes back to the channel as a dead holder's handles do. Every blocking
send in a worker waits at most that long at a time, so nothing outlives the check.

A KeyedPool worker's reader thread adopts every batch the moment it arrives: adopting
(unpickling) is what makes this process the handles' holder, so from then on the
channel notices this process's death and redelivers them (attempt + 1), and no handle
waits in the pipe past the channel's hand-over deadline.

A KeyedExecutor worker adopts each task only right before it runs it: until then the
task is in transit, and its manager can take it back by adopting it itself (cancel(),
or an idle worker taking over what waits behind a long task). The core lets exactly one
adoption win, so a task taken back never runs here (adopting it gives a no-op handle,
whose data raises Closed, and the worker skips it), and a task adopted here is started:
this is what makes "running" mean started. The manager gives back what a dead worker
held itself, so the executor's task channel has a long hand-over time. A handle is
released only after its result was sent, so a worker that dies never loses a task: it
runs again.

The messages, the words a worker publishes about itself (RUNNING, STARTED, FINISHED,
FAILED, READY) and the exit statuses are in protocol.py; this module is what runs in
the worker process (the manager's side of it is workerset.py).
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from .. import delivery, errors, liveness, remote
from ..channel import Sender, adopt, split_hand_over
from .protocol import (
    CALL,
    CHUNK_STAR,
    EXIT_INIT_FAILED,
    EXIT_PARENT_GONE,
    FAILED,
    FINISHED,
    OK,
    ONE,
    PARENT_CHECK_SECONDS,
    RAISED,
    READY,
    RESULT_HEADER,
    RUNNING,
    SLOT,
    STAR,
    STARTED,
    TASK_HEADER,
)

__all__ = ["executor_worker", "pool_worker"]

_FUNCTIONS = 64  # unpickled functions a worker keeps
log = logging.getLogger("shmchan.pool")


class _Inbox:
    """Handles received from the manager, adopted on arrival by a reader thread; or,
    `lazy`, kept in transit (each one's own hand-over bytes, see split_hand_over) for
    the main thread to adopt right before it runs it."""

    def __init__(self, conn: Any, lazy: bool = False) -> None:
        self._conn = conn
        self._lazy = lazy
        self._queue: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        threading.Thread(target=self._read, name="shmchan-worker-reader", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                data = self._conn.recv_bytes()
                if not data:  # the manager's stop mark: finish what is here, then exit
                    break
                # lazy: still in transit; the manager may take them back until we adopt
                handles = split_hand_over(data) if self._lazy else adopt(data)
                with self._cond:
                    self._queue.extend(handles)
                    self._cond.notify()
        except (EOFError, OSError):
            pass  # the manager closed the pipe: same as a stop mark
        except BaseException:  # a bug or a corrupted channel: say so, then stop taking
            log.exception("shmchan worker %d: reading handles from the manager failed", os.getpid())
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify()

    def __iter__(self) -> Iterator[Any]:
        queue = self._queue
        while True:
            if queue:
                yield queue.popleft()
                continue
            with self._cond:
                while not queue and not self._closed:
                    self._cond.wait()
                if not queue:
                    return


def _watch_parent(parent_token: int) -> None:
    """Exit this worker once its manager's process has died (checked every
    PARENT_CHECK_SECONDS), whatever the other threads are doing."""
    while True:
        time.sleep(PARENT_CHECK_SECONDS)
        if not liveness.is_alive(parent_token):
            os._exit(EXIT_PARENT_GONE)


def _send(tx: Sender, data: bytes, parent_token: int) -> None:
    """tx.send(data), waiting for room at most PARENT_CHECK_SECONDS at a time: a
    worker whose manager died exits rather than wait for room nobody will make."""
    while True:
        try:
            tx.send(data, timeout=PARENT_CHECK_SECONDS)
            return
        except errors.Full:
            if not liveness.is_alive(parent_token):
                os._exit(EXIT_PARENT_GONE)


def _start(
    initializer: Callable[..., object] | None,
    initargs: tuple[Any, ...],
    parent_token: int,
    words: Any = None,
    index: int = 0,
) -> None:
    # Ctrl-C in a terminal reaches the whole process group; the manager's process
    # decides what happens to the work, the workers just keep going until told.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watcher = threading.Thread(
        target=_watch_parent, args=(parent_token,), name="shmchan-worker-watch", daemon=True
    )
    watcher.start()
    if initializer is not None:
        try:
            initializer(*initargs)
        except BaseException:
            log.exception("shmchan worker %d: the initializer raised", os.getpid())
            os._exit(EXIT_INIT_FAILED)
    if words is not None:
        words[SLOT * index + READY] = 1


def _run_chunk(
    fn: Callable[..., Any], items: tuple[Any, ...], star: bool
) -> tuple[list[Any], set[int] | None]:
    """A map chunk: (values, failed), values[i] the result of item i or, where failed
    says so, its exception as remote.pack makes it (failed: the indices of those; None
    if none raised). Each item runs once, in order, whatever the others did."""
    values: list[Any] = []
    append = values.append
    failed: set[int] | None = None
    at = 0
    while at < len(items):
        try:
            if star:
                for item in items[at:] if at else items:
                    append(fn(*item))
            else:
                for item in items[at:] if at else items:
                    append(fn(item))
        except Exception as e:
            if failed is None:
                failed = set()
            failed.add(len(values))
            append(remote.pack(e, traceback.format_exc()))
        at = len(values)
    return values, failed


def executor_worker(
    conn: Any,
    words: Any,
    index: int,
    result_channel: str,
    parent_token: int,
    initializer: Callable[..., object] | None,
    initargs: tuple[Any, ...],
) -> None:
    """A KeyedExecutor worker: run tasks, send each result, then release its handle.

    A task is adopted only when it is about to run: until then its manager can take it
    back (a cancelled task, or one that waits here while another worker is idle), and
    adopting it is what starts it."""
    _start(initializer, initargs, parent_token, words, index)
    words = memoryview(words).cast("B").cast("q")  # (a ctypes item store costs 3x this)
    tx = Sender.open(result_channel)
    base = SLOT * index
    pid = os.getpid()
    finished = 0
    clock = time.monotonic_ns
    functions: dict[int, Callable[..., Any]] = {}
    for transit in _Inbox(conn, lazy=True):
        finished += 1
        try:
            h = adopt(transit)[0]
            view = h.data
        except (errors.HandoverExpired, errors.Closed):
            # taken back by the manager, or redelivered before we adopted it: not ours
            words[base + FINISHED] = finished
            continue
        seq = h.seq
        tid, fid, n, kind = TASK_HEADER.unpack_from(view)
        words[base + STARTED] = clock()
        words[base + RUNNING] = seq + 1
        delivery.enter(h)
        fn: Any = None
        try:
            start = TASK_HEADER.size
            fn = functions.get(fid)
            if fn is None:
                fn = pickle.loads(view[start : start + n])
                if fid:
                    if len(functions) >= _FUNCTIONS:
                        functions.clear()
                    functions[fid] = fn
            arg = pickle.loads(view[start + n :])
            del view
            if kind == ONE:
                value = fn(arg)
            elif kind == CALL:
                value = fn(*arg[0], **arg[1])
            elif kind == STAR:
                value = fn(*arg)
            else:
                value = _run_chunk(fn, arg, kind == CHUNK_STAR)
            del arg
            status = OK
            try:
                body = pickle.dumps(value, protocol=5)
            except Exception as e:
                status = RAISED
                unpicklable = errors.TaskNotPicklable(
                    f"the result of {getattr(fn, '__qualname__', fn)!r} cannot be pickled "
                    f"to travel back to the caller: {type(e).__name__}: {e}"
                )
                body = remote.pack(unpicklable, traceback.format_exc())
            del value
        except BaseException as e:
            status = RAISED
            body = remote.pack(e, traceback.format_exc())
        header = RESULT_HEADER.pack(tid, seq, pid, finished, status)
        try:
            _send(tx, header + body, parent_token)
        except errors.MessageTooLarge as e:
            too_large = errors.MessageTooLarge(f"the task's result is too large to send back: {e}")
            header = RESULT_HEADER.pack(tid, seq, pid, finished, RAISED)
            _send(tx, header + remote.pack(too_large, ""), parent_token)
        delivery.leave()
        words[base + RUNNING] = 0
        h.release()
        words[base + FINISHED] = finished


def pool_worker(
    conn: Any,
    words: Any,
    index: int,
    handler: Callable[[Any, tuple[Any, ...]], object],
    parent_token: int,
    initializer: Callable[..., object] | None,
    initargs: tuple[Any, ...],
    lease: float | None = None,
) -> None:
    """A KeyedPool worker: handler(payload, keys) per message; return releases, an
    exception is logged and nacks (the channel's max_attempts / dead letters apply).
    With a channel `lease` (seconds), the lease is renewed as the handler starts: the
    handler has all of it, however long the message waited to be handed over."""
    _start(initializer, initargs, parent_token, words, index)
    words = memoryview(words).cast("B").cast("q")  # (a ctypes item store costs 3x this)
    base = SLOT * index
    finished = failed = 0
    clock = time.monotonic_ns
    deadline = None
    for h in _Inbox(conn):
        finished += 1
        try:
            payload, keys = h.payload, h.keys
            if lease is not None:
                deadline = time.monotonic() + lease  # (read before extend: never late)
                h.extend(lease)
        except errors.Closed:  # redelivered before we adopted it: not ours to run
            words[base + FINISHED] = finished
            continue
        words[base + STARTED] = clock()
        words[base + RUNNING] = h.seq + 1
        delivery.enter(h, keys, deadline)
        try:
            try:
                handler(payload, keys)
            finally:
                delivery.leave()
        except BaseException:
            log.exception(
                "shmchan.KeyedPool: handler raised on seq %d (attempt %d, keys %r); "
                "the message goes back to the channel",
                h.seq,
                h.attempt,
                keys,
            )
            words[base + RUNNING] = 0
            failed += 1
            words[base + FAILED] = failed
            h.nack()
        else:
            words[base + RUNNING] = 0
            h.release()
        del payload
        words[base + FINISHED] = finished
