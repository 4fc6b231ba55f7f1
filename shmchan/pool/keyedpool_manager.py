"""KeyedPool's manager: the thread that takes messages from the channel, hands them to
the workers, notices deaths, and stops the pool.

    outside producers --> [named channel] --recv_many (as many as the workers have
                                             room for: one each) --> `held`
    manager thread (PoolManager.run):  give: hand_over --pipe--> worker: adopt at once,
                                                                 handler(payload, keys),
                                                                 release / nack
    a worker that ended: nack what it held (the channel redelivers it, attempt + 1) and
    start another; after close(), those messages are `owed`: the pool takes them again
    before it stops.

KeyedPool (keyedpool.py) is the caller's side: it sets `closing` / `terminating`, joins
the thread (or, from an event loop, awaits a future this thread resolves as it ends),
reads `failure` and stats().
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time

from .. import errors
from ..channel import Channel, Handle, Receiver, Stats
from .common import BATCH, TICK, InitializerFailed
from .protocol import EXIT_INIT_FAILED, FAILED, FINISHED, SLOT
from .stats import PoolStats
from .workerset import WorkerProcess, WorkerSet

__all__ = ["PoolManager"]


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():  # (a cancelled join_async left it cancelled)
        fut.set_result(None)


class PoolManager:
    """A KeyedPool's channel, receiver and workers, and the thread (`run`) that serves
    the channel with them; started by the constructor."""

    def __init__(self, ch: Channel, rx: Receiver, workers: WorkerSet) -> None:
        self.ch = ch
        self.rx = rx
        self.workers = workers
        self.closing = False  # close(): take nothing more, finish what the pool holds
        self.terminating = False  # terminate(): kill the workers now
        self.held: collections.deque[Handle] = collections.deque()  # no worker had room
        # the FINISHED and FAILED counts of workers that ended: stats() are cumulative
        self.finished_before = 0
        self.failed_before = 0
        self.redelivered = 0
        self.failure: BaseException | None = None  # join() raises it
        # seqs of messages a worker died with after close(): taken again before the end
        self.owed: set[int] = set()
        # join_async() awaiters: (loop, future), resolved from this thread once it ends
        self.awaiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.ended = False  # under awaiters_lock: run() has returned
        self.awaiters_lock = threading.Lock()
        self.thread = threading.Thread(target=self.run, name="shmchan-KeyedPool", daemon=True)
        self.thread.start()

    def stats(self) -> PoolStats:
        """Any thread: KeyedPool.stats()."""
        try:
            st: Stats | None = self.ch.stats()
        except errors.Closed:  # the pool has stopped
            st = None
        workers = self.workers.stats()
        finished = self.finished_before + sum(w.finished for w in workers)
        failed = self.failed_before + sum(
            int(self.workers.words[SLOT * w.index + FAILED]) for w in self.workers.live()
        )
        words = self.workers.words
        running = len(self.held) + sum(
            max(w.taken - words[SLOT * w.index + FINISHED], 0) for w in self.workers.live()
        )
        return PoolStats(
            queued=st.queued if st is not None else 0,
            running=running,
            handled=max(finished - failed, 0),
            failed=failed,
            redelivered=self.redelivered,
            held_keys=st.held_keys if st is not None else 0,
            workers=workers,
        )

    def run(self) -> None:
        workers = self.workers
        drained = False
        next_check = 0.0
        try:
            while not self.terminating:
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + TICK
                    self.housekeeping()
                    if self.failure is not None:
                        break
                workers.refresh()  # the workers released those themselves
                self.give()
                stopping = (self.closing and not self.owed) or drained
                if stopping:
                    if not self.held and all(w.taken == w.finished for w in workers.live()):
                        break
                    time.sleep(0.001)
                    continue
                if self.held:
                    time.sleep(0.0005)  # every worker is full: wait for one to finish one
                    continue
                room = workers.capacity()
                if not room:  # every worker busy, or still in its initializer
                    time.sleep(0.0005)
                    continue
                try:
                    got = self.rx.recv_many(min(room, BATCH), timeout=TICK)
                    self.held.extend(got)
                    if self.owed:
                        self.owed.difference_update(h.seq for h in got)
                except errors.Empty:
                    pass
                except errors.Closed:
                    # Shut down and everything handed out; but a nacked message, or one
                    # whose worker died, comes back: done only once nothing is out.
                    st = self.ch.stats()
                    if st.inflight == 0 and st.queued == 0:
                        drained = True
                    else:
                        time.sleep(0.005)
        finally:
            try:
                self.stop()
            finally:
                self.wake_awaiters()

    def await_end(self) -> asyncio.Future[None] | None:
        """The event loop's side of KeyedPool.join_async: a future this thread resolves
        once it ends, or None if it has already ended."""
        loop = asyncio.get_running_loop()
        with self.awaiters_lock:
            if self.ended:
                return None
            fut: asyncio.Future[None] = loop.create_future()
            self.awaiters.append((loop, fut))
            return fut

    def wake_awaiters(self) -> None:
        with self.awaiters_lock:
            self.ended = True
            awaiters, self.awaiters = self.awaiters, []
        for loop, fut in awaiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody awaits
                loop.call_soon_threadsafe(_resolve, fut)

    def give(self) -> None:
        room = self.workers.capacity()
        if room and self.held:
            batch = [(self.held.popleft(), 0) for _ in range(min(room, len(self.held)))]
            self.workers.give(batch)

    def housekeeping(self) -> None:
        for w, code, _seq in self.workers.ended():
            self.count_ended(w)
            for h, _ in w.given:
                if self.closing:
                    self.owed.add(h.seq)  # still the pool's to finish: taken again
                h.nack()  # a no-op for those already released or revoked
                self.redelivered += 1
            w.given.clear()
            if code == EXIT_INIT_FAILED and self.failure is None:
                self.failure = InitializerFailed(
                    f"KeyedPool({self.ch.name!r}): the initializer raised in worker pid "
                    f"{w.process.pid} (its traceback is in the worker's log); the pool "
                    "stopped, and the messages it had not handled are still in the channel"
                )
            if self.failure is None and not self.terminating:
                if not self.closing or self.owed:
                    self.workers.start(w.index)
        if self.owed:
            self.forget_lost_owed()

    def forget_lost_owed(self) -> None:
        """Stop waiting for owed messages that cannot come back: gone to the dead
        letters, or the channel has nothing queued and nothing out but the pool's."""
        st = self.ch.stats()
        if st.dead_letters:
            self.owed.difference_update(d.seq for d in self.ch.dead_letters())
        ours = len(self.held) + self.workers.outstanding()
        if st.queued == 0 and st.inflight <= ours:
            self.owed.clear()

    def count_ended(self, w: WorkerProcess) -> None:
        """Keep the counts of a worker that ended (its replacement starts from 0)."""
        base = SLOT * w.index
        self.finished_before += int(self.workers.words[base + FINISHED])
        self.failed_before += int(self.workers.words[base + FAILED])

    def stop(self) -> None:
        workers = self.workers
        kill = self.terminating
        for w in workers.live():
            if kill:
                w.process.kill()
        workers.shut(kill=kill)
        for w in workers.live():
            for h, _ in w.given:
                h.nack()
            w.given.clear()
        while self.held:
            self.held.popleft().nack()
        self.rx.close()
        self.ch.close()
