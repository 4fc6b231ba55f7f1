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
  name still means that channel).
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
import os
import threading

from . import liveness
from ._lib import ffi, lib
from ._segment import (
    PREFIX,
    SHM_DIR,
    Segment,
    attach_hooks,
    list_names,
    name_file,
    unlink_name,
)

__all__ = ["FLAG", "track", "sweep"]

FLAG: int = lib.SHM_CFG_TEMPORARY

_lock = threading.Lock()
_tracked: dict[tuple[str, int], str | None] = {}  # (name, chan_id) -> path (always None)
_registered_pid = 0


def track(seg: Segment) -> None:
    """Remember that this process uses temporary channel `seg` (any other is ignored):
    at exit, it removes the channel if no other live process maps it."""
    global _registered_pid
    if not seg.temporary:
        return
    with _lock:
        _tracked[(seg.name, seg.chan_id)] = seg.path
        if _registered_pid != os.getpid():  # once per process (a fork child registers anew)
            _registered_pid = os.getpid()
            atexit.register(_at_exit)


def _at_exit() -> None:
    if _registered_pid != os.getpid():
        return  # inherited through fork; this process never attached on its own
    me = os.getpid()
    with _lock:
        items = list(_tracked.items())
        _tracked.clear()
    if not items:
        return
    files = {key: name_file(key[0], path) for key, path in items}
    from .inspect import mapping_pids  # on first use: keeps `import shmchan` light

    try:
        maps = mapping_pids(list(files.values()))
    except OSError:
        return  # cannot tell who maps them: the sweep decides later
    for (name, chan_id), path in items:
        file = files[(name, chan_id)]
        others = maps.get(os.path.realpath(file), {me}) - {me}
        try:
            visible = _users_visible(os.stat(file))
        except OSError:
            continue  # already gone
        if visible and not others:
            try:
                unlink_name(name, path, chan_id)
            except OSError:
                pass  # at exit: nothing to report to, and the sweep tries again


def _users_visible(st: os.stat_result) -> bool:
    """Can this process see every process that may map a segment of this owner and
    mode? /proc shows us our own user's mappings (root: everyone's); a segment other
    users may open could be mapped by processes we cannot inspect."""
    return os.geteuid() == 0 or (st.st_uid == os.geteuid() and not st.st_mode & 0o077)


def _candidates() -> list[tuple[str, int]]:
    """(name, chan_id) of the temporary channels in /dev/shm whose receiver seat is not
    held by a live process (only those can be unused)."""
    out = []
    flags = ffi.new("uint32_t *")
    receiver = ffi.new("uint64_t *")
    ident = ffi.new("uint64_t *")
    for name in list_names():
        try:
            fd = os.open(os.path.join(SHM_DIR, PREFIX + name), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not _users_visible(os.fstat(fd)):
                continue
            if lib.shm_read_flags_fd(fd, flags, receiver) != lib.SHM_OK:
                continue  # not a channel of this layout, or still being created
            if not flags[0] & FLAG or liveness.is_alive(int(receiver[0])):
                continue
            if lib.shm_read_identity(fd, ident) != lib.SHM_OK:
                continue
        finally:
            os.close(fd)
        out.append((name, int(ident[0])))
    return out


def sweep() -> list[str]:
    """Remove every temporary channel in /dev/shm that no live process maps; return
    their names."""
    found = _candidates()
    if not found:
        return []
    files = {name: os.path.join(SHM_DIR, PREFIX + name) for name, _ in found}
    from .inspect import mapping_pids  # as in _at_exit

    try:
        maps = mapping_pids(list(files.values()))
    except OSError:
        return []  # cannot tell who maps them: remove nothing
    removed = []
    for name, chan_id in found:
        if maps.get(os.path.realpath(files[name]), {0}):
            continue  # mapped by a live process (or unknown: left alone)
        try:
            if unlink_name(name, None, chan_id):
                removed.append(name)
        except OSError:
            continue  # e.g. another user's channel we may not remove: left as it is
    return removed


attach_hooks.append(track)  # every channel this process creates or opens
