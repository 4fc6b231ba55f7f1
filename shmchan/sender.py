"""Sender: puts messages into a channel (the Python half of csrc/hot/sender.c's SenderBase).

`send`, `send_many` and `send_batch` are one C call each; what the C fast path leaves to
Python comes to the `_*_slow` methods here: payloads to pickle, keys to encode, a full
channel to wait on (`_segment.wait_for_space`, the one wait of every sender).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any, NoReturn

import _shmchan_hot as _hot  # the per-message calls (csrc/hot/)

from . import codec, errors, overflow, timers
from ._lib import ffi, lib, raise_for
from ._segment import RX, Attachment, Segment, SpaceWait, deadline_of, shared_attachment

__all__ = ["Sender"]

SPILL = -1  # _wait_and_retry: the channel is full and has an overflow file to take it


class Sender(_hot.SenderBase):
    """Sends messages into a channel. Picklable; works after fork, spawn and forkserver.

    `send` is implemented in C (csrc/hot/sender.c); it calls `_send_slow` for whatever is
    not a bytes payload with plain keys on an open channel with room."""

    def __init__(self, channel: Attachment) -> None:
        self._channel = channel
        self._seg = channel._live()

    @classmethod
    def open(cls, name: str, *, path: str | os.PathLike[str] | None = None) -> Sender:
        return cls(shared_attachment(name, None if path is None else os.fspath(path)))

    def __reduce__(self) -> tuple[Any, ...]:
        seg = self._live()
        return (_open_sender, (seg.name, seg.path))

    def _live(self) -> Segment:
        if self._seg is None or self._channel._seg is None:
            raise errors.Closed("sender is closed")
        return self._seg

    def _encode(
        self, obj: object, keys: Any, timeout: float | None
    ) -> tuple[Segment, int, Any, Any, bytes, int]:
        """What a one-message send from Python starts with: the live segment (this
        process registered as its producer), the timeout checked (a bad one is refused
        before anything is sent), and the record's parts -- the payload's kind, its
        encoded buffer, that buffer as the core takes it, the key blob and the key count."""
        seg = self._live()
        deadline_of(timeout)
        kind, buf = codec.encode_payload(obj, seg.raw_only)
        blob, nkeys = codec.encode_keys(keys, seg.max_keys)
        if not seg.registered:
            seg.register_producer()
        data = buf if type(buf) is bytes else ffi.from_buffer("char[]", buf)
        return seg, kind, buf, data, blob, nkeys

    def _send_slow(self, obj: object, keys: Any, timeout: float | None) -> int:
        """send() for everything its C fast path leaves to Python."""
        seg, kind, buf, data, blob, nkeys = self._encode(obj, keys, timeout)
        s = seg.scratch()
        rc = lib.shm_send(
            seg.ptr, kind, data, len(data), blob, len(blob), nkeys, s.seq, s.stall, s.wake
        )
        if rc < 0:
            _refuse(seg, rc, "send", kind, len(data), len(blob), nkeys)
        if rc:
            deadline = deadline_of(timeout)
            rc = self._wait_and_retry(
                seg,
                rc,
                deadline,
                lambda: lib.shm_send(
                    seg.ptr, kind, data, len(data), blob, len(blob), nkeys, s.seq, s.stall, s.wake
                ),
                "send",
                spills=True,
            )
            if rc == SPILL:  # to the overflow file: its seq is given when taken back
                overflow.spill_one(seg, kind, buf, blob, nkeys, deadline, "send")
                return 0
        if s.wake[0]:
            seg.post(RX, 1)
        return int(s.seq[0])

    def _send_timed(
        self, obj: object, keys: Any, timeout: float | None, delay: object, ttl: object
    ) -> int:
        """send(..., delay=, ttl=): the record carries its due and expiry times
        (csrc/timers.c); with neither (both None or a zero delay) a plain send."""
        seconds = timers.check_delay("send: delay", delay)
        life = timers.check_ttl("send: ttl", ttl)
        if keys is None:
            keys = ()
        if not seconds and not life:
            return self._send_slow(obj, keys, timeout)
        now = time.time_ns()
        due, expire = timers.due_ns(seconds, now), timers.due_ns(life, now)
        seg, kind, _, data, blob, nkeys = self._encode(obj, keys, timeout)
        s = seg.scratch()

        def attempt() -> int:
            return int(
                lib.shm_send_timed(
                    seg.ptr,
                    kind,
                    data,
                    len(data),
                    blob,
                    len(blob),
                    nkeys,
                    due,
                    expire,
                    s.seq,
                    s.stall,
                    s.wake,
                )
            )

        rc = attempt()
        if rc < 0:
            _refuse(seg, rc, "send", kind, len(data) + 24, len(blob), nkeys)
        if rc:
            rc = self._wait_and_retry(seg, rc, deadline_of(timeout), attempt, "send")
        if s.wake[0]:
            seg.post(RX, 1)
        return int(s.seq[0])

    def _send_batch_slow(
        self,
        packed: tuple[int, bytes, bytes, bytes, bytes, bytes, bytes],
        seqs_buf: bytearray,
        done_so_far: int,
        timeout: float | None,
    ) -> memoryview:
        """send_batch() from message `done_so_far` on, when its C call did not send it all
        (full, unregistered, an odd timeout): waits like send_many."""
        if packed[0]:
            self._send_packed(packed, seqs_buf, done_so_far, timeout, "send_batch")
        else:
            self._live()
            deadline_of(timeout)
        return memoryview(seqs_buf).cast("Q")

    def _send_many_slow(
        self, items: Iterable[tuple[object, Any]], timeout: float | None
    ) -> list[int]:
        """send_many() when its C fast path cannot start (unregistered, closed, odd timeout)."""
        self._live()  # closed: Closed at once
        deadline_of(timeout)  # a bad timeout is refused before anything is sent
        packed = self._pack(items)
        if packed[0] == 0:
            return []
        return self._send_packed(packed, bytearray(8 * packed[0]), 0, timeout)

    def _send_packed(
        self,
        packed: tuple[int, bytes, bytes, bytes, bytes, bytes, bytes],
        seqs_buf: bytearray,
        done_so_far: int,
        timeout: float | None,
        what: str = "send_many",
    ) -> list[int]:
        """Send a packed batch from message `done_so_far` on, waiting while the channel
        is full; `seqs_buf` holds the seqs of those already sent (C calls this too).
        `what` names the call in errors: send_many or send_batch."""
        seg = self._live()
        deadline = deadline_of(timeout)
        if not seg.registered:
            seg.register_producer()
        n, kinds, data, lens, keyblob, klens, nkeys = packed
        c_kinds = ffi.from_buffer("uint32_t[]", kinds)
        c_lens = ffi.from_buffer("uint64_t[]", lens)
        c_klens = ffi.from_buffer("uint32_t[]", klens)
        c_nkeys = ffi.from_buffer("uint32_t[]", nkeys)
        seqs = ffi.from_buffer("uint64_t[]", seqs_buf)
        done = ffi.new("uint32_t *", done_so_far)
        s = seg.scratch()

        def attempt() -> int:
            rc = int(
                lib.shm_send_many(
                    seg.ptr,
                    n,
                    c_kinds,
                    data,
                    len(data),
                    c_lens,
                    keyblob,
                    len(keyblob),
                    c_klens,
                    c_nkeys,
                    seqs,
                    done,
                    s.stall,
                    s.wake,
                )
            )
            # Wake a sleeping receiver after every call, also one that stopped part-way
            # (FULL): the messages it committed are what the receiver must take to free
            # the space we are about to wait for.
            if s.wake[0]:
                seg.post(RX, 1)
            return rc

        try:
            rc = attempt()
            if rc < 0:
                _refuse_batch(seg, rc, packed, what)
            if rc:
                rc = self._wait_and_retry(seg, rc, deadline, attempt, what, spills=True)
            if rc == SPILL:  # the rest to the overflow file, in one write; their seqs 0
                overflow.spill_packed(seg, packed, int(done[0]), deadline, what)
                for i in range(int(done[0]), n):
                    seqs[i] = 0
                done[0] = n
        except (errors.Full, errors.Closed) as e:
            e.seqs = list(ffi.unpack(seqs, done[0]))  # the prefix that went in
            raise
        return list(ffi.unpack(seqs, n))

    def _wait_and_retry(
        self,
        seg: Segment,
        rc: int,
        deadline: float | None,
        attempt: Any,
        what: str,
        spills: bool = False,
    ) -> int:
        """Retry a send that returned FULL or STALLED until it succeeds or time runs out
        (the senders' one wait: _segment.SpaceWait). With `spills`, a FULL on a channel
        with an overflow returns SPILL instead of waiting: the caller appends to the
        overflow file (shmchan.overflow)."""
        s = seg.scratch()
        with SpaceWait(what, deadline) as wait:
            while rc:
                if rc == lib.SHM_FULL:
                    if spills and overflow.spill_of(seg) is not None:
                        return SPILL
                    wait.full(seg)
                elif rc == lib.SHM_STALLED:
                    wait.stalled(seg, s.stall)
                else:
                    raise_for(rc, what)
                rc = attempt()
        return rc

    def _space_waiting(self, arm: bool) -> Segment:
        """Count the caller in (arm) or out of the senders waiting for space, as a
        blocked send does (csrc/ring.c): the asyncio send's hook (shmchan.aio)."""
        seg = self._live()
        pass_on = seg.scratch().pass_on
        lib.shm_space_wait(seg.ptr, 1 if arm else 0, pass_on)
        if not arm and pass_on[0]:
            seg.wake_sender()  # pass the wake-up on to the next waiter (csrc/ring.c)
        return seg

    async def send_async(self, obj: object, keys: Any = (), timeout: float | None = None) -> int:
        """send() for asyncio: waits for space without blocking the event loop; returns
        the message's sequence number. A cancelled await has sent nothing."""
        from . import aio  # asyncio is imported by the first asyncio call, not by import shmchan

        return await aio.send(
            lambda: self.send(obj, keys, 0), self._space_waiting, timeout, "send_async"
        )

    def close(self) -> None:
        """Stop using this Sender (idempotent); later sends raise Closed."""
        self._seg = None  # type: ignore[assignment]

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refuse(
    seg: Segment, rc: int, what: str, kind: int, size: int, keys_len: int, nkeys: int
) -> NoReturn:
    """Raise for a message the core refused (rc < 0), with the figures."""
    if rc == lib.SHM_E_TOO_LARGE:
        rec = ffi.new("uint64_t[2]")
        lib.shm_message_size(seg.ptr, kind, size, keys_len, nkeys, rec, rec + 1)
        raise errors.MessageTooLarge(
            f"{what}: a message of {size} payload bytes and {keys_len} key bytes needs "
            f"{int(rec[0])} bytes in the ring, but channel {seg.name!r} takes at most "
            f"{int(rec[1])} per message (capacity {seg.capacity}): your message is too "
            "large for this channel, whatever is released"
        )
    raise_for(rc, what)


def _refuse_batch(
    seg: Segment,
    rc: int,
    packed: tuple[int, bytes, bytes, bytes, bytes, bytes, bytes],
    what: str = "send_many",
) -> NoReturn:
    """Raise for a batch (of `what`: send_many or send_batch) the core refused before
    sending any of it: name the first message that cannot go."""
    n, kinds, _data, lens, _keys, klens, nkeys = packed
    k_kinds = memoryview(kinds).cast("I")
    k_lens = memoryview(lens).cast("Q")
    k_klens = memoryview(klens).cast("I")
    k_nkeys = memoryview(nkeys).cast("I")
    rec = ffi.new("uint64_t[2]")
    for i in range(n):
        args = (k_kinds[i], k_lens[i], k_klens[i], k_nkeys[i])
        bad = lib.shm_message_size(seg.ptr, *args, rec, rec + 1)
        if bad:
            _refuse(seg, bad, f"{what}: item {i} (nothing was sent)", *args)
    raise_for(rc, f"{what} (nothing was sent)")


def _open_sender(name: str, path: str | None) -> Sender:
    return Sender.open(name, path=path)
