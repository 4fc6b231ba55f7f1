"""asyncio for channels: awaitable receive and send that never block the event loop.

`Receiver.recv_async`, `recv_many_async`, `async for h in rx` and `Sender.send_async`
are thin methods over the functions here; each passes its object's hook for one armed
poll (`Receiver`) or for counting itself among the senders waiting for space (`Sender`).
The data flow::

    awaiting task (event loop thread)              helper thread (one per process)
    ---------------------------------              -------------------------------
    poll, non-blocking: a message? -> return it
    nothing: count in async_waiters, read the
    side's futex word W, arm (the sleep flag /
    the space waiters), poll once more
    register (word, W, deadline) ------------->    futex_waitv on every registered word
    await a future                                 and on its own "set changed" word
                                                   word != W or deadline passed:
    <------------- call_soon_threadsafe ----------  resolve the future (no message taken)
    poll again, in the task's own step

Producers in other processes move the word and FUTEX_WAKE it (csrc/hot/wake.c) whenever they
would post a synchronous sleeper. The helper only says "look again": every receive and
send runs on the event loop, in the awaiting task's own step, as one non-blocking call.
So a cancelled await (task.cancel(), asyncio.timeout, wait_for) has taken nothing and
holds nothing, and a message is handed to exactly the task whose call returns it.

Upkeep (redelivering a dead holder's or an expired lease's messages) runs as it does for
a blocking receiver: each wait lasts at most until the next upkeep is due, then the task
polls, and the poll runs it. An idle awaiting consumer thus wakes a few times a second
for a moment, and otherwise costs no CPU; waiting costs no thread per call.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import _shmchan_hot as _hot  # wait_words / notify / private_value (csrc/hot/wake.c)

from . import errors
from ._segment import RX, TX, Segment, deadline_of, remaining

if TYPE_CHECKING:
    from .handle import Handle
    from .receiver import Receiver

# Receiver's hook: one armed poll for up to n handles (n = 0: none), then how long the
# task may wait before it must poll again, and the segment whose wake-up that is.
AsyncStep = Callable[[int], tuple[list["Handle"], float, Segment]]
# Sender's hook: count it in (True) or out of the senders waiting for space.
SpaceWaiting = Callable[[bool], Segment]
THREAD_NAME = "shmchan-aio"
_WORDS_MAX = 127  # words one futex_waitv takes besides the helper's own
_SEND_NAP_MAX = 0.1  # longest wait of a sender between two looks (as a blocking send)
_EINTR, _EFAULT = -4, -14


class _Wait:
    """One awaiting task's registration: wake it when `word` is no longer `value`."""

    __slots__ = ("seg", "which", "address", "value", "deadline", "loop", "future")

    def __init__(
        self,
        seg: Any,
        which: int,
        address: int,
        value: int,
        deadline: float,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[None],
    ) -> None:
        self.seg = seg  # held, so its mapping (where the word is) outlives the wait
        self.which = which
        self.address = address
        self.value = value
        self.deadline = deadline
        self.loop = loop
        self.future = future


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Helper:
    """The process's one waiting thread: started at the first wait, lives on (daemon)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waits: dict[int, _Wait] = {}
        self._thread: threading.Thread | None = None

    def add(self, w: _Wait) -> None:
        with self._lock:
            self._waits[id(w)] = w
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                self._thread.start()
        _hot.notify()  # the set changed: the helper looks at it again

    def remove(self, w: _Wait) -> None:
        with self._lock:
            self._waits.pop(id(w), None)  # a stale entry only costs the helper one wake

    def _run(self) -> None:
        while True:
            seen = _hot.private_value()  # before the snapshot: a later add moves it
            with self._lock:
                waits = list(self._waits.values())
            now = time.monotonic()
            chosen = waits[:_WORDS_MAX]
            seconds = min((w.deadline for w in waits), default=now + 3600.0) - now
            if len(waits) > _WORDS_MAX:
                seconds = min(seconds, 0.01)  # more words than one wait takes: poll the rest
            if seconds > 0:
                r = _hot.wait_words(
                    [w.address for w in chosen], [w.value for w in chosen], seen, seconds
                )
                if r == _EFAULT:
                    seconds = 0.001  # a mapping went away: its wait ends below
            self._wake(waits)

    def _wake(self, waits: list[_Wait]) -> None:
        now = time.monotonic()
        for w in waits:
            try:
                changed = w.seg.wake_word(w.which)[1] != w.value
            except ValueError:  # the channel was closed: its task polls and finds that
                changed = True
            if changed or now >= w.deadline:
                self.remove(w)
                try:
                    w.loop.call_soon_threadsafe(_resolve, w.future)
                except RuntimeError:  # its loop is closed: nobody awaits it any more
                    pass


_helper = _Helper()


def _after_fork_in_child() -> None:
    global _helper
    _helper = _Helper()  # the parent's thread is not in the child


os.register_at_fork(after_in_child=_after_fork_in_child)


def helper_threads() -> int:
    """How many helper threads this process runs (0 or 1)."""
    return sum(1 for t in threading.enumerate() if t.name == THREAD_NAME)


async def _wait(seg: Any, which: int, value: int, seconds: float) -> None:
    """Until side `which` of seg moves its word from `value`, or seconds pass."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    w = _Wait(seg, which, seg.wake_word(which)[0], value, time.monotonic() + seconds, loop, future)
    _helper.add(w)
    try:
        await future
    finally:
        _helper.remove(w)


async def recv_many(
    rx: Receiver, step: AsyncStep, n: int, timeout: float | None, what: str
) -> list[Handle]:
    """1 to n handles from rx, awaiting the first; Empty once timeout seconds pass."""
    deadline = deadline_of(timeout, f"{what}: timeout")
    try:
        return rx.recv_many(n, 0)  # the common case: one C call, nothing armed
    except errors.Empty:
        pass
    while True:
        seg = step(0)[2]
        seg.async_waiting(1)  # step 1 of csrc/hot/wake.c: before the word is read
        try:
            seg.drain(RX)  # posts our earlier arms left: we are the receiver's sleeper
            value = seg.wake_word(RX)[1]
            handles, wait, seg = step(n)  # armed: the last look
            if handles:
                return handles
            left = remaining(deadline)
            if left is not None and left <= 0:
                raise errors.Empty(f"{what}: nothing arrived in time")
            await _wait(seg, RX, value, wait if left is None else min(wait, left))
        finally:
            with contextlib.suppress(ValueError):  # closed meanwhile: the mapping is gone
                seg.async_waiting(-1)


async def iterate(rx: Receiver, step: AsyncStep) -> AsyncIterator[Handle]:
    """Handles until the channel is shut down and drained (recv raises Closed then)."""
    while True:
        try:
            handle = (await recv_many(rx, step, 1, None, "async for"))[0]
        except errors.Closed:
            return
        yield handle


async def send(
    attempt: Callable[[], int], space_waiting: SpaceWaiting, timeout: float | None, what: str
) -> int:
    """attempt() (a send with timeout 0) until it goes in; Full once timeout passes."""
    deadline = deadline_of(timeout, f"{what}: timeout")
    try:
        return attempt()
    except errors.Full:
        pass
    seg = space_waiting(True)  # counted as a blocked send is
    nap = 0.001
    try:
        while True:
            seg.async_waiting(1)  # step 1 of csrc/hot/wake.c: before the word is read
            try:
                value = seg.wake_word(TX)[1]
                try:
                    return attempt()  # the last look, counted among the waiters
                except errors.Full:
                    left = remaining(deadline)
                    if left is not None and left <= 0:
                        raise
                # Woken when the receiver frees space; the nap bounds a wait behind a
                # stalled claim, which moves no word (the receiver repairs it).
                await _wait(seg, TX, value, nap if left is None else min(nap, left))
                nap = min(2 * nap, _SEND_NAP_MAX)
            finally:
                with contextlib.suppress(ValueError):  # closed meanwhile: the mapping is gone
                    seg.async_waiting(-1)
    finally:
        with contextlib.suppress(errors.Error):  # closed meanwhile: nothing to count out
            space_waiting(False)
