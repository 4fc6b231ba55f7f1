"""Receiver: the one consumer of a channel (the Python half of csrc/hot/receiver.c's
ReceiverBase).

`recv`, `recv_many`, `recv_batch` and `release_many` are implemented in C; Python is
called back for what must be Python: upkeep (`maintain`: liveness through psutil,
redeliveries), a stuck record's owner, arguments to check, and errors to raise.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from typing import NoReturn

import _shmchan_hot as _hot  # the per-message calls (csrc/hot/)

from . import _segment, deadroute, errors, liveness, overflow
from ._lib import ffi, lib, raise_for
from ._segment import (
    TX,
    Attachment,
    Segment,
    deadline_of,
    reap_dead_producers,
    resolve_stall,
)
from .handle import Batch, Handle

__all__ = ["Receiver"]

_RECEIVE_ARMED = 2  # _receive's block: one poll leaving the sleep announced (receiver.c)


def _settle_gate(seg: Segment, pos: int, owner: int) -> object:
    """A dead publisher's gated record: its exchange decides (shmchan.exchange)."""
    from .exchange import resolve_gate  # on first use: most receivers never meet one

    return resolve_gate(seg, pos, owner)


class Receiver(_hot.ReceiverBase):
    """The one consumer of a channel: hands out key-locked handles.

    `recv`, `recv_many`, `recv_batch` and `release_many` are implemented in C
    (csrc/hot/receiver.c): one poll of the core, Handles built in C, and the one receive
    loop (spin, sleep, upkeep). Arguments C does not take as they are go to the `_*_slow`
    methods below, which check them and call that loop (`_receive`)."""

    def __init__(self, channel: Attachment, seg: Segment) -> None:
        self._channel = channel
        self._seg: Segment | None = seg
        self._ident = (seg.name, seg.path)  # its channel's, also once closed (release_many)
        self._next_maintenance = 0.0
        self._next_sweep = time.monotonic() + _segment.SWEEP_SECONDS
        self._stall: tuple[int, int, float] | None = None  # (pos, owner, since)
        self._stalled_now = False  # the last armed poll (_async_step) met a stall
        self._pid = os.getpid()  # only this process took the seat
        self._closed_why = "it was closed"
        self._dead_router = deadroute.Router()  # dead letters to an exchange, if routed
        self._drainer: overflow.Drainer | None = None
        try:
            self.maintain()  # a dead predecessor's handles come back at once
            self._drainer = overflow.start_drainer(seg)  # None without overflow=
        except BaseException:
            self.close()  # do not keep a seat nobody can use
            raise

    def maintain(self) -> int:
        """Redeliver handles whose holder died or whose lease ran out; returns how many.

        recv() runs this on its own every few tenths of a second; call it yourself only
        if you hold the receiver without receiving.
        """
        seg = self._live()
        now = time.monotonic()
        self._next_maintenance = now + _segment.MAINTENANCE_SECONDS
        self._discard_dead_writers(seg)
        dead_letters = getattr(self._channel, "dead_letters", None)
        if dead_letters is not None:  # a channel's dead letters routed to an exchange
            self._dead_router.route(dead_letters, seg)
        holders = ffi.new("uint64_t[]", 512)
        n = ffi.new("uint32_t *")
        expired = ffi.new("uint32_t *")
        now_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        lib.shm_holders(seg.ptr, holders, 512, n, now_ns, expired)
        me = liveness.current_token()
        dead = [
            int(holders[i])
            for i in range(n[0])
            if int(holders[i]) not in (me, _segment.HOLDER_REVOKED)
            and not liveness.is_alive(int(holders[i]))
        ]
        sweep = now >= self._next_sweep
        if not dead and not expired[0] and not sweep:
            return 0
        if sweep:
            self._next_sweep = now + _segment.SWEEP_SECONDS
            seg.removed()  # its name removed some other way: refuse its senders from now
            if lib.shm_space_waiters(seg.ptr):
                # a sender killed while waiting for space would stay counted (and posted
                # for) until its registry entry is reaped (csrc/ring.c)
                reap_dead_producers(seg)
        revoked = ffi.new("uint32_t *")
        rc = lib.shm_revoke(seg.ptr, dead, len(dead), now_ns, revoked)
        if rc:
            raise_for(rc, "maintain")
        if revoked[0]:
            seg.post(TX, 64)  # space may have been freed by dead letters' keys
        return int(revoked[0])

    def _discard_dead_writers(self, seg: Segment) -> None:
        """Records the receiver looked past while their producer was still writing them
        (csrc/window.c placeholders): a dead producer's record is dropped, which frees
        its place in its keys' lines."""
        s = seg.scratch()
        if s.writing is None:
            s.writing = (ffi.new("uint64_t[]", 64), ffi.new("uint64_t[]", 64))
        pos, owner = s.writing
        lib.shm_writing_list(seg.ptr, pos, owner, 64, s.got)
        for i in range(s.got[0]):
            token = int(owner[i])
            if not liveness.is_alive(token):
                lib.shm_discard_dead(seg.ptr, pos[i], token)

    def _live(self) -> Segment:
        seg = self._seg
        if seg is None:
            raise errors.Closed(f"receiver is closed: {self._closed_why}")
        if self._pid != os.getpid():
            raise errors.WrongProcess(
                f"this Receiver of channel {seg.name!r} belongs to pid {self._pid}; a forked "
                f"child (pid {os.getpid()}) cannot receive through it: in the child, open "
                "the channel and call receiver() (after the parent closed its receiver)"
            )
        return seg

    # The receive loop is C's (csrc/hot/receiver.c, receive); these are its calls back
    # into Python, for what must be Python.

    def _stalled(self, pos: int, owner: int) -> None:
        """The core is stuck on a claim at ring position `pos` by `owner`, past the spin
        (C calls this). Remembered across calls, so that try_recv() polling also gets a
        dead producer's claim repaired: its owner is checked once the same claim has
        stalled us for STALL_CHECK_SECONDS, and again as often while it lasts."""
        now = time.monotonic()
        self._stalled_now = True
        if self._stall is None or self._stall[:2] != (pos, owner):
            self._stall = (pos, owner, now)
        elif now - self._stall[2] > _segment.STALL_CHECK_SECONDS:
            stall = ffi.new("shm_stall *")
            stall.pos, stall.owner = pos, owner
            resolve_stall(self._live(), stall, consumer=True, settle_gate=_settle_gate)
            self._stall = (pos, owner, now)

    def _nothing(self, rc: int) -> NoReturn:
        """Raise for a receive that ends with nothing, with the core's status rc (C
        calls this): EMPTY once time is up, CLOSED once shut down or removed and
        drained, else the status's error."""
        seg = self._live()
        if rc == lib.SHM_EMPTY:
            raise errors.Empty(f"recv: nothing arrived on {seg.name!r} in time")
        if rc == lib.SHM_CLOSED:
            how = "removed" if lib.shm_removed(seg.ptr) else "shut down"
            raise errors.Closed(f"channel {seg.name!r} is {how} and drained")
        torn = " (a record failed its checksum or validation: torn by a power loss?)"
        raise_for(rc, "recv", torn if rc == lib.SHM_E_CORRUPT and seg.path else "")

    def _recv_slow(self, timeout: float | None) -> Handle:
        """recv() with a timeout C leaves to Python to check."""
        handle: Handle = self._receive(0, deadline_of(timeout), True)
        return handle

    def try_recv(self) -> Handle | None:
        """The next message free to go, or None right away."""
        handle: Handle | None = self._receive(0, None, False)
        return handle

    def _recv_many_slow(self, max_items: object, timeout: float | None) -> list[Handle]:
        """recv_many() with arguments C leaves to Python to check."""
        if type(max_items) is not int or max_items < 1:
            raise errors.InvalidArgument(f"max_items must be a positive int, not {max_items!r:.40}")
        deadline = deadline_of(timeout)
        handles: list[Handle] = self._receive(min(max_items, 65536), deadline, True)
        return handles

    def _recv_batch_slow(self, max_items: object, timeout: float | None) -> Batch:
        """recv_batch() for arguments its C path does not take (they are checked here):
        wait as recv_many does, then turn the Handles into one Batch."""
        handles = self.recv_many(max_items, timeout)  # type: ignore[arg-type]  # checked there
        try:
            batch: Batch = _hot.batch_from_handles(self._live(), handles)
        except BaseException:
            # Dropped, the Handles would release their messages undelivered: give them
            # back (delivered again, attempt + 1) and let the error through.
            for h in handles:
                with contextlib.suppress(errors.Error):
                    h.nack()
            raise
        return batch

    def _release_many_slow(self, handles: list[object]) -> None:
        """release_many() for lists its C fast path does not take: handles of another
        attachment of the channel, things that are not handles, more than 65536 handles,
        or a closed receiver: then each handle is released as its own release() does after
        the close (a handle keeps its mapping; one whose mapping is gone is a no-op)."""
        seg = self._seg
        name, path = self._ident if seg is None else (self._live().name, seg.path)
        todo = []
        for h in handles:
            if not isinstance(h, Handle):
                raise errors.UnsupportedType(f"release_many: not a Handle: {type(h).__name__}")
            if (h._seg.name, h._seg.path) != (name, path):
                raise errors.InvalidArgument(
                    f"release_many: a handle of channel {h._seg.name!r}, not {name!r}"
                )
            todo.append(h)
        for h in todo:
            h._finish(0)

    def _released_many(self, rc: int) -> NoReturn:
        """A release_many whose core call failed with status rc (C calls this)."""
        raise_for(rc, "release_many")

    def _async_step(self, n: int) -> tuple[list[Handle], float, Segment]:
        """One armed, non-blocking poll for the asyncio receive (shmchan.aio): up to n
        handles (n = 0: no poll), or none with the sleep left announced (csrc/handles.c);
        then how long the caller may wait for its wake-up before it must poll again
        (upkeep due, or a stalled claim to look at again), and the segment whose wake-up
        that is."""
        seg = self._live()
        self._stalled_now = False
        handles: list[Handle] = self._receive(n, None, _RECEIVE_ARMED) if n else []
        wait = max(0.0, self._next_maintenance - time.monotonic())
        due = lib.shm_timers_wait(seg.ptr)  # a delayed message's time (timers.c), or < 0
        if due >= 0.0:
            wait = min(wait, due)
        return handles, min(wait, 0.002) if self._stalled_now else wait, seg

    async def recv_async(self, timeout: float | None = None) -> Handle:
        """recv() for asyncio: awaits the next message without blocking the event loop.
        A cancelled await has taken nothing (see shmchan.aio)."""
        from . import aio  # asyncio is imported by the first asyncio call, not by import shmchan

        return (await aio.recv_many(self, self._async_step, 1, timeout, "recv_async"))[0]

    async def recv_many_async(
        self, max_items: int = 64, timeout: float | None = None
    ) -> list[Handle]:
        """recv_many() for asyncio: 1 to max_items messages once at least one is free."""
        if type(max_items) is not int or max_items < 1:
            raise errors.InvalidArgument(f"max_items must be a positive int, not {max_items!r:.40}")
        n = min(max_items, 65536)
        from . import aio

        return await aio.recv_many(self, self._async_step, n, timeout, "recv_many_async")

    def __aiter__(self) -> AsyncIterator[Handle]:
        """`async for h in rx`: handles until the channel is shut down and drained."""
        from . import aio

        return aio.iterate(self, self._async_step)

    def __iter__(self) -> Iterator[Handle]:
        """Handles, blocking, until the channel is shut down, drained, and no handle out
        in another process can come back (recv raises Closed then; csrc/handles.c)."""
        while True:
            try:
                yield self.recv()
            except errors.Closed:
                return

    def close(self) -> None:
        """Give up the receiver seat (idempotent). Handles already out stay valid."""
        seg, self._seg = self._seg, None
        drainer, self._drainer = getattr(self, "_drainer", None), None
        if drainer is not None and seg is not None and seg.pid == os.getpid():
            drainer.stop()  # before the seat goes: one drainer per channel
        if seg is not None and not seg.detached[0] and seg.pid == os.getpid():
            lib.shm_rx_release_ownership(seg.ptr)

    def __del__(self) -> None:
        # A receiver nobody can reach any more must not keep the seat.
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
