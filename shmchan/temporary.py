"""Temporary channels: removed when the last process using them is gone.

`Channel.create(name, temporary=True)` marks the segment (SHM_CFG_TEMPORARY in its
configuration, fixed at create). Its users are the processes that map it: the creator,
its receiver, its senders, the holders of its handles, anyone who opened it -- the
kernel's list of mappings (/proc/PID/maps) is the one record that cannot be left stale
by a process killed at any instruction, so it is what decides; no count is kept in the
segment that a SIGKILL could leave wrong.

Removal happens at two moments:

* at exit: a process that attached to a temporary channel checks, when it exits
  normally (atexit), whether any other live process maps it; if none does, it removes
  the channel (name, segment and semaphores, as `shmchan.unlink` does, and only if the
  name still means that channel). While another live process holds the receiver seat
  the channel is in use, and the exit costs one pread: a pass over /proc (tens to
  hundreds of ms on a busy machine) is made only when the receiver is gone or exiting.
* by a sweep, for users that did not exit normally (SIGKILL, a crash, os._exit -- which
  is also how forked multiprocessing workers end): every `Channel.create` on the machine,
  `shmchan ls` and `shmchan rm --stale` first remove every temporary channel in /dev/shm
  that no live process maps. The sweep reads each channel's flags with one pread, and
  looks at mappings (a pass over /proc) only when a temporary channel has no live
  receiver.

So a temporary channel outlives its users by at most until the next of those calls.
When two last users exit at the same moment, each may see the other still mapping the
channel: then the sweep removes it. A process that is opening a temporary channel at
the moment a sweep finds no process mapping it gets a channel that is already removed
(its sends raise ChannelRemoved), as after any unlink.

A temporary channel lives in /dev/shm only: `temporary=True` with `path=` is refused (a
durable file that deletes itself when its users exit is a contradiction). /proc shows a
process the mappings of its own user's processes only (root's: everyone's), so a
temporary channel whose mode= lets other users open it is removed only by root's
sweep, or by unlink.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading

from . import liveness, overflow
from ._lib import ffi, lib
from ._segment import (
    PREFIX,
    SHM_DIR,
    Segment,
    attach_hooks,
    list_names,
    unlink_name,
)

__all__ = ["FLAG", "track", "sweep"]

FLAG: int = lib.SHM_CFG_TEMPORARY

_lock = threading.Lock()
_tracked: set[tuple[str, int]] = set()  # (name, chan_id) of the channels this process used
_registered_pid = 0


def track(seg: Segment) -> None:
    """Remember that this process uses temporary channel `seg` (any other is ignored):
    at exit, it removes the channel if no other live process maps it."""
    global _registered_pid
    if not seg.temporary or seg.path is not None:
        return
    with _lock:
        _tracked.add((seg.name, seg.chan_id))
        if _registered_pid != os.getpid():  # once per process (a fork child registers anew)
            _registered_pid = os.getpid()
            atexit.register(_at_exit)


def _at_exit() -> None:
    if _registered_pid != os.getpid():
        return  # inherited through fork; this process never attached on its own
    with _lock:
        items = list(_tracked)
        _tracked.clear()
    # Only channels still there whose receiver is gone or is this process are worth the
    # pass over /proc (a worker exiting while its executor receives pays nothing).
    found = [(name, chan_id) for name, chan_id in items if _probe(name, chan_id, exiting=True)]
    _remove_unmapped(found, exclude=os.getpid())


def _probe(name: str, chan_id: int, exiting: bool = False) -> int | None:
    """The id of temporary channel `name` if it may be unused: it is temporary, its file
    is readable, its users are all visible to us (_users_visible), its id is `chan_id`
    (0: any), and no other live process holds its receiver seat. None otherwise."""
    flags = ffi.new("uint32_t *")
    receiver = ffi.new("uint64_t *")
    ident = ffi.new("uint64_t *")
    try:
        fd = os.open(os.path.join(SHM_DIR, PREFIX + name), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # gone (or not ours to read)
    try:
        if not _users_visible(os.fstat(fd)):
            return None
        if lib.shm_read_flags_fd(fd, flags, receiver) != lib.SHM_OK:
            return None  # not a channel of this layout, or still being created
        if lib.shm_read_identity(fd, ident) != lib.SHM_OK:
            return None
    finally:
        os.close(fd)
    if not flags[0] & FLAG or (chan_id and int(ident[0]) != chan_id):
        return None
    seat = int(receiver[0])
    if seat and not (exiting and seat == liveness.current_token()) and liveness.is_alive(seat):
        return None  # a live receiver: in use
    return int(ident[0])


def _remove_unmapped(found: list[tuple[str, int]], exclude: int = 0) -> list[str]:
    """Remove the channels of `found` that no live process (other than pid `exclude`)
    maps; return their names."""
    if not found:
        return []
    from .inspect import mapping_pids  # on first use: keeps `import shmchan` light

    files = {name: os.path.join(SHM_DIR, PREFIX + name) for name, _ in found}
    try:
        maps = mapping_pids(list(files.values()))
    except OSError:
        return []  # cannot tell who maps them: remove nothing
    removed = []
    for name, chan_id in found:
        if maps.get(os.path.realpath(files[name]), {0}) - {exclude}:
            continue  # mapped by a live process
        spill = overflow.file_of(name, None)  # its overflow file goes with it
        try:
            if unlink_name(name, None, chan_id):
                removed.append(name)
            else:
                continue
        except OSError:
            continue  # e.g. a channel we may not remove: left as it is
        if spill is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spill)
    return removed


def _users_visible(st: os.stat_result) -> bool:
    """Can this process see every process that may map a segment of this owner and
    mode? /proc shows us our own user's mappings (root: everyone's); a segment other
    users may open could be mapped by processes we cannot inspect."""
    return os.geteuid() == 0 or (st.st_uid == os.geteuid() and not st.st_mode & 0o077)


def sweep() -> list[str]:
    """Remove every temporary channel in /dev/shm that no live process maps; return
    their names."""
    found = []
    for name in list_names():
        chan_id = _probe(name, 0)
        if chan_id is not None:
            found.append((name, chan_id))
    return _remove_unmapped(found)


attach_hooks.append(track)  # every channel this process creates or opens
