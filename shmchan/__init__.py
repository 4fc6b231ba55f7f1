"""shmchan: a cross-process, shared-memory, multi-producer / single-consumer channel
whose messages carry keys, and whose receiver hands out key-locked handles.

    ch = shmchan.Channel.create("orders")
    ch.sender().send({"amount": 5}, keys=("acct:1", "acct:2"))
    with ch.receiver().recv(timeout=1) as h:
        print(h.seq, h.keys, h.payload)

The documentation (docs/, or README.md for a start) gives the semantics and the
failure model.
"""

import importlib
from typing import TYPE_CHECKING, Any

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
    split_hand_over,
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
    InvalidDelay,
    LayoutMismatch,
    MessageTooLarge,
    NotInWorker,
    PayloadNotContiguous,
    PayloadNotPicklable,
    ReceiverBusy,
    RemoteError,
    ResourceError,
    TaskNotPicklable,
    TaskTimeout,
    TooManyKeys,
    TooManyPausedKeys,
    UnsupportedType,
    WorkerDied,
    WrongProcess,
)
from .timers import backoff

if TYPE_CHECKING:
    from .exchange import (
        Exchange,
        ExchangeExists,
        ExchangeNotFound,
        ExchangeRemoved,
        ExchangeStats,
        Published,
        Unroutable,
        list_exchanges,
        unlink_exchange,
    )
    from .inspect import HeldKey, Line, Wait, WaitChain
    from .pool import (
        ExecutorStats,
        InitializerFailed,
        KeyedExecutor,
        KeyedPool,
        PoolStats,
        RemoteTraceback,
        WorkerStats,
    )

__version__ = "0.1.0"

# The layers above the channel are imported on first use (PEP 562): a process that only
# sends or receives -- a Spark task, a short-lived producer -- does not pay for the
# worker pools (concurrent.futures), the exchanges or the operators' view at import.
_LAZY_MODULES = {
    "exchange": (
        "Exchange",
        "ExchangeExists",
        "ExchangeNotFound",
        "ExchangeRemoved",
        "ExchangeStats",
        "Published",
        "Unroutable",
        "list_exchanges",
        "unlink_exchange",
    ),
    "inspect": ("HeldKey", "Line", "Wait", "WaitChain"),
    "pool": (
        "ExecutorStats",
        "InitializerFailed",
        "KeyedExecutor",
        "KeyedPool",
        "PoolStats",
        "RemoteTraceback",
        "WorkerStats",
    ),
}
_LAZY = {name: module for module, names in _LAZY_MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shmchan' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once: later look-ups are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
    "split_hand_over",
    "backoff",
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
    "InvalidDelay",
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
    "InitializerFailed",
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
    "ExchangeRemoved",
    "Published",
    "Unroutable",
    "unlink_exchange",
    "list_exchanges",
    "HandoverExpired",
    "TooManyPausedKeys",
]
