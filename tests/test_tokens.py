"""Process tokens (shmchan/liveness.py): pid and start time, read from /proc/PID/stat.

A token must name one process for as long as it lives and never another: these tests
compare it with psutil's view of the same process (start time as seconds since the epoch,
less the boot time) and check that exited, zombie and impostor tokens are dead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from shmchan import liveness

CLK_TCK = os.sysconf("SC_CLK_TCK")


def psutil_token(pid: int) -> int:
    p = psutil.Process(pid)
    ticks = round((p.create_time() - psutil.boot_time()) * CLK_TCK)
    return (pid << 40) | (ticks & ((1 << 40) - 1))


def test_tokens_agree_with_psutil_for_every_visible_process() -> None:
    compared = 0
    for pid in psutil.pids():
        try:
            want = psutil_token(pid)
            got = liveness.token_of(pid)
        except (psutil.Error, ProcessLookupError):
            continue  # exited meanwhile
        assert got == want, pid
        compared += 1
    assert compared >= 2  # at least this process and its parent
    assert liveness.current_token() == psutil_token(os.getpid())


def test_a_name_with_spaces_and_parentheses_does_not_shift_the_fields() -> None:
    # comm may hold ") " -- the start time is counted from the last ')'.
    code = (
        "import ctypes, time; ctypes.CDLL(None).prctl(15, b'a) b (c) d', 0, 0, 0); "  # PR_SET_NAME
        "time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).name() != "a) b (c) d":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert liveness.token_of(child.pid) == psutil_token(child.pid)
        assert liveness.is_alive(liveness.token_of(child.pid))
    finally:
        child.kill()
        child.wait(10)


def test_exited_zombie_and_impostor_tokens_are_dead() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    token = liveness.token_of(child.pid)
    assert liveness.is_alive(token)
    deadline = time.monotonic() + 10
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:  # exited, not reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not liveness.is_alive(token)
    child.wait(10)
    assert not liveness.is_alive(token)  # reaped: no such process
    me = liveness.current_token()
    assert liveness.is_alive(me)
    assert not liveness.is_alive(me + 1)  # this pid, another start time: a reused pid
    assert not liveness.is_alive(0)
