"""What a pool worker is holding: the message its handler (or task) is running on.

A worker process runs one message at a time. Before it calls the handler it records
the message's handle here (`enter`), and clears it once the handler has returned or
raised (`leave`), before the handle is released: `current()` is therefore answered only
while a message is held. It is one record per process, not per thread, so threads the
handler starts see the same message. The Delivery is built on the first `current()` of
each message (reading a handle's keys decodes them: a handler that never asks costs
nothing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from . import errors
from .codec import Key

__all__ = ["Delivery", "current", "enter", "leave"]


@dataclass(frozen=True)
class Delivery:
    """The message a KeyedPool handler or a KeyedExecutor task is running on."""

    seq: int
    """The message's channel-wide sequence number: the same on every attempt, so it
    identifies the message (e.g. to make the handler's effects idempotent)."""
    attempt: int
    """1 on the first delivery; one more each time it was delivered again (its handler
    raised, or the worker holding it died). More than 1: an earlier attempt may have
    done part of the work. (A KeyedExecutor task handed to a worker that died before
    starting it counts such an attempt too.)"""
    keys: tuple[Key, ...]
    """The message's keys (a KeyedExecutor task's `keys=`), held while it runs."""
    deadline: float | None
    """When the message's lease runs out, on the time.monotonic() clock: past it, the
    channel takes the message back and delivers it again. A KeyedPool worker renews the
    lease as the handler starts, so it is the channel's `lease` seconds from then. None:
    no lease (a channel without one; KeyedExecutor tasks, bounded by task_timeout)."""

    def time_left(self) -> float | None:
        """Seconds until `deadline` (negative once past it), or None without a lease."""
        return None if self.deadline is None else self.deadline - time.monotonic()


_handle: Any = None  # the handle being run in this process, or None
_keys: tuple[Key, ...] | None = None  # its keys, if the worker decoded them already
_deadline: float | None = None
_made: Delivery | None = None


def enter(handle: Any, keys: tuple[Key, ...] | None = None, deadline: float | None = None) -> None:
    """Worker side: `handle` is being run from now on (`keys`: its keys, if known)."""
    global _handle, _keys, _deadline, _made
    _handle, _keys, _deadline, _made = handle, keys, deadline, None


def leave() -> None:
    """Worker side: the handle's run is over (before it is released or given back)."""
    global _handle, _keys, _made
    _handle = _keys = _made = None


def current() -> Delivery:
    """The message the running KeyedPool handler or KeyedExecutor task holds: its seq,
    attempt, keys and lease deadline. NotInWorker when called anywhere else (in the
    process that owns the pool, or in a worker between messages)."""
    global _made
    made = _made
    if made is not None:
        return made
    h = _handle
    if h is None:
        raise errors.NotInWorker(
            "shmchan.pool.current() has no message to describe here: it answers only "
            "inside a KeyedPool handler or a KeyedExecutor task, while it runs in its "
            "worker process (call it from the handler or the task function)"
        )
    keys = _keys if _keys is not None else tuple(h.keys)
    made = Delivery(seq=h.seq, attempt=h.attempt, keys=keys, deadline=_deadline)
    if _handle is h:  # (not left meanwhile, by another thread)
        _made = made
    return made
