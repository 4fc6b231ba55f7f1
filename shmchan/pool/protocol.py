"""What the pools' manager and worker processes say to each other: the task and result
messages of KeyedExecutor, the words a worker publishes about itself, and the exit
statuses a worker ends with.

Task message (the executor's task channel; the task's keys are the message's keys):

    TASK_HEADER  <QQIB   task id, function id, n = len(pickle(fn)), kind
    pickle(fn)           n bytes
    body                 by kind:
        CALL        pickle((args, kwargs))   fn(*args, **kwargs)        (submit)
        ONE         pickle(x)                fn(x)                      (map of one iterable)
        STAR        pickle(args)             fn(*args)                  (map of several)
        CHUNK       pickle([x, ...])         [fn(x), ...]               (map in chunks)
        CHUNK_STAR  pickle([args, ...])      [fn(*args), ...]

The function is pickled apart with an id, so that a worker unpickles each function once:
the executor keeps one id per function whose pickle cannot change (a plain function
pickles by reference) and gives every other pickle a new one; id 0 is never remembered.
Task id 0 belongs to no task: the executor sends a bare TASK_HEADER with it to wake its
manager, which drops it.

Result message (the executor's result channel, no keys):

    RESULT_HEADER <QQIQB  task id, seq of the task's message, worker pid,
                          FINISHED including this one (see below), status
    body                  OK: pickle(value); RAISED: the exception as remote.pack makes it

A chunk's value is (values, failed): values[i] is item i's result, or its exception
packed by remote.pack where failed (None, or a set of indices) says so. An empty result
message (shorter than RESULT_HEADER) is a wake-up and carries nothing.

Worker words: a multiprocessing RawArray of int64, SLOT words per worker, each written
only by its worker and read by the manager:

    words[SLOT * i + RUNNING]   seq + 1 of the handle being run, 0 between handles
    words[SLOT * i + STARTED]   CLOCK_MONOTONIC ns when that run started
    words[SLOT * i + FINISHED]  handles taken from the inbox and finished, ever
    words[SLOT * i + FAILED]    of those, handler calls that raised (KeyedPool)
    words[SLOT * i + READY]     1 once the initializer returned (KeyedPool hands out
                                nothing before: a worker whose initializer fails never
                                held a message, so none is charged an attempt; a
                                KeyedExecutor worker that exits before it is set never
                                started, which breaks the executor)

Handles are finished in the order they were handed over, so the manager knows from
FINISHED which of the handles it gave a worker are still in its hands.
"""

from __future__ import annotations

import struct

__all__ = [
    "SLOT",
    "RUNNING",
    "STARTED",
    "FINISHED",
    "FAILED",
    "READY",
    "TASK_HEADER",
    "CALL",
    "ONE",
    "STAR",
    "CHUNK",
    "CHUNK_STAR",
    "WAKE_TASK",
    "RESULT_HEADER",
    "OK",
    "RAISED",
    "PARENT_CHECK_SECONDS",
    "EXIT_PARENT_GONE",
    "EXIT_INIT_FAILED",
]

SLOT, RUNNING, STARTED, FINISHED, FAILED, READY = 5, 0, 1, 2, 3, 4

TASK_HEADER = struct.Struct("<QQIB")
CALL, ONE, STAR, CHUNK, CHUNK_STAR = 0, 1, 2, 3, 4
# The message that wakes a manager waiting on its task channel (task id 0: no task).
WAKE_TASK = TASK_HEADER.pack(0, 0, 0, CALL)

RESULT_HEADER = struct.Struct("<QQIQB")
OK, RAISED = 0, 1

# How often a worker checks that its manager's process lives; no blocking call in a
# worker waits longer than this at a time.
PARENT_CHECK_SECONDS = 1.0
EXIT_PARENT_GONE = 70  # the manager's process died: nobody wants our results any more
EXIT_INIT_FAILED = 71  # the initializer raised
