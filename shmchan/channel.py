"""Channel, Sender, Receiver, Handle and Stats: the public face of the C core.

Thin by design: each hot operation (send, recv, release) is one C call; this layer adds
only what the C core must not do itself: opening named objects, blocking on semaphores
with timeouts, deciding liveness (shmchan.liveness) and (de)serialization
(shmchan.codec).
"""

from __future__ import annotations

import contextlib
import errno
import math
import numbers
import os
import re
import struct
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import _shmchan_hot as _hot  # the per-message calls (csrc/hot/)
import posix_ipc

from . import codec, errors, liveness
from ._lib import ffi, lib, raise_for

if TYPE_CHECKING:
    from . import inspect as _inspect

__all__ = [
    "Channel",
    "Sender",
    "Receiver",
    "Handle",
    "Stats",
    "DeadLetter",
    "unlink",
    "list_channels",
    "hand_over",
    "adopt",
]

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")
_PREFIX = "shmchan."
_SHM_DIR = "/dev/shm"
_SPIN_SECONDS = 50e-6  # poll this long before sleeping on the semaphore
_SPIN_PAUSES = 500  # CPU pause instructions per spin round (a few microseconds)
_MAINTENANCE_SECONDS = 0.1  # longest single sleep: liveness checks run at least this often
_STALL_CHECK_SECONDS = 0.01  # how long a stuck claim may stall us before we check its owner
_STALL_NAP_SECONDS = 0.0002  # a sender's first sleep behind a stuck claim; doubles each time
_SWEEP_SECONDS = 1.0  # how often the receiver looks for releases whose releaser died mid-way
_REAPING = 1 << 63  # a producer registry entry's owner word while it is reaped (csrc/segment.c)
_NAME_CHECK_SECONDS = 0.05  # how often a waiting sender checks that its name still holds
_HOLDER_REVOKED = 1  # csrc/core.h HOLDER_REVOKED
_RX, _TX = 0, 1  # _Segment.post / .wait: the receiver's semaphore, the senders'
_ORDERS = {"fifo": lib.SHM_ORDER_FIFO, "eager": lib.SHM_ORDER_EAGER}
_SERIALIZERS = ("pickle", "raw")


def _check_name(name: str) -> str:
    if not isinstance(name, str):
        raise errors.UnsupportedType(f"channel name must be a str, not {type(name).__name__}")
    if not _NAME_RE.fullmatch(name):
        raise errors.InvalidArgument(
            f"invalid channel name {name!r}: use 1-200 characters from A-Z a-z 0-9 _ . - "
            "not starting with '.' or '-'"
        )
    return name


def _shm_name(name: str) -> str:
    return "/" + _PREFIX + name


def _sem_names(name: str) -> tuple[str, str]:
    return "/" + _PREFIX + name + ".rx", "/" + _PREFIX + name + ".tx"


def _name_file(name: str, path: str | None) -> str:
    """The file a channel's name refers to: its /dev/shm entry, or its path= file."""
    return os.path.join(_SHM_DIR, _PREFIX + name) if path is None else path


def _read_identity(name: str, path: str | None) -> int | None:
    """The chan_id of the channel the name refers to now; None if there is none (or it
    is not a finished channel of this layout). Three system calls: off the hot path."""
    try:
        fd = os.open(_name_file(name, path), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        out = ffi.new("uint64_t *")
        return int(out[0]) if lib.shm_read_identity(fd, out) == lib.SHM_OK else None
    finally:
        os.close(fd)


def _seconds(what: str, value: object) -> float:
    """A number of seconds given by the caller: >= 0, inf allowed (meaning "never"), NaN,
    negatives and non-numbers refused with an error that names the argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise errors.UnsupportedType(
            f"{what} must be a number of seconds (int or float) or None, "
            f"not {type(value).__name__} ({value!r:.40})"
        )
    try:
        seconds = float(value)
    except OverflowError:  # an int too big for a float: longer than anyone waits
        seconds = -math.inf if str(value).startswith("-") else math.inf
    if math.isnan(seconds):
        raise errors.InvalidArgument(f"{what} must be a number of seconds >= 0 or None, not NaN")
    if seconds < 0:
        raise errors.InvalidArgument(f"{what} must be >= 0 seconds or None, got {value!r}")
    return seconds


def _deadline(timeout: object, what: str = "timeout") -> float | None:
    """time.monotonic() at which a wait of `timeout` seconds ends; None: never (None or
    inf). Refuses bad timeouts (see _seconds) before anything is done."""
    if timeout is None:
        return None
    seconds = _seconds(what, timeout)
    return None if seconds == math.inf else time.monotonic() + seconds


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


# ---------------------------------------------------------------------------------------
# the attachment: one per Channel object
# ---------------------------------------------------------------------------------------


def _address(p: Any) -> int:
    return int(ffi.cast("uintptr_t", p))


class _Segment(_hot.SegmentBase):
    """One process's mapping of a channel plus its two semaphores.

    The base class holds what the per-message calls read: the core's pointer, the
    mapping, `registered`, `closed` and `pid`."""

    def __init__(self, name: str, path: str | None, ptr: Any, rx_sem: Any, tx_sem: Any) -> None:
        self.name = name
        self.path = path
        self.ptr = ptr
        self.rx_sem = rx_sem
        self.tx_sem = tx_sem
        cfg = ffi.new("shm_config *")
        lib.shm_read_config(ptr, cfg)
        self.capacity = int(cfg.capacity)
        self.max_keys = int(cfg.max_keys)
        self.raw_only = bool(cfg.flags & lib.SHM_CFG_RAW_ONLY)
        self.lease_ns = int(cfg.lease_ns)
        ident = ffi.new("uint64_t[2]")
        lib.shm_identity(ptr, ident, ident + 1)
        self.chan_id = int(ident[0])  # which channel this is (see csrc/segment.c)
        self.created_ns = int(ident[1])
        self._next_name_check = 0.0
        self.handover_ns = int(cfg.handover_ns)
        self.handover_prefix = _handover_prefix(name, path, self.chan_id)  # see hand_over()
        # The whole mapping as one buffer; handle views are slices of it. The buffer keeps
        # `base` alive, and `base` unmaps the segment when the last slice is gone.
        size = lib.shm_mapped_size(ptr)
        # When garbage collection finalizes a cycle, `base`'s destructor may run before
        # a Handle's __del__ in the same cycle: the flag lets the late one see it.
        detached = self.detached = [False]

        def _detach(_p: Any, _c: Any = ptr, _flag: list[bool] = detached) -> None:
            _flag[0] = True
            lib.shm_detach(_c)

        base = ffi.gc(lib.shm_base(ptr), _detach, size=size)
        self.mem = memoryview(ffi.buffer(base, size)).toreadonly()
        self._bind(
            _address(ptr),
            _address(base),
            size,
            self.max_keys,
            self.raw_only,
            detached,
            self.mem,
            rx_sem.name,
            tx_sem.name,
        )
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.registered = False
        # Tokens recorded in a previous boot (file-backed channels) mean nothing now.
        lib.shm_boot_check(ptr, liveness.boot_id())
        # scratch structs for the calling thread's C calls
        self._local = threading.local()
        _segments.add(self)

    def scratch(self) -> Any:
        s = getattr(self._local, "s", None)
        if s is None:
            s = _Scratch()
            self._local.s = s
        return s

    def removed(self, every: float = 0.0) -> bool:
        """Was this channel removed? True once unlink() marked it, or once its name no
        longer means this segment (someone removed the name some other way, or gave it to
        a new channel); then it is marked, so that its senders are refused at once.
        Reads the name through the file system: call it off the hot path, at most once
        per `every` seconds (between checks only the flag is read)."""
        if lib.shm_removed(self.ptr):
            return True
        now = time.monotonic()
        if now < self._next_name_check:
            return False
        self._next_name_check = now + every
        try:
            current = _read_identity(self.name, self.path)
        except OSError:
            return False  # cannot tell (e.g. permissions): assume it is still ours
        if current == self.chan_id:
            return False
        lib.shm_mark_removed(self.ptr)
        self.post(_RX, 1)  # the receiver learns it may end once drained
        self.post(_TX, 64)  # waiting senders are refused
        return True

    def after_fork(self) -> None:
        lib.shm_set_identity(self.ptr, liveness.current_token())
        self.pid = os.getpid()
        self.registered = False
        self.lock = threading.Lock()
        self._local = threading.local()

    def register_producer(self) -> None:
        with self.lock:
            if self.registered:
                return
            rc = lib.shm_producer_attach(self.ptr)
            if rc == lib.SHM_FULL:
                reap_dead_producers(self)
                rc = lib.shm_producer_attach(self.ptr)
            if rc == lib.SHM_FULL:
                raise errors.Error(
                    f"channel {self.name!r}: every producer registry slot is held by a live process"
                )
            if rc:
                raise_for(rc, "register producer")
            self.registered = True


class _Scratch:
    """Per-thread out-parameters, allocated once (ffi.new is not free)."""

    __slots__ = ("seq", "stall", "wake", "pass_on", "got", "waiters", "msgs", "nmsgs", "writing")

    def __init__(self) -> None:
        self.seq = ffi.new("uint64_t *")
        self.stall = ffi.new("shm_stall *")
        self.wake = ffi.new("int *")
        self.pass_on = ffi.new("int *")  # shm_space_wait's: wake the next waiting sender
        self.got = ffi.new("uint32_t *")
        self.waiters = ffi.new("uint32_t *")
        self.msgs = ffi.new("shm_msg[]", 1)
        self.nmsgs = 1
        self.writing: tuple[Any, Any] | None = None  # Receiver._discard_dead_writers

    def msg_array(self, n: int) -> Any:
        if n > self.nmsgs:
            self.msgs = ffi.new("shm_msg[]", n)
            self.nmsgs = n
        return self.msgs


_segments: weakref.WeakSet[_Segment] = weakref.WeakSet()


def _reset_after_fork() -> None:
    # Only the forking thread lives on in the child: a lock another thread of the parent
    # held at the fork would stay held for ever. Every threading lock of this module the
    # child may take is made anew here (each segment's in after_fork).
    global _shared_lock
    _shared_lock = threading.Lock()
    for seg in list(_segments):
        seg.after_fork()


os.register_at_fork(after_in_child=_reset_after_fork)


def reap_dead_producers(seg: _Segment) -> int:
    """Free registry entries of dead producers; returns how many live ones remain.

    An entry whose owner word has bit 63 set is being reaped: the rest is its reaper's
    token. If that reaper died mid-way the reap is finished here (csrc/segment.c)."""
    owner = ffi.new("uint64_t *")
    live = 0
    i = 0
    while lib.shm_producer_slot_owner(seg.ptr, i, owner) == lib.SHM_OK:
        token = int(owner[0])
        if token and token < _REAPING:
            if liveness.is_alive(token):
                live += 1
            else:
                lib.shm_producer_reap(seg.ptr, i, token)
        elif token and not liveness.is_alive(token - _REAPING):
            lib.shm_producer_reap(seg.ptr, i, token)  # the mark of a reaper that died
        i += 1
    return live


def _resolve_stall(seg: _Segment, stall: Any, consumer: bool) -> None:
    """A claim has been stuck for a while: repair it if its producer is dead."""
    owner = int(stall.owner)
    if liveness.is_alive(owner):
        return
    rc = lib.shm_repair_claim(seg.ptr, stall.pos, owner)
    if rc != lib.SHM_OK and consumer:
        rc = lib.shm_discard_dead(seg.ptr, stall.pos, owner)
        if rc != lib.SHM_OK:  # a dead publisher's gated record: its exchange decides
            from .exchange import resolve_gate  # (exchange imports this module)

            resolve_gate(seg, int(stall.pos), owner)


# ---------------------------------------------------------------------------------------
# Stats
# ---------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class DeadLetter:
    """A message that ran out of attempts. Its keys are free again; it keeps its space
    in the channel until discarded (or re-sent, which discards it)."""

    seq: int
    keys: tuple[codec.Key, ...]
    payload: Any
    attempts: int
    _channel: Channel
    _slot: int
    _gen: int

    def discard(self) -> bool:
        """Drop it for good; False if it was already dropped."""
        seg = self._channel._live()
        wake = ffi.new("int *")
        rc = lib.shm_dead_discard(seg.ptr, self._slot, self._gen, wake)
        if wake[0] & 1:
            seg.post(_RX, 1)
        if rc < 0:
            raise_for(rc, "discard dead letter")
        return bool(rc == lib.SHM_OK)

    def resend(self, sender: Sender | None = None, timeout: float | None = None) -> int:
        """Send it again as a new message (new seq, attempt 1) and discard this one."""
        tx = sender if sender is not None else self._channel.sender()
        seq = tx.send(self.payload, keys=self.keys, timeout=timeout)
        self.discard()
        return seq


# ---------------------------------------------------------------------------------------
# Channel
# ---------------------------------------------------------------------------------------


class Channel:
    """A named shared-memory channel; create it once, open it from any process."""

    def __init__(self, seg: _Segment) -> None:
        self._seg: _Segment | None = seg
        self._name = seg.name  # kept after close(), for error messages
        self._path = seg.path
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
        """
        _check_name(name)
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
        lease_s = math.inf if lease is None else _seconds("lease", lease)
        if lease_s == 0:
            raise errors.InvalidArgument("lease must be > 0 seconds, inf or None, got 0")
        if lease_s != math.inf and lease_s * 1e9 >= 2**62:
            raise errors.InvalidArgument(f"lease must be < 2**62 ns, inf or None, got {lease!r}")
        cfg.lease_ns = 0 if lease_s == math.inf else max(1, int(lease_s * 1e9))
        # a pickled handle's time to be unpickled (csrc/handles.c, hand-over)
        handover_s = _seconds("handover", handover)
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
        cfg.max_producers = _positive_int("max_producers", max_producers)
        total = ffi.new("uint64_t *")
        rc = lib.shm_layout_size(cfg, total)
        if rc:
            raise_for(rc, "create", "configuration out of range")
        return cls(_create_segment(name, path, cfg, int(total[0]), mode))

    @classmethod
    def open(cls, name: str, *, path: str | os.PathLike[str] | None = None) -> Channel:
        """Attach to an existing channel. Raises ChannelNotFound if there is none."""
        _check_name(name)
        return cls(_open_segment(name, path))

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
    def name(self) -> str:
        """The channel's name (as given to create() or open())."""
        return self._live().name

    @property
    def capacity(self) -> int:
        """Bytes of message storage: at most this much is queued, in flight or dead."""
        return self._live().capacity

    @property
    def path(self) -> str | None:
        """The file of a durable channel (created with path=); None for one in /dev/shm."""
        return self._live().path

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
        )

    def dead_letters(self) -> list[DeadLetter]:
        """Messages that ran out of attempts (max_attempts), oldest slot first."""
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

    def shutdown(self) -> None:
        """Refuse new sends (they raise Closed); the receiver drains what was accepted."""
        seg = self._live()
        lib.shm_shutdown(seg.ptr)
        seg.post(_RX, 1)
        seg.post(_TX, 64)

    def flush(self) -> None:
        """Write the segment back to its file and wait for the disk (msync). Meaningful
        for channels created with path=; see the durability guide."""
        rc = lib.shm_sync(self._live().ptr)
        if rc:
            raise_for(rc, "flush")

    def close(self) -> None:
        """Detach this process's Channel object (idempotent). Other processes carry on."""
        seg, self._seg = self._seg, None
        for rx in list(self._receivers):  # like its senders, its receiver is closed too
            rx._closed_why = "the Channel it came from was closed"
            rx.close()
        if seg is not None and seg.registered:
            lib.shm_producer_detach(seg.ptr)
            seg.registered = False

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
        seg.post(_RX, 1)
        seg.post(_TX, 64)
        if not _unlink(seg.name, seg.path, seg.chan_id):
            raise errors.ChannelNotFound(
                f"channel {seg.name!r} was already removed"
                + (
                    ""
                    if _read_identity(seg.name, seg.path) is None
                    else "; the name now belongs to another channel, which was left alone"
                )
            )

    def removed(self) -> bool:
        """True once this channel was removed: unlinked by any process, or its name
        removed or given to a new channel behind shmchan's back. Its sends are refused
        (ChannelRemoved); its receiver drains. Reads the name: not for a hot loop."""
        return self._live().removed()

    def _live(self) -> _Segment:
        seg = self._seg
        if seg is None:
            raise errors.Closed("channel object is closed")
        return seg

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._seg is None:
            return "<shmchan.Channel (closed)>"
        return f"<shmchan.Channel {self._seg.name!r} capacity={self._seg.capacity}>"


def _positive_int(what: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise errors.UnsupportedType(f"{what} must be an int, not {type(value).__name__}")
    if value < minimum:
        raise errors.InvalidArgument(f"{what} must be >= {minimum}, got {value}")
    return value


_NO_SPACE = (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT, errno.EFBIG)


def space_advice(where: str) -> str:
    """How full the filesystem at `where` is, and what to do about it."""
    try:
        vfs = os.statvfs(where)
        size, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
        state = f"{where} is {_mib(size)} with {_mib(free)} free"
    except OSError:
        state = f"{where} could not be measured"
    fix = (
        "give the container a larger /dev/shm (docker run --shm-size=1g; in Kubernetes an "
        "emptyDir with medium: Memory mounted at /dev/shm)"
        if where == _SHM_DIR
        else f"free space on {where}'s filesystem"
    )
    return f"{state}; {fix}, or create the channel with a smaller capacity="


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _open_sems(name: str, flags: int, mode: int) -> tuple[Any, Any]:
    rx_name, tx_name = _sem_names(name)
    rx = posix_ipc.Semaphore(rx_name, flags, mode=mode, initial_value=0)
    tx = posix_ipc.Semaphore(tx_name, flags, mode=mode, initial_value=0)
    return rx, tx


def _exists_text(name: str) -> str:
    """ChannelExists's message: whether the channel is in use, and what to do either way."""
    from . import inspect as _inspect_mod  # inspect imports this module

    file = os.path.join(_SHM_DIR, _PREFIX + name)
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


def _create_segment(
    name: str, path: str | os.PathLike[str] | None, cfg: Any, total: int, mode: int
) -> _Segment:
    # The name first (O_EXCL): if it is taken, nothing of the existing channel is
    # touched. Openers wait until the magic is stored, so the semaphores are there by then.
    shm = None
    fd = -1
    rx = tx = None
    try:
        if path is None:
            try:
                shm = posix_ipc.SharedMemory(_shm_name(name), posix_ipc.O_CREX, mode=mode, size=0)
            except posix_ipc.ExistentialError:
                raise errors.ChannelExists(_exists_text(name)) from None
            fd = shm.fd
        else:
            try:
                fd = os.open(os.fspath(path), os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
            except FileExistsError:
                raise errors.ChannelExists(
                    f"channel file {os.fspath(path)!r} already exists"
                ) from None
        rx, tx = _open_sems(name, posix_ipc.O_CREAT, mode)
        where = _SHM_DIR if path is None else os.path.dirname(os.fspath(path)) or "."
        try:
            # Sparse: memory is committed as the ring and tables are first used
            # (csrc/commit.c), so a capacity larger than the filesystem is allowed.
            os.ftruncate(fd, total)
        except OSError as e:
            raise errors.ResourceError(
                e.errno,
                f"cannot create channel {name!r}: cannot size its file to {total} bytes in "
                f"{where}: {os.strerror(e.errno or errno.EFBIG)}",
            ) from None
        out = ffi.new("shm_chan **")
        rc = lib.shm_attach(fd, 1, cfg, liveness.current_token(), out)
        if rc == lib.SHM_E_SYS and ffi.errno in _NO_SPACE:
            err = ffi.errno
            raise errors.ResourceError(
                err,
                f"cannot create channel {name!r}: {where} cannot give even its fixed part "
                f"(about 1 MiB): {os.strerror(err)}. {space_advice(where)}",
            )
        if rc:
            raise_for(rc, "create")
        return _Segment(name, None if path is None else os.fspath(path), out[0], rx, tx)
    except BaseException:
        if shm is not None:
            shm.unlink()
        elif path is not None and fd >= 0:
            os.unlink(os.fspath(path))
        for sem in (rx, tx):
            if sem is not None:
                sem.unlink()
        raise
    finally:
        if shm is not None:
            shm.close_fd()
        elif fd >= 0:
            os.close(fd)


def full_message(seg: _Segment, what: str) -> str:
    """The message of a Full: the ring had no room, or its filesystem no memory."""
    err = int(lib.shm_space_short(seg.ptr))
    if not err:
        return f"{what}: channel {seg.name!r} stayed full"
    where = _SHM_DIR if seg.path is None else os.path.dirname(seg.path) or "."
    return (
        f"{what}: channel {seg.name!r} is not full, but {where} is out of space for it "
        f"({os.strerror(err)}): {space_advice(where)}"
    )


def _open_segment(name: str, path: str | os.PathLike[str] | None) -> _Segment:
    deadline = time.monotonic() + 5.0
    while True:
        fd = -1
        shm = None
        try:
            if path is None:
                try:
                    shm = posix_ipc.SharedMemory(_shm_name(name))
                except posix_ipc.ExistentialError:
                    raise errors.ChannelNotFound(
                        f"no channel named {name!r} in {_SHM_DIR} (a channel created with "
                        "path= is opened with the same path=)"
                    ) from None
                except posix_ipc.PermissionsError:
                    raise errors.ResourceError(
                        errno.EACCES,
                        f"no permission to open channel {name!r}: another user made it "
                        "(its mode= decides who may open it)",
                    ) from None
                fd = shm.fd
            else:
                try:
                    fd = os.open(os.fspath(path), os.O_RDWR)
                except FileNotFoundError:
                    raise errors.ChannelNotFound(f"no channel file {os.fspath(path)!r}") from None
                except PermissionError as e:
                    raise errors.ResourceError(
                        e.errno, f"no permission to open channel file {os.fspath(path)!r}"
                    ) from None
            out = ffi.new("shm_chan **")
            rc = lib.shm_attach(fd, 0, ffi.NULL, liveness.current_token(), out)
        finally:
            if shm is not None:
                shm.close_fd()
            elif fd >= 0:
                os.close(fd)
        if rc == lib.SHM_EMPTY and time.monotonic() < deadline:
            time.sleep(0.001)  # its creator is still initializing it
            continue
        if rc == lib.SHM_EMPTY:
            raise errors.LayoutMismatch(
                f"channel {name!r} was never initialized by its creator (it died creating "
                "it?): remove it with shmchan.unlink() or `shmchan rm`"
            )
        if rc:
            raise_for(rc, f"open {name!r}")
        # O_CREAT: a file-backed channel outlives /dev/shm (a reboot empties it), and a
        # semaphore only ever carries wake-ups, so a fresh one loses nothing.
        rx, tx = _open_sems(name, posix_ipc.O_CREAT, 0o600)
        try:
            return _Segment(name, None if path is None else os.fspath(path), out[0], rx, tx)
        except FileNotFoundError:
            # The core opens the semaphores again by name; an unlink between the two
            # removed them: the channel is gone. Look the name up again (the mapping is
            # released with the half-built _Segment).
            if time.monotonic() >= deadline:
                raise errors.ChannelNotFound(
                    f"channel {name!r} was removed while it was being opened"
                ) from None


_shared: dict[tuple[str, str | None], Channel] = {}
_shared_lock = threading.Lock()


def _shared_channel(name: str, path: str | None) -> Channel:
    """One attachment per process for objects that re-open by name (pickled senders, handles)."""
    key = (name, path)
    with _shared_lock:
        ch = _shared.get(key)
        seg = None if ch is None else ch._seg
        # A name means the channel under that name now: a cached attachment whose name
        # was removed or re-created is dropped (its senders are refused: seg.removed()).
        if ch is None or seg is None or seg.pid != os.getpid() or seg.removed():
            ch = Channel.open(name, path=path)
            _shared[key] = ch
        return ch


def unlink(name: str, *, path: str | os.PathLike[str] | None = None) -> None:
    """Remove the channel of that name (its segment, or file for path= channels, and its
    semaphores); processes attached to it are refused further sends (ChannelRemoved)
    and its receiver drains. ChannelNotFound if there is none."""
    _check_name(name)
    if not _unlink(name, None if path is None else os.fspath(path), 0):
        raise errors.ChannelNotFound(f"no channel named {name!r}")


def _unlink(name: str, path: str | None, expect_id: int) -> bool:
    """Remove the name, if it means channel `expect_id` (any channel, or anything at all
    under that name, if 0): mark the segment removed, unlink its file and semaphores,
    wake whoever sleeps on them. False if there was nothing (of that identity) to remove."""
    file = _name_file(name, path)
    try:
        fd = os.open(file, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        if not expect_id:
            _unlink_sems(name, post=False)  # leftovers of a creator that died early
        return False
    try:
        rc = lib.shm_mark_removed_fd(fd, expect_id)
        if expect_id and rc != lib.SHM_OK:
            return False  # the name means another channel (or junk) now: not ours
        # The name must still be the file we checked and marked.
        st = os.fstat(fd)
        try:
            now = os.stat(file)
        except FileNotFoundError:
            return False  # someone else removed it just now
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            if expect_id:
                return False
            return _unlink(name, path, 0)  # replaced meanwhile: remove what is there now
        try:
            os.unlink(file)
        except FileNotFoundError:
            return False
    finally:
        os.close(fd)
    _unlink_sems(name, post=True)
    return True


def _unlink_sems(name: str, post: bool) -> None:
    for sem_name in _sem_names(name):
        try:
            sem = posix_ipc.Semaphore(sem_name)
        except posix_ipc.ExistentialError:
            continue
        try:
            if post:  # sleepers wake and find the channel removed
                for _ in range(64 if sem_name.endswith(".tx") else 1):
                    sem.release()
            sem.unlink()
        except posix_ipc.ExistentialError:
            pass
        finally:
            sem.close()


def list_channels() -> list[str]:
    """Names of the channels in /dev/shm (file-backed channels are not listed)."""
    try:
        entries = os.listdir(_SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(e[len(_PREFIX) :] for e in entries if e.startswith(_PREFIX))


# ---------------------------------------------------------------------------------------
# Sender
# ---------------------------------------------------------------------------------------


class Sender(_hot.SenderBase):
    """Sends messages into a channel. Picklable; works after fork, spawn and forkserver.

    `send` is implemented in C (csrc/hot/sender.c); it calls `_send_slow` for whatever is
    not a bytes payload with plain keys on an open channel with room."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._seg = channel._live()

    @classmethod
    def open(cls, name: str, *, path: str | os.PathLike[str] | None = None) -> Sender:
        return _shared_channel(name, None if path is None else os.fspath(path)).sender()

    def __reduce__(self) -> tuple[Any, ...]:
        seg = self._live()
        return (_open_sender, (seg.name, seg.path))

    def _live(self) -> _Segment:
        if self._seg is None or self._channel._seg is None:
            raise errors.Closed("sender is closed")
        return self._seg

    def _send_slow(self, obj: object, keys: Any, timeout: float | None) -> int:
        """send() for everything its C fast path leaves to Python."""
        seg = self._live()
        _deadline(timeout)  # a bad timeout is refused before anything is sent
        kind, buf = codec.encode_payload(obj, seg.raw_only)
        blob, nkeys = codec.encode_keys(keys, seg.max_keys)
        if not seg.registered:
            seg.register_producer()
        s = seg.scratch()
        data = buf if type(buf) is bytes else ffi.from_buffer("char[]", buf)
        rc = lib.shm_send(
            seg.ptr, kind, data, len(data), blob, len(blob), nkeys, s.seq, s.stall, s.wake
        )
        if rc < 0:
            _refuse(seg, rc, "send", kind, len(data), len(blob), nkeys)
        if rc:
            deadline = _deadline(timeout)
            rc = self._wait_and_retry(
                seg,
                rc,
                deadline,
                lambda: lib.shm_send(
                    seg.ptr, kind, data, len(data), blob, len(blob), nkeys, s.seq, s.stall, s.wake
                ),
                "send",
            )
        if s.wake[0]:
            seg.post(_RX, 1)
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
            _deadline(timeout)
        return memoryview(seqs_buf).cast("Q")

    def _send_many_slow(
        self, items: Iterable[tuple[object, Any]], timeout: float | None
    ) -> list[int]:
        """send_many() when its C fast path cannot start (unregistered, closed, odd timeout)."""
        self._live()  # closed: Closed at once
        _deadline(timeout)  # a bad timeout is refused before anything is sent
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
        deadline = _deadline(timeout)
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
                seg.post(_RX, 1)
            return rc

        try:
            rc = attempt()
            if rc < 0:
                _refuse_batch(seg, rc, packed, what)
            if rc:
                rc = self._wait_and_retry(seg, rc, deadline, attempt, what)
        except (errors.Full, errors.Closed) as e:
            e.seqs = list(ffi.unpack(seqs, done[0]))  # the prefix that went in
            raise
        return list(ffi.unpack(seqs, n))

    def _wait_and_retry(
        self, seg: _Segment, rc: int, deadline: float | None, attempt: Any, what: str
    ) -> int:
        """Retry a send that returned FULL or STALLED until it succeeds or time runs out."""
        s = seg.scratch()
        armed = False
        stalled_since: float | None = None
        stall_began = 0.0
        nap = _STALL_NAP_SECONDS
        try:
            while rc:
                if rc == lib.SHM_FULL:
                    stalled_since = None
                    nap = _STALL_NAP_SECONDS
                    if not armed:
                        lib.shm_space_wait(seg.ptr, 1, s.pass_on)
                        armed = True
                        # An idle receiver may be able to free space by compacting
                        # (csrc/compact.c): wake it to poll. (After a failed try it
                        # waits for records to finish or up to 50 ms before the next.)
                        seg.post(_RX, 1)
                        rc = attempt()  # re-check after announcing ourselves
                        continue
                    if seg.removed(every=_NAME_CHECK_SECONDS):
                        raise_for(lib.SHM_REMOVED, what)
                    left = _remaining(deadline)
                    if left is not None and left <= 0:
                        raise errors.Full(full_message(seg, what))
                    # Callers loop and re-check: a post, a timeout and a signal whose
                    # handler returned are all just a return (a handler that raises
                    # propagates).
                    seg.wait(_TX, min(_MAINTENANCE_SECONDS, left if left is not None else 1e9))
                elif rc == lib.SHM_STALLED:
                    now = time.monotonic()
                    if stalled_since is None:
                        stalled_since = stall_began = now
                    elif now - stalled_since > _STALL_CHECK_SECONDS:
                        _resolve_stall(seg, s.stall, consumer=False)
                        stalled_since = now
                    left = _remaining(deadline)
                    if left is not None and left <= 0:
                        raise errors.Full(f"{what}: stuck behind a producer that does not finish")
                    # A claimant mostly commits within a few microseconds, and a preempted
                    # one within a scheduler slice or two: for the first _STALL_CHECK_SECONDS
                    # we retry every nap, so that many producers on few cores lose no time
                    # behind each other. One that takes longer (stopped by SIGSTOP or a
                    # debugger) is waited for with sleeps doubling up to the maintenance
                    # period, not a spin (each retry spins in the core first). A sleep, not
                    # the senders' semaphore: a post taken here would be a wake-up lost to a
                    # sender waiting for space.
                    time.sleep(nap if left is None else min(nap, left))
                    if now - stall_began >= _STALL_CHECK_SECONDS:
                        nap = min(2 * nap, _MAINTENANCE_SECONDS)
                else:
                    raise_for(rc, what)
                rc = attempt()
        finally:
            if armed:
                lib.shm_space_wait(seg.ptr, 0, s.pass_on)
                if s.pass_on[0]:
                    seg.wake_sender()  # pass the wake-up on to the next waiter (csrc/ring.c)
        return rc

    def close(self) -> None:
        """Stop using this Sender (idempotent); later sends raise Closed."""
        self._seg = None  # type: ignore[assignment]

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refuse(
    seg: _Segment, rc: int, what: str, kind: int, size: int, keys_len: int, nkeys: int
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
    seg: _Segment,
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


# ---------------------------------------------------------------------------------------
# Receiver
# ---------------------------------------------------------------------------------------


class Receiver(_hot.ReceiverBase):
    """The one consumer of a channel: hands out key-locked handles.

    `recv`, `recv_many` and `release_many` are implemented in C (csrc/hot/receiver.c): one
    poll of the core, Handles built in C. Whenever that poll finds nothing, maintenance
    is due or an argument needs checking, they call the `_*_slow` methods below."""

    def __init__(self, channel: Channel, seg: _Segment) -> None:
        self._channel = channel
        self._seg: _Segment | None = seg
        self._ident = (seg.name, seg.path)  # its channel's, also once closed (release_many)
        self._next_maintenance = 0.0
        self._next_sweep = time.monotonic() + _SWEEP_SECONDS
        self._stall: tuple[int, int, float] | None = None  # (pos, owner, since)
        self._pid = os.getpid()  # only this process took the seat
        self._closed_why = "it was closed"
        try:
            self.maintain()  # a dead predecessor's handles come back at once
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
        self._next_maintenance = now + _MAINTENANCE_SECONDS
        self._discard_dead_writers(seg)
        holders = ffi.new("uint64_t[]", 512)
        n = ffi.new("uint32_t *")
        expired = ffi.new("uint32_t *")
        now_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        lib.shm_holders(seg.ptr, holders, 512, n, now_ns, expired)
        me = liveness.current_token()
        dead = [
            int(holders[i])
            for i in range(n[0])
            if int(holders[i]) not in (me, _HOLDER_REVOKED)
            and not liveness.is_alive(int(holders[i]))
        ]
        sweep = now >= self._next_sweep
        if not dead and not expired[0] and not sweep:
            return 0
        if sweep:
            self._next_sweep = now + _SWEEP_SECONDS
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
            seg.post(_TX, 64)  # space may have been freed by dead letters' keys
        return int(revoked[0])

    def _discard_dead_writers(self, seg: _Segment) -> None:
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

    def _live(self) -> _Segment:
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

    def _poll(self, seg: _Segment, n: int, deadline: float | None, block: bool) -> list[Handle]:
        s = seg.scratch()
        msgs = s.msg_array(n)
        spin_until = time.monotonic() + _SPIN_SECONDS if block else 0.0
        arm = 0
        while True:
            if time.monotonic() >= self._next_maintenance:
                self.maintain()
            rc = lib.shm_recv(seg.ptr, msgs, n, s.got, arm, s.stall, s.waiters)
            if s.waiters[0]:
                seg.wake_sender()  # one sender, rationed (csrc/ring.c)
            got = s.got[0]
            if got:
                handles: list[Handle] = _hot.handles_from(seg, _address(msgs), got)
                return handles
            if rc == lib.SHM_CLOSED:
                how = "removed" if lib.shm_removed(seg.ptr) else "shut down"
                raise errors.Closed(f"channel {seg.name!r} is {how} and drained")
            if rc == lib.SHM_AGAIN:
                # Records arrived while the core looked at those that came before the
                # call: a blocking receive looks at them before it may sleep.
                if block:
                    continue
                rc = lib.SHM_EMPTY
            if rc == lib.SHM_STALLED:
                # Remembered across calls, so that try_recv() polling also gets a dead
                # producer's claim repaired.
                now = time.monotonic()
                key = (int(s.stall.pos), int(s.stall.owner))
                if self._stall is None or self._stall[:2] != key:
                    self._stall = (*key, now)
                elif now - self._stall[2] > _STALL_CHECK_SECONDS:
                    _resolve_stall(seg, s.stall, consumer=True)
                    self._stall = (*key, now)
            elif rc != lib.SHM_EMPTY:
                torn = " (a record failed its checksum or validation: torn by a power loss?)"
                raise_for(rc, "recv", torn if rc == lib.SHM_E_CORRUPT and seg.path else "")
            else:
                self._stall = None
            if not block:
                return []
            left = _remaining(deadline)
            if left is not None and left <= 0:
                raise errors.Empty(f"recv: nothing arrived on {seg.name!r} in time")
            if not arm:
                # (a stall is spun through too: its claimant is mostly about to commit)
                if rc in (lib.SHM_EMPTY, lib.SHM_STALLED) and time.monotonic() < spin_until:
                    lib.shm_rx_spin(seg.ptr, _SPIN_PAUSES)
                    continue
                arm = 1
                continue  # poll once more with the sleep flag armed
            wait = _MAINTENANCE_SECONDS if rc == lib.SHM_EMPTY else 0.002
            seg.wait(_RX, wait if left is None else min(wait, left))  # as in _wait_and_retry

    def _recv_slow(self, timeout: float | None) -> Handle:
        return self._poll(self._live(), 1, _deadline(timeout), True)[0]

    def try_recv(self) -> Handle | None:
        """The next message free to go, or None right away."""
        seg = self._live()
        got = self._poll(seg, 1, None, False)
        return got[0] if got else None

    def _recv_many_slow(self, max_items: object, timeout: float | None) -> list[Handle]:
        if type(max_items) is not int or max_items < 1:
            raise errors.InvalidArgument(f"max_items must be a positive int, not {max_items!r:.40}")
        return self._poll(self._live(), min(max_items, 65536), _deadline(timeout), True)

    def _recv_batch_slow(self, max_items: object, timeout: float | None) -> Batch:
        """recv_batch() when its one poll found nothing (or an argument needs checking):
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


# ---------------------------------------------------------------------------------------
# Handle
# ---------------------------------------------------------------------------------------


class Handle(_hot.HandleBase):
    """A message on loan with its keys locked, until released (or nacked).

    The per-message part is implemented in C (csrc/hot/handle.c): the fields, `payload`
    for bytes, `release` / `ack`, `with`, and releasing on garbage collection in the
    process that holds it."""

    __slots__ = ()

    @classmethod
    def _from_msg(cls, seg: _Segment, m: Any) -> Handle:
        handles: list[Handle] = _hot.handles_from(seg, _address(m), 1)
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

    def _check(self) -> _Segment:
        if self._done:
            raise errors.Closed(f"handle seq={self.seq} was already released")
        seg: _Segment = self._seg
        return seg

    def _refresh(self, seg: _Segment) -> None:
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

    def nack(self) -> None:
        """Give the message back: it is delivered again (attempt + 1) before anything
        behind it on its keys."""
        self._finish(1)

    def extend(self, seconds: float) -> None:
        """Push this handle's lease deadline to `seconds` from now (inf: no deadline)."""
        seg = self._check()
        secs = _seconds("extend: seconds", seconds)
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
            seg: _Segment = self._seg
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
    h = Handle._from_msg(_attachment_of(name, path, chan_id), m)
    h._done = True
    return h


def _adopt_handle(name: str, path: str | None, slot: int, gen: int, chan_id: int) -> Handle:
    seg = _attachment_of(name, path, chan_id)
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


# hand_over()'s bytes: this header, the channel's name and path (UTF-8), then (slot, gen)
# per handle as two uint32 in this machine's byte order (csrc/hot/handover.c).
_HANDOVER = struct.Struct("<4sQHH")  # magic, chan_id, name length, path length (or _NO_PATH)
_HANDOVER_MAGIC = b"shHO"
_NO_PATH = 0xFFFF


def _handover_prefix(name: str, path: str | None, chan_id: int) -> bytes:
    name_b = name.encode()
    path_b = b"" if path is None else os.fsencode(path)
    plen = _NO_PATH if path is None else len(path_b)
    return _HANDOVER.pack(_HANDOVER_MAGIC, chan_id, len(name_b), plen) + name_b + path_b


def hand_over(handles: Iterable[Handle]) -> bytes:
    """Hand a batch of handles (of one channel) over to another process with one core
    call: what pickling each handle does, for many at once. Returns bytes to carry there
    (a pipe, a socket, a file) and pass to `adopt`. From now on each handle is in
    transit: this process no longer releases it when it is collected, and a handle not
    adopted within the channel's `handover` seconds is taken back and redelivered
    (attempt + 1). A handle already released travels as a no-op one."""
    hs = list(handles)
    if not hs:
        return _HANDOVER.pack(_HANDOVER_MAGIC, 0, 0, _NO_PATH)
    seg = getattr(hs[0], "_seg", None)
    if not isinstance(seg, _Segment):
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
    """(chan_id, name length, path length or _NO_PATH, where the (slot, gen) pairs
    start) of hand_over() bytes, checked; InvalidArgument naming `what` if malformed."""
    size = _HANDOVER.size
    if len(view) < size or bytes(view[:4]) != _HANDOVER_MAGIC:
        raise errors.InvalidArgument(f"{what}: not the bytes of a hand_over()")
    _, chan_id, nlen, plen = _HANDOVER.unpack_from(view)
    end = size + nlen + (0 if plen == _NO_PATH else plen)
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
    size = _HANDOVER.size
    if len(view) == end:
        return []
    name = bytes(view[size : size + nlen]).decode()
    path = None if plen == _NO_PATH else os.fsdecode(bytes(view[size + nlen : end]))
    seg = _attachment_of(name, path, chan_id)
    hs: list[Handle]
    hs, worst = _hot.adopt_many(seg, view[end:], liveness.current_token())
    if worst:
        for h in hs:  # ours, but the batch failed: give them back rather than drop them
            with contextlib.suppress(errors.Error):
                h.nack()
        raise_for(worst, "adopt")
    return hs


def _attachment_of(name: str, path: str | None, chan_id: int) -> _Segment:
    """This process's attachment to channel `chan_id`, named `name`: the channel under
    the name now, if it is that one, else one this process still has (the channel was
    removed since). ChannelRemoved if the channel is no longer reachable."""
    pid = os.getpid()
    with _shared_lock:  # the usual case, with no system call: the cached attachment is it
        cached = _shared.get((name, path))
    seg = None if cached is None else cached._seg
    if seg is not None and seg.chan_id == chan_id and seg.pid == pid and not seg.detached[0]:
        return seg
    try:
        seg = _shared_channel(name, path)._live()
    except errors.ChannelNotFound:
        seg = None
    if seg is not None and seg.chan_id == chan_id:
        return seg
    for mine in list(_segments):
        if mine.chan_id == chan_id and mine.pid == pid and not mine.detached[0]:
            return mine
    raise errors.ChannelRemoved(
        f"channel {name!r} was removed"
        + ("" if seg is None else " (the name now belongs to another channel)")
        + ": a handle of it cannot be taken over"
    )


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


# The per-message calls reach the core through the functions of the cffi module loaded
# above (whichever build it is), and build Handles of the class defined here.
_hot.bind(
    {
        name: _address(ffi.addressof(lib, name))
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
        )
    },
    Handle,
    codec.encode_payload,
    codec.encode_keys,
    Batch,
    errors.InvalidArgument,
    errors.UnsupportedType,
)
