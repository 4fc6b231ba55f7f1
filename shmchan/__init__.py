"""shmchan: a cross-process, shared-memory, multi-producer / single-consumer channel
whose messages carry keys, and whose receiver hands out key-locked handles.

    ch = shmchan.Channel.create("orders")
    ch.sender().send({"amount": 5}, keys=("acct:1", "acct:2"))
    with ch.receiver().recv(timeout=1) as h:
        print(h.seq, h.keys, h.payload)

See README.md for the semantics and the failure model.
"""

from .channel import (
    Batch,
    Channel,
    DeadLetter,
    Handle,
    Receiver,
    Sender,
    Stats,
    adopt,
    hand_over,
    list_channels,
    unlink,
)
from .errors import (
    ChannelCorrupted,
    ChannelExists,
    ChannelNotFound,
    ChannelRemoved,
    Closed,
    Empty,
    Error,
    Full,
    HandoverExpired,
    InvalidArgument,
    LayoutMismatch,
    MessageTooLarge,
    PayloadNotContiguous,
    ReceiverBusy,
    ResourceError,
    TaskNotPicklable,
    TaskTimeout,
    TooManyKeys,
    UnsupportedType,
    WorkerDied,
    WrongProcess,
)
from .exchange import (
    Exchange,
    ExchangeExists,
    ExchangeNotFound,
    ExchangeStats,
    list_exchanges,
    unlink_exchange,
)
from .inspect import HeldKey, Line, Wait, WaitChain
from .pool import ExecutorStats, KeyedExecutor, KeyedPool, PoolStats, RemoteTraceback, WorkerStats

__version__ = "0.1.0"

__all__ = [
    "Channel",
    "Sender",
    "Receiver",
    "Handle",
    "Batch",
    "Stats",
    "DeadLetter",
    "HeldKey",
    "Line",
    "Wait",
    "WaitChain",
    "unlink",
    "list_channels",
    "hand_over",
    "adopt",
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
    "ChannelRemoved",
    "InvalidArgument",
    "UnsupportedType",
    "PayloadNotContiguous",
    "WrongProcess",
    "ResourceError",
    "WorkerDied",
    "TaskTimeout",
    "TaskNotPicklable",
    "KeyedExecutor",
    "KeyedPool",
    "ExecutorStats",
    "PoolStats",
    "WorkerStats",
    "RemoteTraceback",
    "Exchange",
    "ExchangeStats",
    "ExchangeNotFound",
    "ExchangeExists",
    "unlink_exchange",
    "list_exchanges",
    "HandoverExpired",
]
