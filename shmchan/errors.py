"""The exception hierarchy: every error shmchan raises derives from `Error`.

Each exception also subclasses the builtin a caller would naturally catch
(`queue.Full`, `ValueError`, `FileNotFoundError`, ...), so code written against
`multiprocessing.Queue` or plain file APIs keeps working.
"""

from __future__ import annotations

import pickle
import queue

__all__ = [
    "Error",
    "Full",
    "Empty",
    "Closed",
    "ChannelRemoved",
    "MessageTooLarge",
    "TooManyKeys",
    "ChannelNotFound",
    "ChannelExists",
    "ReceiverBusy",
    "LayoutMismatch",
    "ChannelCorrupted",
    "InvalidArgument",
    "UnsupportedType",
    "PayloadNotContiguous",
    "WrongProcess",
    "ResourceError",
    "WorkerDied",
    "TaskTimeout",
    "TaskNotPicklable",
    "PayloadNotPicklable",
    "RemoteError",
    "NotInWorker",
    "HandoverExpired",
    "InvalidDelay",
    "TooManyPausedKeys",
]


class Error(Exception):
    """Base class of every shmchan error."""


class Full(Error, queue.Full):
    """`send` timed out: the channel had no room for the message in time.

    `seqs` lists the seqs of the messages that were accepted before it was raised: for
    `send_many`, the prefix of the batch that went in (the rest did not); empty for
    `send`."""

    def __init__(self, *args: object, seqs: list[int] | None = None) -> None:
        super().__init__(*args)
        self.seqs: list[int] = [] if seqs is None else seqs


class Empty(Error, queue.Empty):
    """`recv` timed out: no message became available in time."""


class Closed(Error):
    """The channel was shut down (sends refused), or this object was closed.

    Raised part-way through `send_many`, `seqs` lists the seqs of the messages of the
    batch that were accepted before it (the rest were not)."""

    def __init__(self, *args: object, seqs: list[int] | None = None) -> None:
        super().__init__(*args)
        self.seqs: list[int] = [] if seqs is None else seqs


class ChannelRemoved(Closed):
    """The channel was removed (unlinked): sends into it are refused, since no receiver
    that opens the name from now on would ever see them. A receiver still attached
    drains what was accepted before."""


class MessageTooLarge(Error, ValueError):
    """The message can never fit in this channel, whatever is released."""


class TooManyKeys(Error, ValueError):
    """The message carries more distinct keys than the channel's `max_keys`."""


class ChannelNotFound(Error, FileNotFoundError):
    """No channel of that name exists."""


class ChannelExists(Error, FileExistsError):
    """A channel of that name already exists."""


class ReceiverBusy(Error):
    """Another live receiver (in this or another process) owns the channel."""


class LayoutMismatch(Error):
    """The segment was made by an incompatible shmchan version (or is not a channel)."""


class ChannelCorrupted(Error):
    """The shared segment holds bytes no correct process could have written."""


class InvalidArgument(Error, ValueError):
    """An argument's value is wrong (the caller's fault): a NaN or negative timeout, a
    bad name, an option out of range."""


class UnsupportedType(Error, TypeError):
    """An argument of a type shmchan does not take: a key that is not str, bytes or
    int, a timeout that is not a number, a payload a raw channel refuses."""


class PayloadNotContiguous(InvalidArgument, BufferError):
    """A memoryview payload that is not one contiguous run of bytes (e.g. a slice with a
    step): pass view.tobytes() or a contiguous copy."""


class ResourceError(Error, OSError):
    """The system refused what a channel needs: room in /dev/shm (or the file system of
    a path= channel), permission to open a channel another user made, a mapping. Not a
    fault of the channel: `errno` says which."""


class WrongProcess(Error):
    """An object used in a process it does not belong to, e.g. a Receiver inherited by
    a forked child (only the process that took the receiver may receive)."""


class WorkerDied(Error):
    """A pool's task ran out of attempts because its worker process died each time (it
    exited, was killed by a signal, or was likely OOM-killed: the message says which)."""


class TaskTimeout(WorkerDied):
    """A pool's task ran past `task_timeout` on its last attempt, so its worker was killed.
    (Not a `TimeoutError`: that is what `Future.result(timeout=)` raises while it waits.)"""


class TaskNotPicklable(Error, pickle.PicklingError, TypeError):
    """A task's function, arguments or result cannot be pickled, so it cannot travel
    between processes (define functions at module level; pass picklable arguments)."""


class PayloadNotPicklable(Error, pickle.PicklingError, TypeError):
    """A payload that is not bytes-like travels pickled, and this one cannot be pickled
    (a lock, a socket, an open file, a function defined inside another function...).
    Nothing was sent. Send picklable objects, or bytes you encode yourself."""


class RemoteError(Error):
    """An exception raised in a worker process that could not be rebuilt as its own type
    in this process: its class cannot be imported here, or its arguments or attributes
    cannot be pickled. `type_name` is the original type ("module.QualName"), the
    message is its text, and the worker's traceback is the `__cause__`."""

    def __init__(self, message: str, type_name: str = "") -> None:
        super().__init__(message)
        self.type_name = type_name

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.type_name), self.__dict__ or None)


class NotInWorker(Error, RuntimeError):
    """`shmchan.pool.current()` was called outside a KeyedPool handler or a
    KeyedExecutor task: only the code a worker process is running has a current
    message."""


class HandoverExpired(Error):
    """A pickled handle was unpickled too late: nobody adopted it within the channel's
    `handover` seconds, so its message was taken back and redelivered (attempt + 1).
    Also raised when the same pickle was already adopted by another process."""


class InvalidDelay(InvalidArgument):
    """A `delay=` or `ttl=` that is not a finite number of seconds in range (negative,
    NaN, infinite, too long): the message says which and what to pass instead."""


class TooManyPausedKeys(Error):
    """`pause_key` found every entry of the channel's table of paused keys in use (it
    holds a fixed number of keys: `shmchan.hold.MAX_PAUSED_KEYS`). Resume a key, or
    pause the whole channel."""
