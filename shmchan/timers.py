"""Delays, back-off and time-to-live: the Python side of csrc/timers.c.

A message's times are CLOCK_REALTIME nanoseconds (`time.time_ns()`), stored in its record
(a send's `delay=` and `ttl=`) or its slot (a nack's `delay=`), so that a durable
channel's file keeps them across a reboot. Every value is checked here, before anything is
sent or given back: a bad one is `shmchan.InvalidDelay` (a `ValueError`) or
`shmchan.UnsupportedType` (a `TypeError`), never a silently ignored option.

`backoff` is the retry schedule a RabbitMQ or NSQ user builds by hand (NSQ's
exponential requeue delay, a retry queue's growing TTL): `base * factor ** (attempt - 1)`
seconds, capped, with part of it randomised so that many messages failing together do
not all come back at the same moment.
"""

from __future__ import annotations

import math
import numbers
import random
import time

from . import errors
from ._segment import check_seconds

__all__ = ["backoff", "check_delay", "check_ttl", "due_ns", "nack_delay_ms"]

# The longest a nack can delay its message (the core keeps it in milliseconds, 32 bits):
# about 49.7 days.
NACK_DELAY_MAX = (2**32 - 1) / 1000.0
# The longest delay or ttl of a send: far beyond any use, and its due time still fits
# the core's 64-bit nanoseconds.
SEND_DELAY_MAX = 100 * 365 * 86400.0


def _seconds(what: str, value: object, hint: str) -> float:
    """A finite number of seconds >= 0; the type is checked as every timeout's is."""
    try:
        seconds = check_seconds(what, value)  # UnsupportedType for a non-number
    except errors.InvalidArgument:
        seconds = math.nan  # NaN or negative: said below, with what to pass instead
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0:
        raise errors.InvalidDelay(
            f"{what} must be a finite number of seconds >= 0, got {value!r:.40}: {hint}"
        )
    return seconds


def check_delay(what: str, value: object, limit: float = SEND_DELAY_MAX) -> float:
    """A `delay=` in seconds: None and 0 mean none (0.0 is returned)."""
    if value is None:
        return 0.0
    seconds = _seconds(what, value, "pass None (or 0) for no delay")
    if seconds > limit:
        raise errors.InvalidDelay(
            f"{what} of {seconds:g} s is longer than the {limit:g} s a channel keeps a delay"
        )
    return seconds


def check_ttl(what: str, value: object) -> float:
    """A `ttl=` in seconds: None means none (0.0 is returned); it must be > 0."""
    if value is None:
        return 0.0
    seconds = _seconds(what, value, "pass None for a message that never expires")
    if seconds == 0:
        raise errors.InvalidDelay(
            f"{what} must be > 0 seconds: a message with ttl=0 could never be handed out "
            "(pass None for a message that never expires)"
        )
    if seconds > SEND_DELAY_MAX:
        raise errors.InvalidDelay(f"{what} of {seconds:g} s is too long: pass None for no ttl")
    return seconds


def due_ns(seconds: float, now_ns: int | None = None) -> int:
    """The CLOCK_REALTIME nanoseconds `seconds` from now (0: none, for seconds == 0)."""
    if seconds <= 0:
        return 0
    now = time.time_ns() if now_ns is None else now_ns
    return now + max(1, int(seconds * 1e9))


def nack_delay_ms(value: object) -> int:
    """A nack's `delay=` as the core keeps it: whole milliseconds, rounded up."""
    seconds = check_delay("nack: delay", value, NACK_DELAY_MAX)
    return min(2**32 - 1, math.ceil(seconds * 1000.0))


def backoff(
    attempt: int,
    *,
    base: float = 0.1,
    factor: float = 2.0,
    cap: float = 60.0,
    jitter: float = 0.5,
) -> float:
    """Seconds to wait before retry number `attempt` (1 = after the first delivery
    failed; a handle's `attempt`): `min(cap, base * factor ** (attempt - 1))`, of which
    the last `jitter` fraction (0 to 1) is random: with the defaults 0.05-0.1 s after the
    first failure, 0.1-0.2 s after the second, doubling up to 30-60 s.

    >>> backoff(1, jitter=0)
    0.1
    >>> backoff(20, jitter=0)
    60.0
    """
    if isinstance(attempt, bool) or not isinstance(attempt, numbers.Integral) or attempt < 1:
        raise errors.InvalidArgument(f"backoff: attempt must be an int >= 1, got {attempt!r}")
    base = _seconds("backoff: base", base, "pass a number of seconds >= 0")
    cap = _seconds("backoff: cap", cap, "pass a number of seconds >= 0")
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not factor >= 1:
        raise errors.InvalidArgument(f"backoff: factor must be a number >= 1, got {factor!r}")
    if isinstance(jitter, bool) or not isinstance(jitter, numbers.Real) or not 0 <= jitter <= 1:
        raise errors.InvalidArgument(f"backoff: jitter must be between 0 and 1, got {jitter!r}")
    try:
        delay = min(cap, base * float(factor) ** (int(attempt) - 1))
    except OverflowError:
        delay = cap
    if jitter:
        delay -= delay * float(jitter) * random.random()
    return delay
