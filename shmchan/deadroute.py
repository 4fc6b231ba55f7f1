"""Dead letters routed to an exchange (RabbitMQ's dead-letter exchange); the Python side
of csrc/deadroute.c, which keeps the exchange's name in the channel.

A channel made with `Channel.create(..., dead_letter_exchange="name")`, or told so later
with `ch.route_dead_letters("name")`, publishes each of its dead letters -- out of
attempts, or expired (`send(..., ttl=)`) -- to that exchange instead of keeping it in
`ch.dead_letters()`:

* with the message's payload and keys, and the reason as the routing key: "attempts" or
  "expired" (shmchan's exchanges carry no headers: bind a direct exchange's channels by
  reason, or use a fanout exchange for all of them);
* all or nothing, as every publish is, and mandatory: a dead letter that no binding
  takes (its reason matches none, a bound channel is missing or full, the exchange does
  not exist) stays in the list, and the next upkeep tries again -- nothing is lost;
* by the receiver's upkeep (every few tenths of a second while it receives), published
  first and then discarded from the list: a receiver killed between the two publishes it
  again when the next receiver's upkeep comes (at least once, like a redelivery).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import errors
from ._lib import ffi, lib, raise_for
from ._segment import Segment, check_name

if TYPE_CHECKING:
    from .handle import DeadLetter

__all__ = ["Router", "check_route", "get_route", "set_route"]

_NAME_MAX = 208  # SHM_GATE_NAME_MAX: an exchange name is at most this many bytes


def _name_of(exchange: object) -> str | None:
    if exchange is None:
        return None
    name = exchange if isinstance(exchange, str) else getattr(exchange, "name", None)
    if not isinstance(name, str):
        raise errors.UnsupportedType(
            "dead_letter_exchange must be an Exchange, an exchange's name or None, "
            f"not {type(exchange).__name__}"
        )
    try:
        check_name(name)
    except ValueError as e:
        msg = str(e).replace("channel name", "exchange name")
        raise errors.InvalidArgument(f"dead_letter_exchange: {msg}") from None
    if len(name.encode()) > _NAME_MAX:
        raise errors.InvalidArgument(f"exchange name {name!r} is longer than {_NAME_MAX} bytes")
    return name


def check_route(exchange: object) -> None:
    """Refuse a bad dead_letter_exchange before anything is made."""
    _name_of(exchange)


def set_route(seg: Segment, exchange: object) -> None:
    """Route the channel's dead letters to `exchange` (an Exchange or its name); None:
    keep them in the dead-letter list."""
    name = _name_of(exchange)
    raw = b"" if name is None else name.encode()
    rc = lib.shm_dead_route_set(seg.ptr, raw, len(raw))
    if rc:
        raise_for(rc, "route_dead_letters")


def get_route(seg: Segment) -> str | None:
    """The exchange the channel's dead letters go to, or None."""
    buf = ffi.new("char[]", _NAME_MAX)
    n = ffi.new("uint32_t *")
    if lib.shm_dead_route_get(seg.ptr, buf, n) != lib.SHM_OK or n[0] == 0:
        return None
    try:
        return bytes(ffi.buffer(buf, n[0])).decode()
    except UnicodeDecodeError:
        return None  # not a name anyone set: keep the dead letters


class Router:
    """The receiver's side: publishes dead letters at each upkeep (keeps its Exchange
    open between upkeeps)."""

    def __init__(self) -> None:
        self._exchange: Any = None

    def route(self, dead_letters: Callable[[], list[DeadLetter]], seg: Segment) -> int:
        """Publish what is in the dead-letter list to the channel's dead-letter exchange,
        if it has one; returns how many went. Whatever cannot go now stays listed."""
        st = ffi.new("shm_stats *")
        lib.shm_stats_read(seg.ptr, st)
        if st.dead_letters == 0:
            return 0
        name = get_route(seg)
        if name is None:
            return 0
        from .exchange import Exchange, Unroutable  # on first use: most channels route nothing

        ex = self._exchange
        if ex is None or ex.name != name:
            try:
                ex = self._exchange = Exchange.open(name)
            except errors.Error:
                return 0  # not there (yet): the letters stay listed
        sent = 0
        for d in dead_letters():
            try:
                ex.publish(d.payload, routing_key=d.reason, keys=d.keys, timeout=0, mandatory=True)
            except Unroutable:  # no binding takes its reason: it stays listed
                continue
            except errors.Error:  # Full, ExchangeRemoved...: they stay listed until later
                self._exchange = None  # opened again next time (it may have been removed)
                break
            d.discard()
            sent += 1
        return sent
