"""The compiled core and the one table that turns its status codes into exceptions."""

from __future__ import annotations

import os
from typing import NoReturn

from _shmchan_core import ffi, lib  # the compiled C core (csrc/build_ffi.py)

from . import errors

__all__ = ["ffi", "lib", "raise_for"]

# Status code -> (exception class, message template). `{what}` is the operation.
_ERRORS: dict[int, tuple[type[BaseException], str]] = {
    lib.SHM_E_TOO_LARGE: (errors.MessageTooLarge, "{what}: message can never fit in this channel"),
    lib.SHM_E_TOO_MANY_KEYS: (errors.TooManyKeys, "{what}: more keys than the channel's max_keys"),
    lib.SHM_E_CORRUPT: (errors.ChannelCorrupted, "{what}: the shared segment is corrupt"),
    lib.SHM_E_LAYOUT: (
        errors.LayoutMismatch,
        "{what}: not a shmchan segment of this layout version",
    ),
    lib.SHM_E_INVALID: (errors.InvalidArgument, "{what}: invalid argument"),
    lib.SHM_E_NOMEM: (MemoryError, "{what}: out of memory"),
    lib.SHM_CLOSED: (errors.Closed, "{what}: the channel was shut down"),
    lib.SHM_REMOVED: (
        errors.ChannelRemoved,
        "{what}: the channel was removed (unlinked); nobody would ever receive this",
    ),
    lib.SHM_BUSY: (errors.ReceiverBusy, "{what}: another live receiver owns this channel"),
}


def raise_for(rc: int, what: str, detail: str = "") -> NoReturn:
    """Raise the exception that status `rc` of operation `what` stands for."""
    if rc == lib.SHM_E_SYS:
        err = ffi.errno
        raise errors.ResourceError(err, f"{what}: {os.strerror(err)}")
    cls, template = _ERRORS.get(rc, (errors.Error, f"{{what}}: unexpected status {rc}"))
    message = template.format(what=what)
    raise cls(f"{message}{': ' + detail if detail else ''}")
