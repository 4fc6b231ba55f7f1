"""Handle, Batch and DeadLetter: messages on loan (the Python halves of csrc/hot/handle.c's
HandleBase and csrc/hot/batch.c's BatchBase), and handing handles over between processes
(`hand_over`, `split_hand_over`, `adopt`; csrc/hot/handover.c).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

import _shmchan_hot as _hot  # the per-message calls (csrc/hot/)

from . import codec, errors, liveness, timers
from ._lib import ffi, lib, raise_for
from ._segment import (
    HANDOVER,
    HANDOVER_MAGIC,
    NO_PATH,
    RX,
    Attachment,
    Segment,
    address,
    attachment_of,
    check_seconds,
)
from .sender import Sender

__all__ = ["Handle", "Batch", "DeadLetter", "hand_over", "split_hand_over", "adopt"]


class Handle(_hot.HandleBase):
    """A message on loan with its keys locked, until released (or nacked).

    The per-message part is implemented in C (csrc/hot/handle.c): the fields, `payload`
    for bytes, `release` / `ack`, `with`, and releasing on garbage collection in the
    process that holds it."""

    __slots__ = ()

    @classmethod
    def _from_msg(cls, seg: Segment, m: Any) -> Handle:
        handles: list[Handle] = _hot.handles_from(seg, address(m), 1)
        return handles[0]

    def _locate(self, m: Any) -> None:
        """Take the (possibly moved) location from a fresh description."""
        vals = ffi.unpack(ffi.cast("uint64_t *", m), lib.SHM_MSG_WORDS)
        (
            self._kind,
            self._data_off,
            self._data_len,
            self._keys_off,
            self._keys_len,
            self._nkeys,
            self._pos,
            self._word,
        ) = vals[4:]

    def _check(self) -> Segment:
        if self._done:
            raise errors.Closed(f"handle seq={self.seq} was already released")
        seg: Segment = self._seg
        return seg

    def _refresh(self, seg: Segment) -> None:
        m = ffi.new("shm_msg *")
        rc = lib.shm_handle_info(seg.ptr, self._slot, self._gen, m)
        if rc:
            self._fail(rc, "read handle", " (released, redelivered or revoked)")
        self._locate(m)

    def _fail(self, rc: int, what: str, why_stale: str = "") -> NoReturn:
        """Raise for the failed status of a call on this handle: Closed if it is no
        longer held, else the status's exception."""
        if rc == lib.SHM_STALE:
            raise errors.Closed(f"handle seq={self.seq} is no longer held{why_stale}")
        raise_for(rc, what)

    def _copy(self, keys: bool) -> bytes:
        """Copy the payload (or key blob) out, seqlock-style: the receiver may move the
        record while we read (csrc/compact.c); accept only bytes it did not move."""
        seg = self._check()
        for _ in range(1000):
            off, size = (
                (self._keys_off, self._keys_len) if keys else (self._data_off, self._data_len)
            )
            raw = bytes(seg.mem[off : off + size])
            if lib.shm_unmoved(seg.ptr, self._slot, self._word, self._pos) == lib.SHM_OK:
                return raw
            self._refresh(seg)
        raise errors.Error(f"handle seq={self.seq}: its record kept moving while being read")

    def _data_slow(self, rc: int | None = None) -> memoryview:
        """data for what the C getter leaves to Python: released or stale handles, a
        record the receiver is stuck moving (each raises its exception here). `rc` is
        the status of the view the C getter already tried, if any."""
        seg = self._check()
        m = seg.scratch().msgs  # element 0 of this thread's scratch array
        if rc is None or rc == lib.SHM_OK:
            rc = lib.shm_handle_view(seg.ptr, self._slot, self._gen, m)
        if rc == lib.SHM_BUSY:
            raise errors.Error(f"handle seq={self.seq}: the receiver is stuck moving its record")
        if rc:
            self._fail(rc, "view handle")
        self._locate(m)
        return seg.mem[self._data_off : self._data_off + self._data_len]

    def _payload_slow(self) -> Any:
        """payload for what the C getter leaves to Python: pickled objects, records that
        moved while being copied, released handles."""
        raw = self._copy(keys=False)
        if self._kind == codec.RAW:
            return raw
        if self._seg.raw_only:  # the C core refuses such records too; never unpickle
            raise errors.ChannelCorrupted('a pickled record in a serializer="raw" channel')
        return codec.decode_payload(self._kind, memoryview(raw))

    def _keys_slow(self) -> tuple[codec.Key, ...]:
        """keys for what the C getter leaves to Python: big ints, long key blobs, a
        record that moved while being copied, released handles, malformed blobs."""
        return codec.decode_keys(self._copy(keys=True), self._nkeys)

    def _released(self, r: int) -> NoReturn:
        """A release whose core call failed with status r (C calls this): raise it."""
        raise_for(r, "release")

    def nack(self, delay: float | None = None) -> None:
        """Give the message back: it is delivered again (attempt + 1) before anything
        behind it on its keys.

        `delay` (seconds): not before then. Its keys stay reserved for it meanwhile:
        nothing behind it on any of its keys is handed out until it has been delivered
        again and released (or it has run out of attempts); other keys flow. Kept by a
        receiver that restarts, and by a durable channel; see `shmchan.backoff` and
        `nack_backoff` for a growing delay."""
        if delay is not None and not self._done:
            ms = timers.nack_delay_ms(delay)
            if ms:
                rc = lib.shm_nack_delay(self._seg.ptr, self._slot, self._gen, ms)
                if rc:
                    raise_for(rc, "nack")
        self._finish(1)

    def nack_backoff(
        self,
        *,
        base: float = 0.1,
        factor: float = 2.0,
        cap: float = 60.0,
        jitter: float = 0.5,
    ) -> float:
        """nack(delay=shmchan.backoff(self.attempt, ...)): give the message back to be
        retried after a delay that grows with each attempt. Returns the delay."""
        delay = timers.backoff(self.attempt, base=base, factor=factor, cap=cap, jitter=jitter)
        self.nack(delay=delay)
        return delay

    def extend(self, seconds: float) -> None:
        """Push this handle's lease deadline to `seconds` from now (inf: no deadline)."""
        seg = self._check()
        secs = check_seconds("extend: seconds", seconds)
        if secs == 0:
            raise errors.InvalidArgument("extend: seconds must be > 0")
        if secs == math.inf or secs * 1e9 >= 2**62:
            deadline = 0  # no lease deadline from now on
        else:
            deadline = time.clock_gettime_ns(time.CLOCK_MONOTONIC) + max(1, int(secs * 1e9))
        rc = lib.shm_handle_extend(seg.ptr, self._slot, self._gen, deadline)
        if rc:
            self._fail(rc, "extend", " (lease expired or released)")

    def __copy__(self) -> NoReturn:
        raise errors.UnsupportedType(
            f"a Handle cannot be copied (seq={self.seq}): it is the one holder of its "
            "message's keys. Copy its payload (h.payload, bytes(h.data)) instead, or "
            "pickle it to hand it over to another process"
        )

    def __deepcopy__(self, memo: object) -> NoReturn:
        self.__copy__()

    def __reduce__(self) -> tuple[Any, ...]:
        if self._done:
            # Released or given back here already: it travels as a no-op handle, as
            # hand_over() sends one (a second release is a no-op).
            seg: Segment = self._seg
            return (_released_handle, (seg.name, seg.path, self._slot, self._gen, seg.chan_id))
        seg = self._check()
        # Hand-over: the handle is in transit until a process unpickles it (which then
        # holds it) or the channel's `handover` seconds pass (then it is taken back and
        # redelivered; csrc/handles.c). We no longer release it when garbage-collected.
        # A handle already released or taken back pickles to a no-op one.
        rc = lib.shm_handle_send(seg.ptr, self._slot, self._gen)
        if rc not in (lib.SHM_OK, lib.SHM_STALE):
            raise_for(rc, "pickle handle")
        self._pid = -1
        return (_adopt_handle, (seg.name, seg.path, self._slot, self._gen, seg.chan_id))

    def __repr__(self) -> str:
        state = "released" if self._done else "held"
        return f"<shmchan.Handle seq={self.seq} attempt={self.attempt} {state}>"


def _released_handle(name: str, path: str | None, slot: int, gen: int, chan_id: int) -> Handle:
    """Unpickle a handle that was pickled after its release: a no-op one (its release()
    does nothing, its payload raises Closed). Nothing in the channel is touched."""
    m = ffi.new("shm_msg *")
    m.slot, m.gen = slot, gen
    h = Handle._from_msg(attachment_of(name, path, chan_id), m)
    h._done = True
    return h


def _adopt_handle(name: str, path: str | None, slot: int, gen: int, chan_id: int) -> Handle:
    seg = attachment_of(name, path, chan_id)
    rc = lib.shm_handle_adopt(seg.ptr, slot, gen, liveness.current_token())
    m = ffi.new("shm_msg *")
    if rc == lib.SHM_OK:
        rc = lib.shm_handle_info(seg.ptr, slot, gen, m)
    if rc == lib.SHM_LOST:
        raise errors.HandoverExpired(
            f"channel {name!r}: this handle was not unpickled within the channel's hand-over "
            "time (its message was taken back and redelivered), or another process adopted it"
        )
    if rc == lib.SHM_STALE:
        m.slot, m.gen = slot, gen
        h = Handle._from_msg(seg, m)
        h._done = True  # its message was released or redelivered meanwhile: a no-op handle
        return h
    if rc:
        raise_for(rc, "unpickle handle")
    return Handle._from_msg(seg, m)


def hand_over(handles: Iterable[Handle]) -> bytes:
    """Hand a batch of handles (of one channel) over to another process with one core
    call: what pickling each handle does, for many at once. Returns bytes to carry there
    (a pipe, a socket, a file) and pass to `adopt`. From now on each handle is in
    transit: this process no longer releases it when it is collected, and a handle not
    adopted within the channel's `handover` seconds is taken back and redelivered
    (attempt + 1). A handle already released travels as a no-op one."""
    hs = list(handles)
    if not hs:
        return HANDOVER.pack(HANDOVER_MAGIC, 0, 0, NO_PATH)
    seg = getattr(hs[0], "_seg", None)
    if not isinstance(seg, Segment):
        raise errors.UnsupportedType(f"hand_over: not a handle: {hs[0]!r}")
    pairs, worst = _hot.hand_over(seg, hs)
    if worst:
        raise_for(worst, "hand over")
    return seg.handover_prefix + pairs


def split_hand_over(data: bytes | bytearray | memoryview) -> list[bytes]:
    """The bytes of one `hand_over` of n handles as n hand-overs of one handle each, in
    order: each can be passed to `adopt` on its own, when its handle is wanted. A handle
    stays in transit until it is adopted, so the process that handed it over can still
    take it back by adopting it itself; whichever adoption comes first wins (the core
    decides, with one atomic step), the other gets a no-op handle, already released
    (its `data` and `payload` raise Closed)."""
    view = memoryview(data).cast("B")
    _, _, _, end = _hand_over_header(view, "split_hand_over")
    prefix = bytes(view[:end])
    return [prefix + bytes(view[i : i + 8]) for i in range(end, len(view), 8)]


def _hand_over_header(view: memoryview, what: str) -> tuple[int, int, int, int]:
    """(chan_id, name length, path length or NO_PATH, where the (slot, gen) pairs
    start) of hand_over() bytes, checked; InvalidArgument naming `what` if malformed."""
    size = HANDOVER.size
    if len(view) < size or bytes(view[:4]) != HANDOVER_MAGIC:
        raise errors.InvalidArgument(f"{what}: not the bytes of a hand_over()")
    _, chan_id, nlen, plen = HANDOVER.unpack_from(view)
    end = size + nlen + (0 if plen == NO_PATH else plen)
    if len(view) < end or (len(view) - end) % 8:
        raise errors.InvalidArgument(f"{what}: a truncated or malformed hand_over()")
    return chan_id, nlen, plen, end


def adopt(data: bytes | bytearray | memoryview) -> list[Handle]:
    """Take over, in this process, the handles `hand_over` handed over, with one core
    call: this process holds them from now on (its death sends them back with attempt
    + 1). A handle released, redelivered or taken back at its hand-over deadline meanwhile
    comes back already released, as a no-op one (its `data` and `payload` raise Closed);
    handing one over twice or adopting it twice never gives two processes one message."""
    view = memoryview(data).cast("B")
    chan_id, nlen, plen, end = _hand_over_header(view, "adopt")
    size = HANDOVER.size
    if len(view) == end:
        return []
    name = bytes(view[size : size + nlen]).decode()
    path = None if plen == NO_PATH else os.fsdecode(bytes(view[size + nlen : end]))
    seg = attachment_of(name, path, chan_id)
    hs: list[Handle]
    hs, worst = _hot.adopt_many(seg, view[end:], liveness.current_token())
    if worst:
        for h in hs:  # ours, but the batch failed: give them back rather than drop them
            with contextlib.suppress(errors.Error):
                h.nack()
        raise_for(worst, "adopt")
    return hs


class Batch(_hot.BatchBase):
    """Messages on loan as one object, from `Receiver.recv_batch`: no Python object per
    message unless asked for one.

    `len(b)` messages in delivery order; `b.seqs`, `b.attempts` and `b.lengths` are
    memoryviews of uint64; `b.payload(i)`, `b.keys(i)`, `b.payloads()`, and `b.joined()`
    (every payload back to back, split by `b.lengths`). `b.release()` releases every
    message still held, `b.release(i)` or `b.release([i, j, ...])` some of them, each
    exactly once; `b.nack(...)` gives messages back; `b.handle(i)` takes one out as a
    Handle of its own; `b.held` counts what is still held. `with b:` releases on exit,
    and a batch collected while holding messages releases them (in the receiving
    process). Keys stay locked until each message is released, exactly as with Handles.
    Implemented in C (csrc/hot/batch.c)."""

    __slots__ = ()

    def _released(self, r: int) -> NoReturn:
        """A release whose core call failed with status r (C calls this): raise it."""
        raise_for(r, "release")


@dataclass(frozen=True)
class DeadLetter:
    """A message that ran out of attempts, or expired (its `ttl` passed before it was
    handed out). Its keys are free again; it keeps its space in the channel until
    discarded (or re-sent, which discards it)."""

    seq: int
    keys: tuple[codec.Key, ...]
    payload: Any
    attempts: int
    _channel: Attachment
    _slot: int
    _gen: int
    reason: str = "attempts"
    """Why it died: "attempts" (out of max_attempts) or "expired" (its ttl)."""

    def discard(self) -> bool:
        """Drop it for good; False if it was already dropped."""
        seg = self._channel._live()
        wake = ffi.new("int *")
        rc = lib.shm_dead_discard(seg.ptr, self._slot, self._gen, wake)
        if wake[0] & 1:
            seg.post(RX, 1)
        if rc < 0:
            raise_for(rc, "discard dead letter")
        return bool(rc == lib.SHM_OK)

    def resend(self, sender: Sender | None = None, timeout: float | None = None) -> int:
        """Send it again as a new message (new seq, attempt 1) and discard this one."""
        tx = sender if sender is not None else Sender(self._channel)
        seq = tx.send(self.payload, keys=self.keys, timeout=timeout)
        self.discard()
        return seq


# The per-message calls reach the core through the functions of the cffi module loaded
# above (whichever build it is), and build Handles of the class defined here.
_hot.bind(
    {
        name: address(ffi.addressof(lib, name))
        for name in (
            "shm_send",
            "shm_recv",
            "shm_release",
            "shm_release_many",
            "shm_unmoved",
            "shm_rx_spin",
            "shm_send_many",
            "shm_handle_view",
            "shm_handle_send_many",
            "shm_handle_adopt_many",
            "shm_timers_wait",
            "shm_unmoved_many",
            "shm_release_msgs",
        )
    },
    Handle,
    codec.encode_payload,
    codec.encode_keys,
    Batch,
    errors.InvalidArgument,
    errors.UnsupportedType,
)
