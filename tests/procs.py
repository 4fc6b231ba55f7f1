"""Helpers shared by the tests that start processes: one spawn context, one bound on
every cross-process wait, and a context manager that never leaves a process behind."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator

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
