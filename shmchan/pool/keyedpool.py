"""KeyedPool: worker processes serving an existing named channel; the caller's side of
it (its manager thread is keyedpool_manager.py)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

from .. import liveness
from ..channel import Channel
from .common import get_context
from .keyedpool_manager import PoolManager
from .stats import PoolStats
from .worker import pool_worker
from .workerset import WorkerSet


class KeyedPool:
    """Worker processes serving an existing named channel: handler(payload, keys) for
    every message outside producers send to it. A return releases the message's handle,
    an exception is logged and nacks it (the channel's max_attempts / dead letters
    apply), a worker that dies is replaced and its messages are redelivered.

    From an event loop: `await pool.join_async(timeout)` and `async with pool:` wait for
    the end without blocking the loop (constructing the pool starts its processes: from
    a loop that must not pause for that, `await asyncio.to_thread(KeyedPool, ...)`).

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
        self._manager = PoolManager(self._ch, self._rx, self._workers)

    def close(self) -> None:
        """Stop taking messages; the workers finish what the pool holds, then exit."""
        self._manager.closing = True

    def terminate(self) -> None:
        """Kill the workers now; what they held goes back to the channel (attempt + 1)."""
        self._manager.terminating = True

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the pool has stopped (after close(), terminate(), the channel's
        shutdown and drain, or a failure), at most `timeout` seconds; True if it has.
        InitializerFailed if it stopped because a worker's initializer raised."""
        self._manager.thread.join(timeout)
        if self._manager.thread.is_alive():
            return False
        if self._manager.failure is not None:
            raise self._manager.failure
        return True

    async def join_async(self, timeout: float | None = None) -> bool:
        """join() for an event loop: awaits the pool's end without blocking the loop and
        without a thread of its own (the pool's manager thread resolves the await as it
        ends); True if it has ended, False after `timeout` seconds. Cancelling the await
        leaves the pool running."""
        fut = self._manager.await_end()
        if fut is not None:
            try:
                await asyncio.wait_for(fut, timeout)
            except TimeoutError:
                return False
        self._manager.thread.join()  # it has returned (or is returning) from run()
        if self._manager.failure is not None:
            raise self._manager.failure
        return True

    async def __aenter__(self) -> KeyedPool:
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        """close(), then await the workers' end (as the synchronous `with` does)."""
        self.close()
        await self.join_async()

    def __enter__(self) -> KeyedPool:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close()
        self._manager.thread.join()
        if self._manager.failure is not None and exc_type is None:
            raise self._manager.failure

    def stats(self) -> PoolStats:
        """Messages queued in the channel, held by the pool, handled, failed; workers."""
        return self._manager.stats()
