"""Overflow to disk: a channel created with overflow=DIR spills to a file when its ring is
full, instead of making senders wait; its receiver takes the messages back as room frees.

Protocol (the shared words are csrc/overflow.c's; the file is this module's):

* One file per channel, DIR/shmchan.NAME.ID.overflow (ID: the channel's random id, so a
  channel re-created under the same name never reads an older one's file). Records are
  appended at the offset `tail` the segment's header holds, never past a torn write:

      offset  size  field
      0       4     magic  RECORD_MAGIC
      4       4     crc    CRC-32C of bytes [8, 32 + keys_len + data_len)
      8       8     total  the record's length, header and padding included (8-aligned)
      16      8     data_len
      24      4     keys_len
      28      2     nkeys
      30      2     kind   SHM_PAYLOAD_*
      32            the encoded key blob (codec.encode_keys), the payload, zeros to total

* Appenders (any sender that found the ring full, or the channel already overflowing)
  take the file's flock (the kernel drops it when its holder dies: a killed appender
  leaves no lock held), then: refuse if tail - head + the new bytes would pass the
  limit (Full, after waiting like a full ring); shm_ovf_begin (from now on every send
  goes to the file, and a shut or removed channel refuses); cut the file back to `tail`
  if it is longer (an appender killed mid-write left a torn record there, never
  published); write the records with pwrite at `tail`; shm_ovf_published (tail moves
  past them: they are accepted). A send that returned has its record below `tail`; one
  killed before that left bytes past `tail`, which no reader reads and the next
  appender cuts off. So a torn record is never delivered and never blocks later ones.

* The drainer, a thread of the process holding the receiver (one receiver per channel,
  so one drainer), reads whole records in [head, tail), checks each one's checksum, and
  sends it into the ring through its own attachment, marked the drainer's (its sends
  pass the `overflowing` check); after each send it stores head past the record. When
  head reaches tail it takes the flock and calls shm_ovf_finish: offsets back to 0, the
  flag cleared, the file truncated to 0 bytes. Until then, every PUNCH_EVERY bytes taken
  back, it punches a hole over them (their disk blocks are freed, offsets unchanged), so a
  file that keeps receiving as fast as it drains does not keep every block it ever had.
  A record that fails its checksum (the disk, or a hand that is not shmchan's) is
  skipped and counted; the next whole record is found by its magic and checksum, so a
  bad record holds up nothing behind it.

* Order: while the flag is set, every send but the drainer's goes to the file, behind
  what is there; the drainer moves records into the ring in file order. Messages get
  their seq when they enter the ring, so the ring order is still the order in which
  sends were accepted, and per-key FIFO and each producer's order hold across the file.
  A send that went to the file returns seq 0 (its seq is given when it is taken back).

* Crashes: the drainer killed between a send into the ring and the store of head sends
  that one message again when the next receiver starts (at-least-once, like a
  redelivery). A process killed while appending: see above. The file and the header's
  offsets outlive any process; the channel's removal (unlink, `shmchan rm`) removes the
  file (a receiver still attached drains what it holds through its open descriptor).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from . import errors
from ._lib import ffi, lib, raise_for
from ._segment import RX, Segment, SpaceWait, deadline_of, open_segment, remaining

__all__ = ["Usage", "setup", "usage", "spill_of", "Drainer", "start_drainer", "remove_file"]

RECORD_MAGIC = 0x3166764F  # b"Ovf1" read as little-endian
HEADER = struct.Struct("<IIQQIHH")
IDLE_POLL_SECONDS = 0.01  # the drainer's look at an idle overflow (no file work)
READ_CHUNK = 4 << 20  # bytes the drainer reads from the file at once
PUNCH_EVERY = 16 << 20  # bytes taken back between two holes punched in the file
FULL_NAP_MAX = 0.1  # longest sleep of a sender waiting for room in a full overflow
LOCK_GRACE_SECONDS = 1.0  # how long a send waits for another appender's write, past its timeout
ERROR_RETRY_SECONDS = 1.0  # the drainer's pause after a failed step (a full disk, say)
_NO_LIMIT = (1 << 63) - 1


@dataclass(frozen=True)
class Usage:
    """What a channel's overflow holds now."""

    bytes: int
    """Bytes of records on disk not yet taken back into the ring."""
    messages: int
    """Messages on disk not yet taken back into the ring."""
    limit: int | None
    """The most bytes it may hold (None: as much as its file system takes)."""
    directory: str
    """Where its file is."""


def _state(seg: Segment, want_dir: bool = False) -> tuple[Any, str]:
    st = ffi.new("shm_ovf_state *")
    buf = ffi.new("char[]", lib.SHM_OVF_DIR_MAX) if want_dir else ffi.NULL
    rc = lib.shm_ovf_read(seg.ptr, st, buf, lib.SHM_OVF_DIR_MAX if want_dir else 0)
    if rc:
        raise_for(rc, "overflow")
    d = os.fsdecode(ffi.unpack(buf, st.dir_len)) if want_dir and st.dir_len else ""
    return st, d


def check_dir(overflow: str | os.PathLike[str], limit: int | None) -> tuple[str, int]:
    """Validate Channel.create's overflow= and overflow_limit=: (absolute dir, limit)."""
    try:
        d = os.path.abspath(os.fspath(overflow))
    except TypeError:
        raise errors.UnsupportedType(
            f"overflow must be a directory path or None, not {type(overflow).__name__}"
        ) from None
    if not os.path.isdir(d):
        raise errors.InvalidArgument(
            f"overflow={d!r} is not a directory: create it first (the overflow file goes in it)"
        )
    if not os.access(d, os.W_OK | os.X_OK):
        raise errors.InvalidArgument(f"overflow={d!r}: this user may not write in it")
    if len(os.fsencode(d)) > lib.SHM_OVF_DIR_MAX - 64:
        raise errors.InvalidArgument(
            f"overflow directory path is too long (at most {lib.SHM_OVF_DIR_MAX - 64} bytes)"
        )
    if limit is None:
        return d, _NO_LIMIT
    if not isinstance(limit, int) or isinstance(limit, bool):
        raise errors.UnsupportedType(
            f"overflow_limit must be an int (bytes) or None, not {type(limit).__name__}"
        )
    if limit < 4096:
        raise errors.InvalidArgument(f"overflow_limit must be >= 4096 bytes, got {limit}")
    return d, min(limit, _NO_LIMIT)


def setup(seg: Segment, directory: str, limit: int) -> None:
    """Record the overflow's directory and limit in a channel just created."""
    raw = os.fsencode(directory)
    rc = lib.shm_ovf_setup(seg.ptr, raw, len(raw), limit)
    if rc:
        raise_for(rc, "create", "overflow configuration refused")


def file_name(directory: str, name: str, chan_id: int) -> str:
    return os.path.join(directory, f"shmchan.{name}.{chan_id:016x}.overflow")


def usage(seg: Segment) -> Usage | None:
    """The channel's overflow now, or None if it has none."""
    st, d = _state(seg, want_dir=True)
    if not st.dir_len:
        return None
    limit = int(st.limit)
    return Usage(
        bytes=max(0, int(st.tail) - int(st.head)),
        messages=max(0, int(st.appended) - int(st.drained) - int(st.skipped)),
        limit=None if limit >= _NO_LIMIT else limit,
        directory=d,
    )


def remove_file(seg: Segment) -> None:
    """Remove a removed channel's overflow file (if it has one)."""
    st, d = _state(seg, want_dir=True)
    if st.dir_len:
        try:
            os.unlink(file_name(d, seg.name, seg.chan_id))
        except FileNotFoundError:
            pass


_PAD = bytes(8)


def encode(kind: int, data: Any, blob: bytes, nkeys: int) -> list[Any]:
    """One record (see the top of this module) as the buffers to write, in order: its
    header, key blob, payload and padding (the payload is not copied)."""
    if type(data) is not bytes:
        data = memoryview(data).cast("B")
    body = len(blob) + len(data)
    total = (HEADER.size + body + 7) & ~7
    head = bytearray(HEADER.pack(RECORD_MAGIC, 0, total, len(data), len(blob), nkeys, kind))
    crc = ffi.new("uint32_t *")
    lib.shm_ovf_crc(
        ffi.from_buffer(head)[8 : HEADER.size],
        HEADER.size - 8,
        blob,
        len(blob),
        ffi.from_buffer(data),
        len(data),
        crc,
    )
    struct.pack_into("<I", head, 4, crc[0])
    return [head, blob, data, _PAD[: total - HEADER.size - body]]


def decode_at(buf: Any, off: int, end: int) -> tuple[int, int, Any, Any, int] | None:
    """The whole, valid record at buf[off:] (kind, nkeys, blob, data as memoryviews of
    buf, and its total length), or None."""
    if end - off < HEADER.size:
        return None
    magic, crc, total, dlen, klen, nkeys, kind = HEADER.unpack_from(buf, off)
    if magic != RECORD_MAGIC or total % 8 or total < HEADER.size or total > end - off:
        return None
    if HEADER.size + klen + dlen > total:
        return None
    mv = memoryview(buf)
    k0 = off + HEADER.size
    blob, data = mv[k0 : k0 + klen], mv[k0 + klen : k0 + klen + dlen]
    out = ffi.new("uint32_t *")
    lib.shm_ovf_crc(
        ffi.from_buffer(mv[off + 8 : k0]),
        HEADER.size - 8,
        ffi.from_buffer(blob),
        klen,
        ffi.from_buffer(data),
        dlen,
        out,
    )
    if int(out[0]) != crc:
        return None
    return kind, nkeys, blob, data, total


def _write_at(fd: int, bufs: list[Any], offset: int) -> None:
    """Write the buffers one after the other from offset, whole (pwritev, in groups)."""
    i = 0
    while i < len(bufs):
        group = bufs[i : i + 512]
        size = sum(len(b) for b in group)
        done = os.pwritev(fd, group, offset)
        if done < size:  # a short write: the rest of this group, plainly
            rest = b"".join(bytes(b) for b in group)
            while done < size:
                done += os.pwrite(fd, rest[done:], offset + done)
        offset += size
        i += 512


class Spill:
    """A process's appender to one channel's overflow file."""

    def __init__(self, seg: Segment, directory: str, limit: int) -> None:
        # Weak: the table of appenders is keyed weakly by the segment; a strong reference
        # from its value would keep every segment mapped for the life of the process.
        self._seg = weakref.ref(seg)
        self.path = file_name(directory, seg.name, seg.chan_id)
        self.directory = directory
        self.limit = limit
        self.pid = -1
        self.fd = -1
        self.lock = threading.Lock()

    @property
    def seg(self) -> Segment:
        seg = self._seg()
        if seg is None:  # only reachable through the segment, so never seen gone
            raise errors.Closed("the channel's attachment is gone")
        return seg

    def _open(self) -> int:
        """The file, opened by this process: a descriptor inherited over fork shares the
        parent's flock, so a child opens its own. The name is never re-used (it holds
        the channel's random id), so one open lasts as long as the process."""
        if self.fd < 0:
            try:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as e:
                raise errors.ResourceError(
                    e.errno, f"cannot open the overflow file {self.path!r}: {e.strerror}"
                ) from None
        return self.fd

    def append(self, records: list[Any], nmsgs: int, deadline: float | None, what: str) -> None:
        """Append whole records atomically; wait (until deadline) while over the limit."""
        nap = 0.001
        if self.pid != os.getpid():  # before taking a lock a fork may have copied held
            if self.fd >= 0:
                os.close(self.fd)  # the parent's: closing our copy leaves its flock alone
            self.pid, self.fd, self.lock = os.getpid(), -1, threading.Lock()
        while True:
            with self.lock:
                fd = self._open()
                self._lock_file(fd, deadline, what)
                try:
                    if self._try_append(fd, records, nmsgs, what):
                        return
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            left = remaining(deadline)
            if left is not None and left <= 0:
                st, _ = _state(self.seg)
                raise errors.Full(
                    f"{what}: channel {self.seg.name!r} is full and so is its overflow "
                    f"({int(st.tail) - int(st.head)} bytes on disk in {self.directory}, "
                    f"overflow_limit={self.limit}): the receiver is not keeping up; "
                    "wait for it, or create the channel with a larger overflow_limit="
                )
            time.sleep(nap if left is None else min(nap, left))
            nap = min(2 * nap, FULL_NAP_MAX)

    def _lock_file(self, fd: int, deadline: float | None, what: str) -> None:
        """Take the file's flock. Another appender holds it for one write: wait for it,
        also past a short timeout (up to LOCK_GRACE_SECONDS: a send with timeout=0 is not
        refused because another process is writing), napping rather than blocking, so
        that a holder stopped (SIGSTOP, a debugger) costs us Full, not a hang. A dead
        holder's lock is dropped by the kernel."""
        nap = 0.0001
        started = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            left = remaining(deadline)
            waited = time.monotonic() - started
            if (left is not None and left <= 0) and waited >= LOCK_GRACE_SECONDS:
                raise errors.Full(
                    f"{what}: stuck behind a process that does not finish writing to the "
                    f"overflow file of channel {self.seg.name!r}"
                )
            time.sleep(nap)
            nap = min(2 * nap, 0.01)

    def _try_append(self, fd: int, records: list[Any], nmsgs: int, what: str) -> bool:
        st, _ = _state(self.seg)
        tail = int(st.tail)
        size = sum(len(b) for b in records)
        if size > self.limit:
            raise errors.MessageTooLarge(
                f"{what}: {size} bytes of records can never fit in the overflow of "
                f"channel {self.seg.name!r} (overflow_limit={self.limit})"
            )
        if tail - int(st.head) + size > self.limit:
            return False
        rc = lib.shm_ovf_begin(self.seg.ptr)
        if rc:
            raise_for(rc, what)
        now = os.fstat(fd).st_size
        if now < tail:
            raise errors.ChannelCorrupted(
                f"the overflow file {self.path!r} is shorter ({now} bytes) than its "
                f"channel recorded ({tail}): it was cut or replaced outside shmchan"
            )
        try:
            if now > tail:
                os.ftruncate(fd, tail)  # a torn record of an appender that died mid-write
            _write_at(fd, records, tail)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise errors.Full(
                    f"{what}: channel {self.seg.name!r} is full and its overflow directory "
                    f"{self.directory} is out of space ({os.strerror(e.errno)}): free space "
                    "there, or wait for the receiver"
                ) from None
            raise errors.ResourceError(
                e.errno, f"{what}: cannot write the overflow file {self.path!r}"
            ) from None
        rc = lib.shm_ovf_published(self.seg.ptr, tail + size, nmsgs)
        if rc:
            raise_for(rc, what)
        return True


_spills: weakref.WeakKeyDictionary[Segment, Spill | None] = weakref.WeakKeyDictionary()
_spills_lock = threading.Lock()


def spill_of(seg: Segment) -> Spill | None:
    """The channel's appender in this process, or None if it has no overflow."""
    try:
        return _spills[seg]
    except KeyError:
        pass
    st, d = _state(seg, want_dir=True)
    sp = Spill(seg, d, int(st.limit)) if st.dir_len else None
    with _spills_lock:
        return _spills.setdefault(seg, sp)


def spill_one(
    seg: Segment, kind: int, data: Any, blob: bytes, nkeys: int, deadline: float | None, what: str
) -> None:
    """Append one message to the channel's overflow file (which it must have)."""
    sp = spill_of(seg)
    assert sp is not None, "the caller checked that the channel has an overflow"
    sp.append(encode(kind, data, blob, nkeys), 1, deadline, what)


def spill_packed(
    seg: Segment,
    packed: tuple[int, bytes, bytes, bytes, bytes, bytes, bytes],
    done: int,
    deadline: float | None,
    what: str,
) -> None:
    """Append messages done.. of a packed batch (Sender._pack's layout) as one write."""
    sp = spill_of(seg)
    assert sp is not None, "the caller checked that the channel has an overflow"
    n, kinds, data, lens, keyblob, klens, nkeys = packed
    k_kinds = memoryview(kinds).cast("I")
    k_lens = memoryview(lens).cast("Q")
    k_klens = memoryview(klens).cast("I")
    k_nkeys = memoryview(nkeys).cast("I")
    doff = sum(k_lens[:done])
    koff = sum(k_klens[:done])
    mv, kv = memoryview(data), memoryview(keyblob)
    out: list[Any] = []
    for i in range(done, n):
        dl, kl = k_lens[i], k_klens[i]
        out += encode(k_kinds[i], mv[doff : doff + dl], bytes(kv[koff : koff + kl]), k_nkeys[i])
        doff += dl
        koff += kl
    sp.append(out, n - done, deadline, what)


class Drainer:
    """The receiver's process's thread that takes overflowed messages back into the ring
    (see the top of this module). Holds no reference to the Receiver."""

    def __init__(self, name: str, path: str | None, directory: str, chan_id: int) -> None:
        self.seg = open_segment(name, path)  # its own attachment: marked the drainer's
        if self.seg.chan_id != chan_id:
            raise errors.ChannelRemoved(f"channel {name!r} was removed")
        rc = lib.shm_ovf_drainer(self.seg.ptr)
        if rc:
            raise_for(rc, "overflow drain")
        self.path = file_name(directory, name, chan_id)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise errors.ResourceError(
                e.errno,
                f"channel {name!r}: cannot open its overflow file {self.path!r} "
                f"({e.strerror}); its directory must exist and be writable by this user",
            ) from None
        self.punched = 0  # the file's blocks before this offset were given back
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="shmchan-overflow", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if threading.current_thread() is not self.thread:
            self.thread.join(5.0)

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                try:
                    busy = self._step()
                except _Stopped:
                    break
                except Exception as e:  # said once, then tried again: nothing is dropped
                    if repr(e) != repr(self.error):
                        print(f"shmchan: overflow drain of {self.seg.name!r}: {e}", file=sys.stderr)
                    self.error = e
                    self.stopping.wait(ERROR_RETRY_SECONDS)
                    continue
                self.error = None
                if not busy:
                    self.stopping.wait(IDLE_POLL_SECONDS)
        finally:
            if self.seg.registered:
                lib.shm_producer_detach(self.seg.ptr)
                self.seg.registered = False
            os.close(self.fd)

    def _step(self) -> bool:
        """One look; True if it did something worth looking again at once."""
        st, _ = _state(self.seg)
        if not st.overflowing:
            return False
        head, tail = int(st.head), int(st.tail)
        if head >= tail:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # an appender is writing: its record is next
            try:
                if lib.shm_ovf_finish(self.seg.ptr) == lib.SHM_OK:
                    os.ftruncate(self.fd, 0)
                    self.punched = 0
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.seg.post(RX, 1)  # a shut-down receiver may report CLOSED now
            return False
        avail = tail - head
        buf = os.pread(self.fd, min(avail, READ_CHUNK), head)
        if not buf:
            raise errors.ChannelCorrupted(f"the overflow file {self.path!r} was cut short")
        off = 0
        while off < len(buf) and not self.stopping.is_set():
            end = len(buf)
            if end - off < HEADER.size and end < avail:
                break  # the next read starts at this record
            if end - off >= HEADER.size:
                magic, _crc, total = HEADER.unpack_from(buf, off)[:3]
                spans = off + total > end and total <= avail - off
                if magic == RECORD_MAGIC and total % 8 == 0 and total >= HEADER.size and spans:
                    if off:
                        break  # read on from this record next time
                    buf = os.pread(self.fd, total, head)  # one record longer than a read
                    continue
            rec = decode_at(buf, off, end)
            if rec is None:
                skip = self._resync(buf, off, end)
                rc = lib.shm_ovf_taken(self.seg.ptr, head + skip, 0, 1)
                if rc:
                    raise_for(rc, "overflow drain")
                return True
            kind, nkeys, blob, data, total = rec
            self._send(kind, data, blob, nkeys)
            off += total
            rc = lib.shm_ovf_taken(self.seg.ptr, head + off, 1, 0)
            if rc:
                raise_for(rc, "overflow drain")
            if head + off >= self.punched + PUNCH_EVERY:
                lib.shm_ovf_punch(self.fd, head + off)  # a file system without holes: no matter
                self.punched = head + off
        return True

    def _resync(self, buf: bytes, off: int, end: int) -> int:
        """Past a bad record at off: the offset of the next valid one (or end)."""
        nxt = off + 8
        while nxt < end:
            if decode_at(buf, nxt, end) is not None:
                return nxt
            nxt += 8
        return end

    def _send(self, kind: int, data: Any, blob: Any, nkeys: int) -> None:
        seg = self.seg
        data, blob = ffi.from_buffer(data), ffi.from_buffer(blob)
        if not seg.registered:
            seg.register_producer()
        s = seg.scratch()
        with SpaceWait("overflow drain", deadline_of(None)) as wait:
            while True:
                rc = lib.shm_send(
                    seg.ptr, kind, data, len(data), blob, len(blob), nkeys, s.seq, s.stall, s.wake
                )
                if s.wake[0]:
                    seg.post(RX, 1)
                if rc == lib.SHM_OK:
                    return
                if self.stopping.is_set():
                    raise _Stopped
                try:
                    if rc == lib.SHM_FULL:
                        wait.full(seg)
                    elif rc == lib.SHM_STALLED:
                        wait.stalled(seg, s.stall)
                    else:
                        raise_for(rc, "overflow drain")
                except errors.ChannelRemoved:
                    time.sleep(0.005)  # removed: the receiver still drains; so do we


class _Stopped(Exception):
    """The drainer was asked to stop while it waited for room."""


def start_drainer(seg: Segment) -> Drainer | None:
    """Start taking the channel's overflow back into its ring (the receiver's process
    calls this when it takes the seat); None if the channel has no overflow."""
    st, d = _state(seg, want_dir=True)
    if not st.dir_len:
        return None
    return Drainer(seg.name, seg.path, d, seg.chan_id)


def file_of(name: str, path: str | None) -> str | None:
    """The overflow file of the channel under that name now, if it has one (for removing
    a channel by name); None if it has none or cannot be opened."""
    try:
        seg = open_segment(name, path)
    except errors.Error:
        return None
    st, d = _state(seg, want_dir=True)
    return file_name(d, name, seg.chan_id) if st.dir_len else None
