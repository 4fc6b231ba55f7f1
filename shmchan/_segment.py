"""The attachment layer: one process's mapping of a channel, and everything about it that
is not one public type.

`channel`, `sender`, `receiver`, `handle`, `exchange`, `inspect` and `cli` build on this
module; it builds on the C core (`_lib`, `_shmchan_hot`), `codec`, `errors` and
`liveness` only. Its surface (the names without a leading underscore) is:

* naming: `PREFIX`, `SHM_DIR`, `check_name`, `name_file`, `read_identity`, `list_names`,
  `unlink_name`;
* opening: `create_segment`, `open_segment`, `Segment` (the mapping plus its two
  semaphores, `RX` / `TX` for `Segment.post` / `.wait`; `Scratch`, its per-thread
  out-parameters), `Attachment` (what a Channel
  object is before its API: the segment, until closed), `shared_attachment` (one per
  process for objects that re-open by name), `attachment_of` (for hand-overs), `address`;
* time: `check_seconds`, `deadline_of`, `remaining`, and the periods the Python side
  of the waits uses: `MAINTENANCE_SECONDS`, `STALL_CHECK_SECONDS`, `STALL_NAP_SECONDS`,
  `SWEEP_SECONDS`, `NAME_CHECK_SECONDS` (the receive loop's spin is C's own:
  csrc/hot/hot.h);
* waiting: `SpaceWait` (the senders' one wait: Sender and Exchange alike);
* repair: `reap_dead_producers`, `resolve_stall`, `HOLDER_REVOKED`;
* space: `space_advice`, `full_message`;
* hand-over bytes: `HANDOVER`, `HANDOVER_MAGIC`, `NO_PATH`, `handover_prefix`;
* `attach_hooks`: functions called with every new Segment (temporary.py's).

The periods are read as module attributes (`_segment.MAINTENANCE_SECONDS`) where they
are used, so that one assignment changes them everywhere.
"""

from __future__ import annotations

import errno
import math
import numbers
import os
import re
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import _shmchan_hot as _hot  # the per-message calls (csrc/hot/)
import posix_ipc

from . import errors, liveness
from ._lib import ffi, lib, raise_for

__all__ = [
    "PREFIX",
    "SHM_DIR",
    "check_name",
    "name_file",
    "read_identity",
    "list_names",
    "unlink_name",
    "create_segment",
    "open_segment",
    "Segment",
    "Scratch",
    "RX",
    "TX",
    "Attachment",
    "shared_attachment",
    "attachment_of",
    "address",
    "check_seconds",
    "deadline_of",
    "remaining",
    "MAINTENANCE_SECONDS",
    "STALL_CHECK_SECONDS",
    "STALL_NAP_SECONDS",
    "SWEEP_SECONDS",
    "NAME_CHECK_SECONDS",
    "SpaceWait",
    "reap_dead_producers",
    "resolve_stall",
    "HOLDER_REVOKED",
    "space_advice",
    "full_message",
    "HANDOVER",
    "HANDOVER_MAGIC",
    "NO_PATH",
    "handover_prefix",
    "attach_hooks",
]

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")
PREFIX = "shmchan."
SHM_DIR = "/dev/shm"
MAINTENANCE_SECONDS = 0.1  # longest single sleep: liveness checks run at least this often
STALL_CHECK_SECONDS = 0.01  # how long a stuck claim may stall us before we check its owner
STALL_NAP_SECONDS = 0.0002  # a sender's first sleep behind a stuck claim; doubles each time
PASS_NAP_SECONDS = 0.001  # a sender's nap after passing on a post it could not use
SWEEP_SECONDS = 1.0  # how often the receiver looks for releases whose releaser died mid-way
_REAPING = 1 << 63  # a producer registry entry's owner word while it is reaped (csrc/segment.c)
NAME_CHECK_SECONDS = 0.05  # how often a waiting sender checks that its name still holds
HOLDER_REVOKED = 1  # csrc/core.h HOLDER_REVOKED
RX, TX = 0, 1  # Segment.post / .wait: the receiver's semaphore, the senders'


def check_name(name: str) -> str:
    if not isinstance(name, str):
        raise errors.UnsupportedType(f"channel name must be a str, not {type(name).__name__}")
    if not _NAME_RE.fullmatch(name):
        raise errors.InvalidArgument(
            f"invalid channel name {name!r}: use 1-200 characters from A-Z a-z 0-9 _ . - "
            "not starting with '.' or '-'"
        )
    return name


def _shm_name(name: str) -> str:
    return "/" + PREFIX + name


def _sem_names(name: str) -> tuple[str, str]:
    return "/" + PREFIX + name + ".rx", "/" + PREFIX + name + ".tx"


def name_file(name: str, path: str | None) -> str:
    """The file a channel's name refers to: its /dev/shm entry, or its path= file."""
    return os.path.join(SHM_DIR, PREFIX + name) if path is None else path


def read_identity(name: str, path: str | None) -> int | None:
    """The chan_id of the channel the name refers to now; None if there is none (or it
    is not a finished channel of this layout). Three system calls: off the hot path."""
    try:
        fd = os.open(name_file(name, path), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        out = ffi.new("uint64_t *")
        return int(out[0]) if lib.shm_read_identity(fd, out) == lib.SHM_OK else None
    finally:
        os.close(fd)


def check_seconds(what: str, value: object) -> float:
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


def deadline_of(timeout: object, what: str = "timeout") -> float | None:
    """time.monotonic() at which a wait of `timeout` seconds ends; None: never (None or
    inf). Refuses bad timeouts (see check_seconds) before anything is done."""
    if timeout is None:
        return None
    seconds = check_seconds(what, timeout)
    return None if seconds == math.inf else time.monotonic() + seconds


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def address(p: Any) -> int:
    return int(ffi.cast("uintptr_t", p))


class Segment(_hot.SegmentBase):
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
        self.temporary = bool(cfg.flags & lib.SHM_CFG_TEMPORARY)
        self.lease_ns = int(cfg.lease_ns)
        ident = ffi.new("uint64_t[2]")
        lib.shm_identity(ptr, ident, ident + 1)
        self.chan_id = int(ident[0])  # which channel this is (see csrc/segment.c)
        self.created_ns = int(ident[1])
        self._next_name_check = 0.0
        self.handover_ns = int(cfg.handover_ns)
        self.handover_prefix = handover_prefix(name, path, self.chan_id)  # see hand_over()
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
            address(ptr),
            address(base),
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
        for hook in attach_hooks:  # e.g. temporary channels' bookkeeping (temporary.py)
            hook(self)

    def scratch(self) -> Any:
        s = getattr(self._local, "s", None)
        if s is None:
            s = Scratch()
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
            current = read_identity(self.name, self.path)
        except OSError:
            return False  # cannot tell (e.g. permissions): assume it is still ours
        if current == self.chan_id:
            return False
        lib.shm_mark_removed(self.ptr)
        self.post(RX, 1)  # the receiver learns it may end once drained
        self.post(TX, 64)  # waiting senders are refused
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


class Scratch:
    """Per-thread out-parameters, allocated once (ffi.new is not free)."""

    __slots__ = ("seq", "stall", "wake", "pass_on", "got", "msgs", "writing")

    def __init__(self) -> None:
        self.seq = ffi.new("uint64_t *")
        self.stall = ffi.new("shm_stall *")
        self.wake = ffi.new("int *")
        self.pass_on = ffi.new("int *")  # shm_space_wait's: wake the next waiting sender
        self.got = ffi.new("uint32_t *")
        self.msgs = ffi.new("shm_msg[]", 1)  # Handle._data_slow's view
        self.writing: tuple[Any, Any] | None = None  # Receiver._discard_dead_writers


_segments: weakref.WeakSet[Segment] = weakref.WeakSet()
# Called with every Segment this process makes (create or open), once it is built: the
# way a layer above learns of attachments without this module importing it.
attach_hooks: list[Callable[[Segment], None]] = []


def _reset_after_fork() -> None:
    # Only the forking thread lives on in the child: a lock another thread of the parent
    # held at the fork would stay held for ever. Every threading lock of this module the
    # child may take is made anew here (each segment's in after_fork).
    global _shared_lock
    _shared_lock = threading.Lock()
    for seg in list(_segments):
        seg.after_fork()


os.register_at_fork(after_in_child=_reset_after_fork)


def reap_dead_producers(seg: Segment) -> int:
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


def resolve_stall(
    seg: Segment,
    stall: Any,
    consumer: bool,
    settle_gate: Callable[[Segment, int, int], object] | None = None,
) -> None:
    """A claim has been stuck for a while: repair it if its producer is dead. The
    consumer also discards a dead producer's unfinished record; a dead publisher's gated
    record (an exchange's copy) is settled by `settle_gate(seg, pos, owner)`, which
    reads the publish's outcome from its exchange."""
    owner = int(stall.owner)
    if liveness.is_alive(owner):
        return
    rc = lib.shm_repair_claim(seg.ptr, stall.pos, owner)
    if rc != lib.SHM_OK and consumer:
        rc = lib.shm_discard_dead(seg.ptr, stall.pos, owner)
        if rc != lib.SHM_OK and settle_gate is not None:
            settle_gate(seg, int(stall.pos), owner)


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
        if where == SHM_DIR
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


def create_segment(
    name: str, path: str | os.PathLike[str] | None, cfg: Any, total: int, mode: int
) -> Segment:
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
                raise errors.ChannelExists(f"channel {name!r} already exists") from None
            fd = shm.fd
        else:
            try:
                fd = os.open(os.fspath(path), os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
            except FileExistsError:
                raise errors.ChannelExists(
                    f"channel file {os.fspath(path)!r} already exists"
                ) from None
        rx, tx = _open_sems(name, posix_ipc.O_CREAT, mode)
        where = SHM_DIR if path is None else os.path.dirname(os.fspath(path)) or "."
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
        return Segment(name, None if path is None else os.fspath(path), out[0], rx, tx)
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


def full_message(seg: Segment, what: str) -> str:
    """The message of a Full: the ring had no room, or its filesystem no memory."""
    err = int(lib.shm_space_short(seg.ptr))
    if not err:
        return f"{what}: channel {seg.name!r} stayed full"
    where = SHM_DIR if seg.path is None else os.path.dirname(seg.path) or "."
    return (
        f"{what}: channel {seg.name!r} is not full, but {where} is out of space for it "
        f"({os.strerror(err)}): {space_advice(where)}"
    )


def open_segment(name: str, path: str | os.PathLike[str] | None) -> Segment:
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
                        f"no channel named {name!r} in {SHM_DIR} (a channel created with "
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
            return Segment(name, None if path is None else os.fspath(path), out[0], rx, tx)
        except FileNotFoundError:
            # The core opens the semaphores again by name; an unlink between the two
            # removed them: the channel is gone. Look the name up again (the mapping is
            # released with the half-built Segment).
            if time.monotonic() >= deadline:
                raise errors.ChannelNotFound(
                    f"channel {name!r} was removed while it was being opened"
                ) from None


class Attachment:
    """This process's use of one channel through one object (a Channel is one): the
    segment until close(). Endpoints made from it (senders, receivers) are closed with
    it; closing it unregisters this process as a producer."""

    def __init__(self, seg: Segment) -> None:
        self._seg: Segment | None = seg
        self._name = seg.name  # kept after close(), for error messages
        self._path = seg.path

    @property
    def name(self) -> str:
        """The channel's name (as given to create() or open())."""
        return self._live().name

    @property
    def path(self) -> str | None:
        """The file of a durable channel (created with path=); None for one in /dev/shm."""
        return self._live().path

    def _live(self) -> Segment:
        seg = self._seg
        if seg is None:
            raise errors.Closed("channel object is closed")
        return seg

    def close(self) -> None:
        """Detach this object (idempotent). Other processes carry on."""
        seg, self._seg = self._seg, None
        if seg is not None and seg.registered:
            lib.shm_producer_detach(seg.ptr)
            seg.registered = False


_shared: dict[tuple[str, str | None], Attachment] = {}
_shared_lock = threading.Lock()


def shared_attachment(name: str, path: str | None) -> Attachment:
    """One attachment per process for objects that re-open by name (pickled senders, handles)."""
    key = (name, path)
    with _shared_lock:
        ch = _shared.get(key)
        seg = None if ch is None else ch._seg
        # A name means the channel under that name now: a cached attachment whose name
        # was removed or re-created is dropped (its senders are refused: seg.removed()).
        if ch is None or seg is None or seg.pid != os.getpid() or seg.removed():
            ch = Attachment(open_segment(check_name(name), path))
            _shared[key] = ch
        return ch


def unlink_name(name: str, path: str | None, expect_id: int) -> bool:
    """Remove the name, if it means channel `expect_id` (any channel, or anything at all
    under that name, if 0): mark the segment removed, unlink its file and semaphores,
    wake whoever sleeps on them. False if there was nothing (of that identity) to remove."""
    file = name_file(name, path)
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
            return unlink_name(name, path, 0)  # replaced meanwhile: remove what is there now
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


def list_names(prefix: str = PREFIX) -> list[str]:
    """Names of the objects in /dev/shm whose files start with `prefix` (the channels by
    default; file-backed channels are not listed)."""
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(e[len(prefix) :] for e in entries if e.startswith(prefix))


# hand_over()'s bytes: this header, the channel's name and path (UTF-8), then (slot, gen)
# per handle as two uint32 in this machine's byte order (csrc/hot/handover.c).
HANDOVER = struct.Struct("<4sQHH")  # magic, chan_id, name length, path length (or NO_PATH)
HANDOVER_MAGIC = b"shHO"
NO_PATH = 0xFFFF


def handover_prefix(name: str, path: str | None, chan_id: int) -> bytes:
    name_b = name.encode()
    path_b = b"" if path is None else os.fsencode(path)
    plen = NO_PATH if path is None else len(path_b)
    return HANDOVER.pack(HANDOVER_MAGIC, chan_id, len(name_b), plen) + name_b + path_b


def attachment_of(name: str, path: str | None, chan_id: int) -> Segment:
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
        seg = shared_attachment(name, path)._live()
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


class SpaceWait:
    """The one wait of a sender for room in a channel (Sender and Exchange alike).

    A sender whose core call returned FULL or STALLED calls `full(seg)` or
    `stalled(seg, stall)`, then tries again; each returns when it is worth trying again
    and raises Full once `deadline` has passed. Used as a context manager: on exit it
    stops counting this sender among the channel's waiters for space (csrc/ring.c).

    * FULL: the first time for a channel, announce ourselves (shm_space_wait: a
      receiver that frees space posts the senders' semaphore) and wake the receiver (an
      idle one may free space by compacting, csrc/compact.c), then try again at once;
      after that, sleep on the senders' semaphore, at most MAINTENANCE_SECONDS at a
      time. A post, a timeout and a signal whose handler returned are all just a
      return; the caller tries again. A channel removed meanwhile: ChannelRemoved.
      Refused again after consuming a post, pass the post on when the core says so
      (shm_space_refused: another waiter may fit) and nap PASS_NAP_SECONDS instead of
      sleeping on the semaphore, where we could take our own post back.
    * STALLED (a claim ahead of ours is not finished): a claimant mostly commits within
      microseconds, a preempted one within a scheduler slice or two. For the first
      STALL_CHECK_SECONDS try again every STALL_NAP_SECONDS, so that many producers on
      few cores lose no time behind each other; one that takes longer (stopped by
      SIGSTOP, a debugger) is waited for with sleeps doubling up to the maintenance
      period, and its owner is checked every STALL_CHECK_SECONDS (a dead one's claim
      is repaired). A sleep, not the senders' semaphore: a post taken here would be a
      wake-up lost to a sender waiting for space.
    """

    def __init__(self, what: str, deadline: float | None, nowhere: str = "") -> None:
        self.what = what  # the call, in error messages
        self.deadline = deadline
        self.nowhere = nowhere  # appended to Full's message (what became of the message)
        self.armed: Segment | None = None
        self.nudged: Segment | None = None  # the receiver was woken to look for space
        self.stalled_since: float | None = None
        self.stall_began = 0.0
        self.nap = STALL_NAP_SECONDS
        self.woken = False  # the last sleep on the senders' semaphore consumed a post
        self.passed_at: Any = None  # shm_space_refused's head of our last pass on

    def full(self, seg: Segment) -> None:
        self.stalled_since = None  # a stall after this one starts its own count
        if self.armed is not seg and self.nudged is not seg:
            self.disarm()
            self.nudged = seg
            self.woken, self.passed_at = False, None  # both were of another channel
            # A send that may wait counts itself among the waiters; one with no time
            # left does not (its count would only wake others for nothing).
            left = remaining(self.deadline)
            if left is None or left > 0:
                lib.shm_space_wait(seg.ptr, 1, seg.scratch().pass_on)
                self.armed = seg
            seg.post(RX, 1)
            return  # try again after announcing ourselves
        if seg.removed(every=NAME_CHECK_SECONDS):
            raise_for(lib.SHM_REMOVED, self.what)
        left = remaining(self.deadline)
        if left is not None and left <= 0:
            raise errors.Full(full_message(seg, self.what) + self.nowhere)
        if self.woken:  # woken and refused again: the post may be another waiter's room
            self.woken = False
            if self.passed_at is None:
                self.passed_at = ffi.new("uint64_t *", 2**64 - 1)
            if lib.shm_space_refused(seg.ptr, self.passed_at):
                seg.wake_sender()
                time.sleep(PASS_NAP_SECONDS if left is None else min(PASS_NAP_SECONDS, left))
                return
        self.woken = seg.wait(
            TX, MAINTENANCE_SECONDS if left is None else min(MAINTENANCE_SECONDS, left)
        )

    def stalled(self, seg: Segment, stall: Any) -> None:
        now = time.monotonic()
        if self.stalled_since is None:
            self.stalled_since = self.stall_began = now
            self.nap = STALL_NAP_SECONDS
        elif now - self.stalled_since > STALL_CHECK_SECONDS:
            resolve_stall(seg, stall, consumer=False)
            self.stalled_since = now
        left = remaining(self.deadline)
        if left is not None and left <= 0:
            raise errors.Full(f"{self.what}: stuck behind a producer that does not finish")
        time.sleep(self.nap if left is None else min(self.nap, left))
        if now - self.stall_began >= STALL_CHECK_SECONDS:
            self.nap = min(2 * self.nap, MAINTENANCE_SECONDS)

    def disarm(self) -> None:
        """Stop counting ourselves among the waiters for space of the channel armed."""
        seg, self.armed = self.armed, None
        if seg is not None:
            pass_on = seg.scratch().pass_on
            lib.shm_space_wait(seg.ptr, 0, pass_on)
            if pass_on[0]:
                seg.wake_sender()  # pass the wake-up on to the next waiter (csrc/ring.c)

    def __enter__(self) -> SpaceWait:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disarm()
