"""Helpers shared by the tests that start processes: one spawn context, one bound on
every cross-process wait, and a context manager that never leaves a process behind."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import subprocess
import sys
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
