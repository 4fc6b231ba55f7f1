"""KeyedPool: worker processes serving an existing named channel."""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import errors, liveness
from ..channel import Channel, Handle
from .common import BATCH, TICK, InitializerFailed, get_context
from .protocol import EXIT_INIT_FAILED, FAILED, FINISHED, SLOT
from .stats import PoolStats
from .worker import pool_worker
from .workerset import WorkerProcess, WorkerSet


class KeyedPool:
    """Worker processes serving an existing named channel: handler(payload, keys) for
    every message outside producers send to it. A return releases the message's handle,
    an exception is logged and nacks it (the channel's max_attempts / dead letters
    apply), a worker that dies is replaced and its messages are redelivered.

    `close()` stops taking messages and lets the workers finish what the pool holds
    (a message whose worker dies meanwhile goes back to the channel and is taken again,
    with whatever the channel hands out before it); `terminate()` kills them and gives
    back what they held; `join()` waits for either. The pool also ends once the channel
    is shut down and drained. This process is the channel's receiver meanwhile
    (ReceiverBusy if another live one exists).

    The handler learns what it holds from `shmchan.pool.current()`: the message's seq
    (the same on every attempt: an idempotency key), attempt, keys and lease deadline.
    With a channel lease, the lease is renewed as the handler starts. `stats()` counts
    every message since the pool started, also those of workers since replaced.

    A worker's initializer that raises fails the pool: it stops, and `join()` raises
    InitializerFailed. No worker is handed a message before its initializer returned,
    so no message is charged an attempt for it.

    A durable channel (created with `path=`) is served by passing the same `path=`."""

    def __init__(
        self,
        name: str,
        handler: Callable[[Any, tuple[Any, ...]], object],
        processes: int | None = None,
        mp_context: Any = None,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        *,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        if not callable(handler):
            raise TypeError(f"handler must be callable, not {type(handler).__name__}")
        if processes is None:
            processes = len(os.sched_getaffinity(0)) or 1
        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
            raise ValueError(f"processes must be a positive int, got {processes!r}")
        ctx = get_context(mp_context)  # (an unpicklable handler fails in Process.start)
        self._lock = threading.Lock()
        self._closing = False
        self._terminating = False
        self._held: collections.deque[Handle] = collections.deque()
        # the FINISHED and FAILED counts of workers that ended: stats() are cumulative
        self._finished_before = 0
        self._failed_before = 0
        self._redelivered = 0
        self._failure: BaseException | None = None  # join() raises it
        # seqs of messages a worker died with after close(): taken again before the end
        self._owed: set[int] = set()
        self._ch = Channel.open(name, path=path)
        try:
            self._rx = self._ch.receiver()
        except BaseException:
            self._ch.close()
            raise
        self._workers = WorkerSet(
            ctx,
            processes,
            pool_worker,
            (handler, liveness.current_token(), initializer, tuple(initargs), self._ch.lease),
            None,
            # One message per worker at a time: a worker that dies gives back what it
            # holds by the channel's redelivery, which counts an attempt (the channel's
            # max_attempts applies); a message merely waiting in a dead worker's hands
            # must not be charged one (it could reach the dead letters without ever
            # having run). The executor counts its tasks' attempts itself, so it
            # prefetches.
            prefetch=1,
            ready_first=True,
        )
        try:
            self._workers.start_all()
        except BaseException:
            self._workers.shut(kill=True)
            self._rx.close()
            self._ch.close()
            raise
        self._thread = threading.Thread(target=self._run, name="shmchan-KeyedPool", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop taking messages; the workers finish what the pool holds, then exit."""
        self._closing = True

    def terminate(self) -> None:
        """Kill the workers now; what they held goes back to the channel (attempt + 1)."""
        self._terminating = True

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the pool has stopped (after close(), terminate(), the channel's
        shutdown and drain, or a failure), at most `timeout` seconds; True if it has.
        InitializerFailed if it stopped because a worker's initializer raised."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        if self._failure is not None:
            raise self._failure
        return True

    def __enter__(self) -> KeyedPool:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close()
        self._thread.join()
        if self._failure is not None and exc_type is None:
            raise self._failure

    def stats(self) -> PoolStats:
        """Messages queued in the channel, held by the pool, handled, failed; workers."""
        st = self._ch.stats() if self._ch._seg is not None else None
        workers = self._workers.stats()
        finished = self._finished_before + sum(w.finished for w in workers)
        failed = self._failed_before + sum(
            int(self._workers.words[SLOT * w.index + FAILED]) for w in self._workers.live()
        )
        words = self._workers.words
        running = len(self._held) + sum(
            max(w.taken - words[SLOT * w.index + FINISHED], 0) for w in self._workers.live()
        )
        return PoolStats(
            queued=st.queued if st is not None else 0,
            running=running,
            handled=max(finished - failed, 0),
            failed=failed,
            redelivered=self._redelivered,
            held_keys=st.held_keys if st is not None else 0,
            workers=workers,
        )

    # -- the manager thread ------------------------------------------------------------
    def _run(self) -> None:
        workers = self._workers
        drained = False
        next_check = 0.0
        try:
            while not self._terminating:
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + TICK
                    self._housekeeping()
                    if self._failure is not None:
                        break
                workers.refresh()  # the workers released those themselves
                self._give()
                stopping = (self._closing and not self._owed) or drained
                if stopping:
                    if not self._held and all(w.taken == w.finished for w in workers.live()):
                        break
                    time.sleep(0.001)
                    continue
                if self._held:
                    time.sleep(0.0005)  # every worker is full: wait for one to finish one
                    continue
                room = workers.capacity()
                if not room:  # every worker busy, or still in its initializer
                    time.sleep(0.0005)
                    continue
                try:
                    got = self._rx.recv_many(min(room, BATCH), timeout=TICK)
                    self._held.extend(got)
                    if self._owed:
                        self._owed.difference_update(h.seq for h in got)
                except errors.Empty:
                    pass
                except errors.Closed:
                    # Shut down and everything handed out; but a nacked message, or one
                    # whose worker died, comes back: done only once nothing is out.
                    st = self._ch.stats()
                    if st.inflight == 0 and st.queued == 0:
                        drained = True
                    else:
                        time.sleep(0.005)
        finally:
            self._stop()

    def _give(self) -> None:
        room = self._workers.capacity()
        if room and self._held:
            batch = [(self._held.popleft(), 0) for _ in range(min(room, len(self._held)))]
            self._workers.give(batch)

    def _housekeeping(self) -> None:
        for w, code, _seq in self._workers.ended():
            self._count_ended(w)
            for h, _ in w.given:
                if self._closing:
                    self._owed.add(h.seq)  # still the pool's to finish: taken again
                h.nack()  # a no-op for those already released or revoked
                self._redelivered += 1
            w.given.clear()
            if code == EXIT_INIT_FAILED and self._failure is None:
                self._failure = InitializerFailed(
                    f"KeyedPool({self._ch.name!r}): the initializer raised in worker pid "
                    f"{w.process.pid} (its traceback is in the worker's log); the pool "
                    "stopped, and the messages it had not handled are still in the channel"
                )
            if self._failure is None and not self._terminating:
                if not self._closing or self._owed:
                    self._workers.start(w.index)
        if self._owed:
            self._forget_lost_owed()

    def _forget_lost_owed(self) -> None:
        """Stop waiting for owed messages that cannot come back: gone to the dead
        letters, or the channel has nothing queued and nothing out but the pool's."""
        st = self._ch.stats()
        if st.dead_letters:
            self._owed.difference_update(d.seq for d in self._ch.dead_letters())
        ours = len(self._held) + self._workers.outstanding()
        if st.queued == 0 and st.inflight <= ours:
            self._owed.clear()

    def _count_ended(self, w: WorkerProcess) -> None:
        """Keep the counts of a worker that ended (its replacement starts from 0)."""
        base = SLOT * w.index
        self._finished_before += int(self._workers.words[base + FINISHED])
        self._failed_before += int(self._workers.words[base + FAILED])

    def _stop(self) -> None:
        workers = self._workers
        kill = self._terminating
        for w in workers.live():
            if kill:
                w.process.kill()
        workers.shut(kill=kill)
        for w in workers.live():
            for h, _ in w.given:
                h.nack()
            w.given.clear()
        while self._held:
            self._held.popleft().nack()
        self._rx.close()
        self._ch.close()
