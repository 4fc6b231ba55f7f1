"""KeyedExecutor and KeyedPool: worker processes with the key-lock promise, crash-proof.

Work that shares a key never runs at the same time and runs in submission order, even
when a worker process is killed: both classes are built on a channel's key-locked
handles (its public API only), and a worker holds a task's handle until it is done.

KeyedExecutor's data flow (one manager thread owns every piece of bookkeeping; the
caller's threads only register futures and send task messages):

    caller: submit / map                  manager thread                 worker processes
      Future into `tasks`,
      task message (task id + pickled fn, args) with the user's keys
        --> [task channel] --recv_many: handles whose keys are free and whose
                                        predecessors on them finished-->
                                          dispatch: handle references (hand_over)
                                             --pipe--> reader thread: inbox
                                                       main thread: adopt one, run fn
        [result channel] <------------------ result message (task id + pickled value)
      futures resolved <-- recv_many, release_many              then release the task's
                                                                handle: its keys go to
                                                                the next task in line

A future is RUNNING once a worker adopted its task (the worker adopts each task right
before running it). Until then the task is in transit and cancel() takes it back by
adopting it in the executor's process: the channel lets exactly one adoption win, so a
cancelled task never runs. The same take-back moves the tasks waiting behind a long
task in one worker's hands to an idle worker. Every change of a task's state (handed,
started, cancelled) is made under the executor's lock; results and failures are set by
the manager thread, cancellations by the thread that cancels.

Done-callbacks run in the manager thread, which is what empties the task channel: a
submit made there never waits for room in it (what finds it full waits in the manager's
backlog and goes out, in order, as room appears; submits from other threads wait for
that backlog to empty first, so none overtakes it).

A worker that dies (any exit, signal, OOM kill) still holds, or was about to adopt, the
handles it was given. The manager sees the death, nacks them (the channel redelivers
each with attempt + 1 ahead of everything behind it on its keys, so the keys are never
free in between), replaces the worker, and runs them again. The task that was running
when its worker died counts an attempt; after `max_attempts` its future fails with
WorkerDied (TaskTimeout if the last attempt ran past task_timeout) and its handle is
released. Nothing else is lost and the executor keeps working.

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
