"""KeyedExecutor and KeyedPool: worker processes with the key-lock promise, crash-proof.

Work that shares a key never runs at the same time and runs in submission order, even
when a worker process is killed: both classes are built on a channel's key-locked
handles (its public API only), and a worker holds a task's handle until it is done.

KeyedExecutor: the caller's threads register each task and send its message (task id,
pickled function and arguments, the user's keys) into the executor's task channel; one
manager thread takes the tasks whose keys are free, hands their handles to the worker
processes through pipes, resolves the futures from the result channel, and releases
each task's handle, which frees its keys for the next task in line. A future is RUNNING
once a worker adopted its task; until then cancel() takes the task back, and it never
runs. A worker that dies is replaced and what it held runs again (attempt + 1, in key
order); after `max_attempts` the future fails with WorkerDied. manager.py draws the
data flow and keeps the bookkeeping; executor.py is the caller's side.

KeyedPool serves an existing named channel instead: the pool's process is its receiver,
the same workers run handler(payload, keys) for every message, a return releases the
handle and an exception nacks it (the channel's own max_attempts / dead letters apply).
In a worker, `current()` describes the message (or task) being run: seq, attempt, keys,
lease deadline (see shmchan/delivery.py).

The channels an executor creates are named `kx-<creator token>-<n>-tasks|results`;
they are unlinked at shutdown, and a new executor unlinks those of dead creators.
"""

from __future__ import annotations

from ..delivery import Delivery, current
from .common import InitializerFailed
from .executor import KeyedExecutor
from .keyedpool import KeyedPool
from .stats import ExecutorStats, PoolStats, RemoteTraceback, WorkerStats

__all__ = [
    "current",
    "Delivery",
    "KeyedExecutor",
    "KeyedPool",
    "ExecutorStats",
    "InitializerFailed",
    "PoolStats",
    "WorkerStats",
    "RemoteTraceback",
]
