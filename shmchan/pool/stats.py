"""The snapshots stats() returns."""

from __future__ import annotations

from dataclasses import dataclass

from ..remote import RemoteTraceback

__all__ = ["RemoteTraceback", "WorkerStats", "ExecutorStats", "PoolStats"]


@dataclass(frozen=True)
class WorkerStats:
    """One worker process, as the manager last saw it."""

    pid: int | None
    """Its process id (None before it started)."""
    state: str
    """"idle", "busy" (running a task), "stopping" or "dead" (about to be replaced)."""
    finished: int
    """Tasks (or messages) it finished, ever."""
    started: float | None
    """How long the task it runs has been running, in seconds (None when not busy)."""


@dataclass(frozen=True)
class ExecutorStats:
    """A snapshot of a KeyedExecutor."""

    queued: int
    """Tasks submitted and not started (waiting for keys, or in a worker's hands waiting
    for it to start them: those can still be cancelled)."""
    running: int
    """Tasks a worker is running now (started: their futures say running)."""
    done: int
    """Tasks that finished with a result, ever."""
    retried: int
    """Times a task was handed to a worker again after a worker died, ever."""
    failed: int
    """Tasks that finished with an exception (theirs, WorkerDied or TaskTimeout), ever."""
    cancelled: int
    """Tasks cancelled before they ran, ever."""
    held_keys: int
    """Keys locked by tasks that are out of the task channel (running or about to)."""
    workers: tuple[WorkerStats, ...]
    """The worker processes."""


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a KeyedPool."""

    queued: int
    """Messages in the channel not yet handed out (waiting for keys included)."""
    running: int
    """Messages the pool holds: handed to a worker or about to be."""
    handled: int
    """Messages whose handler returned, ever."""
    failed: int
    """Handler calls that raised (the message was nacked), ever."""
    redelivered: int
    """Messages given back after their worker died, ever."""
    held_keys: int
    """Keys locked by the channel's in-flight handles."""
    workers: tuple[WorkerStats, ...]
    """The worker processes."""
