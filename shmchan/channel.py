"""Channel and Stats: a named channel, created once and opened from any process, and
the public face of the package's per-type modules.

Each public type lives in its own module, named like its C half in csrc/hot/:
`Sender` (shmchan.sender), `Receiver` (shmchan.receiver), `Handle`, `Batch`,
`DeadLetter`, `hand_over`, `split_hand_over` and `adopt` (shmchan.handle); they are
importable from here too. Opening and naming segments is `shmchan._segment`'s.
"""

from __future__ import annotations

import contextlib
import math
import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import codec, deadroute, errors, liveness
from . import hold as _hold
from . import overflow as _overflow  # the parameter of create() is named overflow
from . import temporary as _temporary
from ._lib import ffi, lib, raise_for
from ._segment import (
    PREFIX,
    RX,
    SHM_DIR,
    TX,
    Attachment,
    Segment,
    check_name,
    check_seconds,
    create_segment,
    list_names,
    open_segment,
    read_identity,
    reap_dead_producers,
    unlink_name,
)
from .handle import Batch, DeadLetter, Handle, adopt, hand_over, split_hand_over
from .receiver import Receiver
from .sender import Sender

if TYPE_CHECKING:
    from . import inspect as _inspect

__all__ = [
    "Channel",
    "Sender",
    "Receiver",
    "Handle",
    "Batch",
    "Stats",
    "DeadLetter",
    "unlink",
    "list_channels",
    "hand_over",
    "split_hand_over",
    "adopt",
]


_ORDERS = {"fifo": lib.SHM_ORDER_FIFO, "eager": lib.SHM_ORDER_EAGER}
_SERIALIZERS = ("pickle", "raw")


@dataclass(frozen=True)
class Stats:
    """A snapshot of a channel's state, read without stopping anyone."""

    capacity: int
    """Bytes of message storage (the ring)."""
    used_bytes: int
    """Bytes of the ring not yet reclaimed (messages queued, in flight, or being written)."""
    queued: int
    """Messages accepted and not yet handed out (waiting for keys included)."""
    inflight: int
    """Handles handed out and not yet released."""
    held_keys: int
    """Keys locked by in-flight handles."""
    producers: int
    """Live processes registered as senders."""
    dead_letters: int
    """Messages that ran out of attempts."""
    sent: int
    """Messages accepted, ever."""
    delivered: int
    """Handles handed out, ever (redeliveries included)."""
    released: int
    """Handles released, ever."""
    redelivered: int
    """Deliveries after the first of the same message, ever."""
    discarded: int
    """Reservations of dead producers reclaimed, ever."""
    window: int
    """Messages in the receiver's scheduling window (max: max_messages)."""
    order: str
    """"fifo" or "eager"."""
    shutdown: bool
    """True once shutdown() was called."""
    receiver_pid: int | None
    """Pid of the process holding the receiver, if any."""
    committed_bytes: int = 0
    """Bytes of shared memory (or of the channel's file) backing the channel now: its
    fixed part plus what its traffic has used so far, never more than its full size."""
    delayed: int = 0
    """Messages held back until their due time (send's or nack's `delay`), keeping their
    keys; counted in `queued` too."""
    expired: int = 0
    """Messages that became dead letters because their `ttl` passed, ever."""
    table_bytes: int = 0
    """Of committed_bytes, the receiver's tables (messages taken in, their keys): kept
    within a tenth of ring_committed_bytes, beyond the handles held at once."""
    ring_committed_bytes: int = 0
    """Of committed_bytes, the ring's."""
    overflow_bytes: int = 0
    """Bytes of messages in the channel's overflow file, not yet taken back into the ring
    (0 for a channel without overflow=)."""
    overflow_messages: int = 0
    """Messages in the channel's overflow file, not yet taken back into the ring."""


class Channel(Attachment):
    """A named shared-memory channel; create it once, open it from any process."""

    def __init__(self, seg: Segment) -> None:
        super().__init__(seg)
        self._receivers: weakref.WeakSet[Receiver] = weakref.WeakSet()  # closed with it

    # -- construction ------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        name: str,
        capacity: int = 64 << 20,
        *,
        order: str = "fifo",
        max_keys: int = 8,
        max_messages: int | None = None,
        max_attempts: int | None = None,
        lease: float | None = None,
        handover: float = 2.0,
        serializer: str = "pickle",
        mode: int = 0o600,
        path: str | os.PathLike[str] | None = None,
        max_producers: int = 1024,
        dead_letter_exchange: object = None,
        temporary: bool = False,
        overflow: str | os.PathLike[str] | None = None,
        overflow_limit: int | None = None,
    ) -> Channel:
        """Make a new channel. Raises ChannelExists if the name is taken.

        * name: 1-200 characters from A-Z a-z 0-9 _ . -; the channel is /dev/shm/shmchan.NAME.
        * capacity: bytes of message storage; send blocks (or raises Full) when it is full.
        * order: "fifo" (per-key order: a message waits for every earlier message on its
          keys to be released) or "eager" (any message whose keys are free).
        * max_keys: keys a message may carry (TooManyKeys beyond).
        * max_messages: messages ready, in flight or dead at once (default capacity / 256,
          at least 8192); the segment's tables are sized for it.
        * max_attempts: deliveries before a message that comes back becomes a dead letter
          (None: no limit).
        * lease: seconds a handle may be held before it is taken back as if its holder died
          (None: no lease; Handle.extend renews it).
        * handover: seconds a pickled handle has to be unpickled before it is taken back.
        * serializer: "pickle" (any object) or "raw" (bytes-like payloads only).
        * mode: permissions of the segment and semaphores (default 0o600: your user only).
        * path: keep the channel in this regular file instead of /dev/shm (durable).
        * max_producers: processes registered as senders at once.
        * dead_letter_exchange: an Exchange (or its name) to publish dead letters to
          instead of keeping them (see route_dead_letters).
        * temporary: remove the channel when the last process using it exits, also if
          they were all killed (then at the next Channel.create on the machine, or the
          next `shmchan ls` / `rm --stale`); see shmchan/temporary.py. Not with path=.

        Creating a channel first removes the temporary channels no live process uses.
        * overflow: a directory; when the ring is full, sends append to a file there
          instead of waiting, and the receiver takes them back in order (None: sends
          wait). See the broker controls guide.
        * overflow_limit: bytes the overflow file may hold (None: what its file system
          takes); past it, sends wait for room and raise Full on timeout.
        """
        check_name(name)
        if not isinstance(temporary, bool):
            raise errors.UnsupportedType(
                f"temporary must be True or False, not {type(temporary).__name__}"
            )
        if temporary and path is not None:
            raise errors.InvalidArgument(
                "temporary=True cannot be combined with path=: a temporary channel lives in "
                "/dev/shm and goes with its last user; a path= channel is kept on purpose"
            )
        _temporary.sweep()
        cfg = ffi.new("shm_config *")
        cfg.capacity = _positive_int("capacity", capacity, minimum=64)
        if order not in _ORDERS:
            raise errors.InvalidArgument(f"order must be 'fifo' or 'eager', not {order!r}")
        cfg.order = _ORDERS[order]
        max_keys = _positive_int("max_keys", max_keys, minimum=0)
        if max_keys > lib.SHM_MAX_KEYS_LIMIT:
            raise errors.InvalidArgument(
                f"max_keys must be <= {lib.SHM_MAX_KEYS_LIMIT}, got {max_keys}"
            )
        cfg.max_keys = max_keys
        if max_messages is None:
            max_messages = min(max(cfg.capacity // 256, 8192), 1 << 22)
        cfg.max_messages = _positive_int("max_messages", max_messages, minimum=16)
        if max_messages > 1 << 24:
            raise errors.InvalidArgument(f"max_messages must be <= 16777216, got {max_messages}")
        cfg.max_attempts = (
            0 if max_attempts is None else _positive_int("max_attempts", max_attempts)
        )
        # lease=None or inf: no lease (a handle is held until released or its holder dies)
        lease_s = math.inf if lease is None else check_seconds("lease", lease)
        if lease_s == 0:
            raise errors.InvalidArgument("lease must be > 0 seconds, inf or None, got 0")
        if lease_s != math.inf and lease_s * 1e9 >= 2**62:
            raise errors.InvalidArgument(f"lease must be < 2**62 ns, inf or None, got {lease!r}")
        cfg.lease_ns = 0 if lease_s == math.inf else max(1, int(lease_s * 1e9))
        # a pickled handle's time to be unpickled (csrc/handles.c, hand-over)
        handover_s = check_seconds("handover", handover)
        if not 0.001 <= handover_s <= 3600:
            raise errors.InvalidArgument(
                f"handover must be between 0.001 and 3600 seconds, got {handover!r}"
            )
        cfg.handover_ns = int(handover_s * 1e9)
        if serializer not in _SERIALIZERS:
            raise errors.InvalidArgument(
                f"serializer must be 'pickle' or 'raw', not {serializer!r}"
            )
        cfg.flags = lib.SHM_CFG_RAW_ONLY if serializer == "raw" else 0
        if path is not None:  # records carry a checksum, checked when recovered
            cfg.flags |= lib.SHM_CFG_DURABLE
        if temporary:
            cfg.flags |= lib.SHM_CFG_TEMPORARY
        cfg.max_producers = _positive_int("max_producers", max_producers)
        if dead_letter_exchange is not None:
            deadroute.check_route(dead_letter_exchange)
        spill = None if overflow is None else _overflow_config(overflow, overflow_limit)
        if overflow is None and overflow_limit is not None:
            raise errors.InvalidArgument("overflow_limit= needs overflow=DIR as well")
        total = ffi.new("uint64_t *")
        rc = lib.shm_layout_size(cfg, total)
        if rc:
            raise_for(rc, "create", "configuration out of range")
        try:
            seg = create_segment(name, path, cfg, int(total[0]), mode)
        except errors.ChannelExists:
            if path is not None:
                raise
            raise errors.ChannelExists(_exists_text(name)) from None
        if dead_letter_exchange is not None:
            deadroute.set_route(seg, dead_letter_exchange)
        if spill is not None:
            _overflow.setup(seg, *spill)
        return cls(seg)

    @classmethod
    def open(cls, name: str, *, path: str | os.PathLike[str] | None = None) -> Channel:
        """Attach to an existing channel. Raises ChannelNotFound if there is none."""
        check_name(name)
        return cls(open_segment(name, path))

    # -- endpoints ---------------------------------------------------------------------
    def sender(self) -> Sender:
        """A sender bound to this channel (picklable: it re-opens by name)."""
        return Sender(self)

    def receiver(self) -> Receiver:
        """The channel's receiver. Raises ReceiverBusy while another live one exists."""
        seg = self._live()
        owner = ffi.new("uint64_t *")
        for _ in range(3):
            lib.shm_rx_owner(seg.ptr, owner)
            current = int(owner[0])
            if current and current == liveness.current_token():
                raise errors.ReceiverBusy(
                    f"channel {seg.name!r}: this process already holds the receiver"
                )
            if current and liveness.is_alive(current):
                raise errors.ReceiverBusy(
                    f"channel {seg.name!r}: the receiver is held by live pid "
                    f"{liveness.token_pid(current)}"
                )
            rc = lib.shm_rx_acquire(seg.ptr, current)
            if rc == lib.SHM_OK:
                rx = Receiver(self, seg)
                self._receivers.add(rx)
                return rx
            if rc != lib.SHM_BUSY:
                raise_for(rc, "receiver", "the previous receiver died in the middle of an update")
        raise errors.ReceiverBusy(f"channel {seg.name!r}: lost the race for the receiver")

    # -- inspection and control --------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Bytes of message storage: at most this much is queued, in flight or dead."""
        return self._live().capacity

    @property
    def created(self) -> float:
        """When the channel was created, as Unix time (seconds since the epoch)."""
        return self._live().created_ns / 1e9

    @property
    def handover(self) -> float:
        """Seconds a pickled handle has to be unpickled before it is taken back."""
        return self._live().handover_ns / 1e9

    @property
    def lease(self) -> float | None:
        """Seconds a handle is held before its message is taken back (unless extended),
        or None: no lease."""
        ns = self._live().lease_ns
        return ns / 1e9 if ns else None

    def stats(self) -> Stats:
        """A snapshot of the channel's counters and sizes, from any process, without
        stopping anyone (see Stats)."""
        seg = self._live()
        st = ffi.new("shm_stats *")
        lib.shm_stats_read(seg.ptr, st)
        producers = reap_dead_producers(seg)
        receiver = int(st.receiver)
        return Stats(
            capacity=int(st.capacity),
            used_bytes=int(st.used_bytes),
            queued=int(st.queued),
            inflight=int(st.inflight),
            held_keys=int(st.held_keys),
            producers=producers,
            dead_letters=int(st.dead_letters),
            sent=int(st.sent),
            delivered=int(st.delivered),
            released=int(st.released),
            redelivered=int(st.redelivered),
            discarded=int(st.discarded),
            window=int(st.window),
            order="eager" if st.order == lib.SHM_ORDER_EAGER else "fifo",
            shutdown=bool(st.shutdown),
            receiver_pid=liveness.token_pid(receiver) if receiver else None,
            committed_bytes=int(st.committed_bytes),
            **_timer_counts(seg),
            table_bytes=int(st.table_bytes),
            ring_committed_bytes=int(st.ring_committed),
            **_overflow_stats(seg),
        )

    def route_dead_letters(self, exchange: object) -> None:
        """Publish this channel's dead letters (out of attempts, or expired) to
        `exchange` (an Exchange or its name) instead of keeping them; None: keep them.
        Kept in the channel: every receiver, a restarted one too, routes them. Each goes
        with its payload and keys, its reason ("attempts" or "expired") as the routing
        key, all or nothing: one the exchange cannot take now stays in dead_letters()
        and is tried again at the receiver's next upkeep."""
        deadroute.set_route(self._live(), exchange)

    def dead_letter_exchange(self) -> str | None:
        """The name of the exchange dead letters are published to, or None."""
        return deadroute.get_route(self._live())

    def dead_letters(self) -> list[DeadLetter]:
        """Messages that ran out of attempts (max_attempts) or expired (send's ttl),
        oldest first; each says why in `reason`."""
        seg = self._live()
        out: list[DeadLetter] = []
        msgs = ffi.new("shm_msg[]", 64)
        n = ffi.new("uint32_t *")
        nxt = ffi.new("uint32_t *")
        start = 1
        retries = 0
        while True:
            lib.shm_dead_list(seg.ptr, start, msgs, 64, n, nxt)
            moved = 0
            for i in range(n[0]):
                m = msgs[i]
                raw = bytes(seg.mem[m.data_off : m.data_off + m.data_len])
                blob = bytes(seg.mem[m.keys_off : m.keys_off + m.keys_len])
                if lib.shm_unmoved(seg.ptr, m.slot, m.word, m.pos) != lib.SHM_OK:
                    moved = int(m.slot)  # moved (csrc/compact.c) or dropped while we read
                    break
                out.append(
                    DeadLetter(
                        seq=int(m.seq),
                        keys=codec.decode_keys(blob, m.nkeys),
                        payload=codec.decode_payload(m.kind, memoryview(raw)),
                        attempts=int(m.attempt),
                        _channel=self,
                        _slot=int(m.slot),
                        _gen=int(m.gen),
                        reason=_dead_reason(seg, int(m.slot)),
                    )
                )
            if moved and retries < 1000:
                retries += 1
                start = moved  # read it again from where it is now
                continue
            if nxt[0] == 0:
                break
            start = int(nxt[0])
        out.sort(key=lambda d: d.seq)
        return out

    # -- the operators' view (shmchan/inspect.py) -----------------------------------------
    def held(self) -> list[_inspect.HeldKey]:
        """Keys held by in-flight handles: who holds each, since when (any process)."""
        from . import inspect as _inspect  # on first use: keeps `import shmchan` light

        return _inspect.held(self)

    def waiting(self, top: int = 20) -> list[_inspect.Line]:
        """The `top` deepest lines of messages waiting for a key, deepest first."""
        from . import inspect as _inspect

        return _inspect.waiting(self, top)

    def why_waiting(self, seq: int) -> _inspect.WaitChain:
        """Why message `seq` is not handed out: the chain of messages it waits behind,
        ending at one in flight (with its holder's pid). Empty, with `.state` saying
        what the message is, if it is not waiting (see shmchan/inspect.py)."""
        from . import inspect as _inspect

        return _inspect.why_waiting(self, seq)

    @property
    def temporary(self) -> bool:
        """True for a channel created with temporary=True: removed when its last user exits."""
        return self._live().temporary

    def pause(self) -> None:
        """Pause the channel: its receiver (in any process) hands out nothing from its next
        poll on, until resume(). Producers still send; handles already out stay valid. The
        pause is kept in the channel, for whoever receives next (see shmchan/hold.py)."""
        _hold.pause(self._live())

    def resume(self) -> None:
        """End pause(): the receiver is woken and hands out again. Keys paused one by one
        stay paused."""
        _hold.resume(self._live())

    def pause_key(self, key: codec.Key) -> None:
        """Hold back messages carrying `key`. Per-key order is kept: nothing behind a
        held-back message on any of its keys passes it; other keys flow. At most
        shmchan.hold.MAX_PAUSED_KEYS keys at once (TooManyPausedKeys)."""
        _hold.pause_key(self._live(), key)

    def resume_key(self, key: codec.Key) -> bool:
        """End pause_key(key); False if the key was not paused."""
        return _hold.resume_key(self._live(), key)

    def pause_state(self) -> _hold.PauseState:
        """What is paused: the channel, and which keys."""
        return _hold.state(self._live())

    def shutdown(self) -> None:
        """Refuse new sends (they raise Closed); the receiver drains what was accepted."""
        seg = self._live()
        lib.shm_shutdown(seg.ptr)
        seg.post(RX, 1)
        seg.post(TX, 64)

    def flush(self) -> None:
        """Write the segment back to its file and wait for the disk (msync). Meaningful
        for channels created with path=; see the durability guide."""
        rc = lib.shm_sync(self._live().ptr)
        if rc:
            raise_for(rc, "flush")

    def close(self) -> None:
        """Detach this process's Channel object (idempotent). Other processes carry on."""
        for rx in list(self._receivers):  # like its senders, its receiver is closed too
            rx._closed_why = "the Channel it came from was closed"
            rx.close()
        super().close()

    def unlink(self) -> None:
        """Remove this channel: its name and semaphores go, its sends are refused from now
        on (ChannelRemoved), and its receiver may drain what was accepted. If the name
        was meanwhile given to another channel, that one is left alone and this raises
        ChannelNotFound (as it does when the channel was already removed)."""
        if self._seg is None:
            where = "" if self._path is None else f", path={self._path!r}"
            raise errors.Closed(
                f"this Channel object is closed; to remove the channel after close(), "
                f"call shmchan.unlink({self._name!r}{where}), or unlink() before close()"
            )
        seg = self._live()
        lib.shm_mark_removed(seg.ptr)  # whatever the name means now, this one is gone
        seg.post(RX, 1)
        seg.post(TX, 64)
        removed = unlink_name(seg.name, seg.path, seg.chan_id)
        if removed:
            _overflow.remove_file(seg)
        if not removed:
            raise errors.ChannelNotFound(
                f"channel {seg.name!r} was already removed"
                + (
                    ""
                    if read_identity(seg.name, seg.path) is None
                    else "; the name now belongs to another channel, which was left alone"
                )
            )

    def removed(self) -> bool:
        """True once this channel was removed: unlinked by any process, or its name
        removed or given to a new channel behind shmchan's back. Its sends are refused
        (ChannelRemoved); its receiver drains. Reads the name: not for a hot loop."""
        return self._live().removed()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._seg is None:
            return "<shmchan.Channel (closed)>"
        return f"<shmchan.Channel {self._seg.name!r} capacity={self._seg.capacity}>"


def _timer_counts(seg: Segment) -> dict[str, int]:
    """Stats' counts of the timers (csrc/timers.c)."""
    ts = ffi.new("shm_timer_stats *")
    lib.shm_timer_stats_read(seg.ptr, ts)
    return {"delayed": int(ts.delayed), "expired": int(ts.expired)}


def _dead_reason(seg: Segment, slot: int) -> str:
    """Why the dead letter in `slot` died (csrc/timers.c)."""
    due = ffi.new("uint64_t[2]")
    reason = ffi.new("uint32_t *")
    lib.shm_slot_timers(seg.ptr, slot, due, due + 1, reason)
    return "expired" if reason[0] == lib.SHM_DEAD_EXPIRED else "attempts"


def _overflow_config(directory: object, limit: object) -> tuple[str, int]:
    return _overflow.check_dir(directory, limit)  # type: ignore[arg-type]  # checked there


def _overflow_stats(seg: Segment) -> dict[str, int]:
    use = _overflow.usage(seg)
    return {} if use is None else {"overflow_bytes": use.bytes, "overflow_messages": use.messages}


def _positive_int(what: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise errors.UnsupportedType(f"{what} must be an int, not {type(value).__name__}")
    if value < minimum:
        raise errors.InvalidArgument(f"{what} must be >= {minimum}, got {value}")
    return value


def _exists_text(name: str) -> str:
    """ChannelExists's message: whether the channel is in use, and what to do either way."""
    from . import inspect as _inspect_mod  # on first use: keeps `import shmchan` light

    file = os.path.join(SHM_DIR, PREFIX + name)
    try:
        users = _inspect_mod.mapping_pids([file])[os.path.realpath(file)]
    except OSError:
        users = {0}  # cannot tell: do not call it a leftover
    if not users:
        return (
            f"channel {name!r} already exists and no live process maps it: it is a leftover "
            f"of a process that ended without unlinking it; remove it with "
            f"`shmchan rm {name}` (or shmchan.unlink({name!r})), or attach to it with "
            f"Channel.open({name!r})"
        )
    return (
        f"channel {name!r} already exists and is in use; attach to it with "
        f"Channel.open({name!r}), or pick another name"
    )


def unlink(name: str, *, path: str | os.PathLike[str] | None = None) -> None:
    """Remove the channel of that name (its segment, or file for path= channels, and its
    semaphores); processes attached to it are refused further sends (ChannelRemoved)
    and its receiver drains. ChannelNotFound if there is none."""
    check_name(name)
    where = None if path is None else os.fspath(path)
    spill_file = _overflow.file_of(name, where)  # read before the name goes
    if not unlink_name(name, where, 0):
        raise errors.ChannelNotFound(f"no channel named {name!r}")
    if spill_file is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(spill_file)


def list_channels() -> list[str]:
    """Names of the channels in /dev/shm (file-backed channels are not listed)."""
    return list_names()
