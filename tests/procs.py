"""Helpers shared by the tests that start processes: one spawn context, one bound on
every cross-process wait, and a context manager that never leaves a process behind."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import shmchan

CTX = multiprocessing.get_context("spawn")
WAIT = 30  # seconds any single cross-process wait may take before the test fails


@contextlib.contextmanager
def running(*procs: multiprocessing.process.BaseProcess) -> Iterator[None]:
    """Start the processes; whatever happens, leave none of them alive."""
    try:
        for p in procs:
            p.start()
        yield
    finally:
        for p in procs:
            if p.is_alive():
                p.join(0.5)
            if p.is_alive():
                p.kill()
            p.join(WAIT)


def child_env() -> dict[str, str]:
    """Make a child import the same shmchan as this test process (installed or in place)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(shmchan.__file__ or "")))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def run_shmchan(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`python -m shmchan ARGS` in a child, output captured, time bounded."""
    return subprocess.run(
        [sys.executable, "-m", "shmchan", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
    )


def take_receiver_seat(ch: shmchan.Channel) -> shmchan.Receiver:
    """ch.receiver(), retried while the previous receiver's seat is still taken: its
    holder was killed and reaped, so ReceiverBusy lasts only until the seat is seen
    free (for longer than WAIT only by a bug)."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            return ch.receiver()
        except shmchan.ReceiverBusy:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def wait_forked(pid: int, limit: float = WAIT) -> int | None:
    """The exit code of the forked child `pid`; None (after killing it) if it still runs
    after `limit` seconds."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def cpu_share(pid: int, settle: float = 0.5, seconds: float = 1.0) -> float:
    """The share of one core process `pid` uses over `seconds`, after `settle` seconds."""
    import psutil

    proc = psutil.Process(pid)
    time.sleep(settle)
    cpu0, wall0 = sum(proc.cpu_times()[:2]), time.monotonic()
    time.sleep(seconds)
    cpu1, wall1 = sum(proc.cpu_times()[:2]), time.monotonic()
    return (cpu1 - cpu0) / (wall1 - wall0)
