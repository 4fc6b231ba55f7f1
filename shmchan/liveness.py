"""Process identity and liveness: the one place that decides whether a process is alive.

A *token* names a process for as long as it lives and never again afterwards: its pid
(which the kernel reuses) together with its start time, in clock ticks since boot (which
never changes for a process). Tokens are what the shared segment records for every claim
a process makes: ring records, the receiver seat, producer registrations, handle holders.

    token = pid << 40 | start_ticks        (start_ticks < 2**40: ~348 years at 100 Hz)

The start time is field 22 of /proc/PID/stat, already in clock ticks since boot: the
token is read from there directly (one small read, no float arithmetic), which is also
what keeps `import shmchan` and a process's first attach quick -- this module is on the
path of every Channel.create / open. Zombies count as dead. A /proc that hides other
users' processes (hidepid) makes them look absent here, as it does to every tool.
"""

from __future__ import annotations

import os

__all__ = ["current_token", "token_of", "token_pid", "is_alive", "boot_id"]

_TICKS_MASK = (1 << 40) - 1
_cached: tuple[int, int] | None = None  # (pid, token) of this process


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start ticks) of process `pid`, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so the fields
    # are counted from the last ')'; starttime is field 22, the 20th after comm.
    rest = data[data.rindex(b")") + 2 :].split()
    return rest[0].decode(), int(rest[19])


def token_of(pid: int) -> int:
    """The token of the live process `pid` (ProcessLookupError if there is none)."""
    st = _stat(pid)
    if st is None:
        raise ProcessLookupError(f"no process {pid}")
    return (pid << 40) | (st[1] & _TICKS_MASK)


def current_token() -> int:
    """This process's token (recomputed after a fork)."""
    global _cached
    pid = os.getpid()
    if _cached is None or _cached[0] != pid:
        _cached = (pid, token_of(pid))
    return _cached[1]


def token_pid(token: int) -> int:
    return token >> 40


def is_alive(token: int) -> bool:
    """True while the process named by `token` runs (zombies count as dead)."""
    if token == 0:
        return False
    pid = token_pid(token)
    st = _stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    return ((pid << 40) | (st[1] & _TICKS_MASK)) == token


def boot_id() -> int:
    """A 64-bit number that changes with every boot (tokens are only unique within one)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            text = f.read().strip()
        return int(text.replace("-", ""), 16) & ((1 << 64) - 1)
    except OSError:  # no such file (an old or unusual kernel): the boot time will do
        with open("/proc/stat") as f:
            btime = next(line for line in f if line.startswith("btime "))
        return int(btime.split()[1]) * 1000 & ((1 << 64) - 1)
