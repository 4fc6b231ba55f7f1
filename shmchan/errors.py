"""The exception hierarchy: every error shmchan raises derives from `Error`.

Each exception also subclasses the builtin a caller would naturally catch
(`queue.Full`, `ValueError`, `FileNotFoundError`, ...), so code written against
`multiprocessing.Queue` or plain file APIs keeps working.
"""

from __future__ import annotations

import queue

__all__ = [
    "Error",
    "Full",
    "Empty",
    "Closed",
    "MessageTooLarge",
    "TooManyKeys",
    "ChannelNotFound",
    "ChannelExists",
    "ReceiverBusy",
    "LayoutMismatch",
    "ChannelCorrupted",
]


class Error(Exception):
    """Base class of every shmchan error."""


class Full(Error, queue.Full):
    """`send` timed out: the channel had no room for the message in time."""


class Empty(Error, queue.Empty):
    """`recv` timed out: no message became available in time."""


class Closed(Error):
    """The channel was shut down (sends refused), or this object was closed."""


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
