"""Process identity and liveness: the one place that decides whether a process is alive.

A *token* names a process for as long as it lives and never again afterwards: its pid
(which the kernel reuses) together with its start time, in clock ticks since boot (which
never changes for a process). Tokens are what the shared segment records for every claim
a process makes: ring records, the receiver seat, producer registrations, handle holders.

    token = pid << 40 | start_ticks        (start_ticks < 2**40: ~348 years at 100 Hz)

psutil reports the start time as seconds since the epoch (boot time + ticks / CLK_TCK);
subtracting the boot time read in the same moment gives the ticks back exactly.
"""

from __future__ import annotations

import os

import psutil

__all__ = ["current_token", "token_of", "token_pid", "is_alive", "boot_id"]

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_TICKS_MASK = (1 << 40) - 1
_cached: tuple[int, int] | None = None  # (pid, token) of this process


def _token(proc: psutil.Process) -> int:
    ticks = round((proc.create_time() - psutil.boot_time()) * _CLK_TCK)
    return int((proc.pid << 40) | (ticks & _TICKS_MASK))


def token_of(pid: int) -> int:
    """The token of the live process `pid` (psutil.NoSuchProcess if there is none)."""
    return _token(psutil.Process(pid))


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
    try:
        proc = psutil.Process(token_pid(token))
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return _token(proc) == token
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True  # it exists; we may not inspect it, so never declare it dead


def boot_id() -> int:
    """A 64-bit number that changes with every boot (tokens are only unique within one)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            text = f.read().strip()
        return int(text.replace("-", ""), 16) & ((1 << 64) - 1)
    except OSError:
        return int(psutil.boot_time() * 1000) & ((1 << 64) - 1)
