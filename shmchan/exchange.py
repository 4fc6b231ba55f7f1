"""Exchange: one publish routed to every bound channel, all or nothing.

An exchange is a small shared segment of its own (csrc/exchange.c) holding its kind, its
bindings (channel name, pattern) and the commit words of publishes in progress. Channels
are ordinary shmchan channels, created by their consumers; an exchange only sends to them.

    ex = shmchan.Exchange.create("events", kind="topic")
    ex.bind("audit", "orders.#")
    ex.bind("billing", "orders.*.paid")
    ex.publish({"id": 7}, routing_key="orders.eu.paid", keys=("acct:1",))
    # -> {"audit": 12, "billing": 40}: the seq the copy got in each channel

Routing, by kind:

* ``fanout``: every bound channel gets every message; patterns are ignored.
* ``direct``: the channels whose pattern equals the routing key.
* ``topic``: AMQP topic rules. A routing key is words of ``[0-9A-Za-z_]`` separated by
  ``.`` (or empty: no words). In a pattern ``*`` matches exactly one word and ``#`` zero
  or more; a wildcard is a whole word, and ``#`` is never next to ``#`` or ``*``.

A channel gets one copy per publish however many of its bindings match.

A bound channel that does not exist at the moment (its consumer removed it and has not
created it again yet) gets no copy: like a queue deleted in AMQP, it is skipped, and the
publish goes to the bound channels that exist. It is never skipped silently: the result's
``missing`` names it, and ``publish(..., mandatory=True)`` refuses instead (Unroutable,
published nowhere), as AMQP's mandatory flag returns a message no queue took. A channel
created again under its name gets the next publish of every process.

Publishing to
two or more channels is one transaction (see csrc/exchange.c): each copy is written as a
gated record, then one atomic store commits them all. A publisher killed at any
instruction leaves a copy in every matched channel or in none; receivers settle the
records of a dead publisher from the commit word (``resolve_gate``, called by the
channel's receiver when it stalls on such a record).

Removing an exchange (``unlink_exchange``) refuses its publishes from then on, in every
process (ExchangeRemoved, a ChannelRemoved: open it again by name). While a committed
publish still has a copy to settle, its segment is kept under a retired name (made of its
uid and name, never listed) where receivers find the outcome; the last settlement removes
it. So a publish stays all or nothing across the removal and re-creation of its exchange.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import _shmchan_hot as _hot  # Exchange.publish's fast path (csrc/hot/publish.c)
import posix_ipc

from . import codec, errors, liveness
from ._lib import ffi, lib, raise_for
from ._segment import (
    RX,
    SHM_DIR,
    Attachment,
    Segment,
    SpaceWait,
    address,
    check_name,
    deadline_of,
    list_names,
    remaining,
)
from .sender import Sender

__all__ = [
    "Exchange",
    "ExchangeStats",
    "BindingStats",
    "Binding",
    "ExchangeNotFound",
    "ExchangeExists",
    "ExchangeRemoved",
    "Unroutable",
    "Published",
    "unlink_exchange",
    "list_exchanges",
    "check_pattern",
    "topic_matches",
]

_PREFIX = "shmchan-x."  # /dev/shm/shmchan-x.NAME (channels are shmchan.NAME)
_RETIRED = "shmchan-x~"  # /dev/shm/shmchan-x~UID.NAME: a removed exchange kept for receivers
_FANOUT, _DIRECT, _TOPIC = (
    int(lib.EXCH_KIND_FANOUT),
    int(lib.EXCH_KIND_DIRECT),
    int(lib.EXCH_KIND_TOPIC),
)
_KINDS = {"fanout": _FANOUT, "direct": _DIRECT, "topic": _TOPIC}
_OK, _FULL, _STALLED, _BUSY, _REMOVED = (
    int(lib.SHM_OK),
    int(lib.SHM_FULL),
    int(lib.SHM_STALLED),
    int(lib.SHM_BUSY),
    int(lib.SHM_REMOVED),
)
_MAX_COPIES = int(lib.EXCH_MAX_BINDINGS)
_TARGETS_CACHED = 4096  # routing keys whose targets a process remembers (per bindings version)
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
_MAX_KEY_BYTES = 255  # routing keys and patterns, as in AMQP
_WORD = re.compile(r"[0-9A-Za-z_]+")
_WRITER_WAIT = 5.0  # longest a bind waits for a live process changing the bindings


class ExchangeNotFound(errors.ChannelNotFound):
    """No exchange of that name exists."""


class ExchangeExists(errors.ChannelExists):
    """An exchange of that name already exists."""


class ExchangeRemoved(errors.ChannelRemoved):
    """The exchange was removed (unlinked): it publishes no more. Open the exchange of
    that name again (Exchange.open) to publish through whatever has the name now."""


class Unroutable(errors.Error):
    """publish(mandatory=True) matched no existing channel, or a bound channel it matched
    does not exist: published nowhere."""


class Published(dict[str, int]):
    """What publish() returns: {channel name: the seq its copy got}, and in `missing` the
    channels a binding matched that did not exist (no copy was made for them)."""

    __slots__ = ("missing",)

    def __init__(self, seqs: Iterable[tuple[str, int]] = (), missing: Iterable[str] = ()) -> None:
        super().__init__(seqs)
        self.missing: tuple[str, ...] = tuple(missing)

    def __repr__(self) -> str:
        return f"Published({dict(self)!r}, missing={self.missing!r})"


class Binding(NamedTuple):
    channel: str
    pattern: str


@dataclass(frozen=True)
class BindingStats:
    channel: str
    pattern: str
    routed: int
    """Publishes this binding matched (a channel matched twice still gets one copy)."""


@dataclass(frozen=True)
class ExchangeStats:
    """A snapshot of an exchange's counters (shared by every process)."""

    name: str
    kind: str
    published: int
    """Publishes that went through (matched or not)."""
    routed: int
    """Copies written into channels."""
    unroutable: int
    """Publishes that matched no binding (returned {})."""
    bindings: tuple[BindingStats, ...] = field(default_factory=tuple)
    """Per binding: how many publishes it matched."""
    txns_busy: int = 0
    """Transaction slots held right now (publishes in progress, or left by a crash)."""


# ---------------------------------------------------------------------------------------
# routing rules
# ---------------------------------------------------------------------------------------


def _check_key_length(what: str, text: str) -> None:
    if len(text.encode()) > _MAX_KEY_BYTES:
        raise errors.InvalidArgument(f"{what} {text!r} is longer than {_MAX_KEY_BYTES} bytes")


def check_pattern(pattern: str) -> str:
    """Check a topic binding pattern; InvalidArgument (a ValueError) naming the rule it breaks."""
    if not isinstance(pattern, str):
        raise errors.UnsupportedType(f"pattern must be a str, not {type(pattern).__name__}")
    _check_key_length("pattern", pattern)
    if pattern == "":
        return pattern
    words = pattern.split(".")
    for i, w in enumerate(words):
        if w == "#":
            near = words[max(i - 1, 0) : i] + words[i + 1 : i + 2]
            if "#" in near or "*" in near:
                raise errors.InvalidArgument(
                    f"invalid topic pattern {pattern!r}: '#' may not be next to another "
                    f"'#' or a '*' ({'.'.join(words[max(i - 1, 0) : i + 2])!r})"
                )
            continue
        if w == "*":
            continue
        if w == "":
            raise errors.InvalidArgument(
                f"invalid topic pattern {pattern!r}: empty word (words are separated by "
                "single dots, with none at either end)"
            )
        if "*" in w or "#" in w:
            raise errors.InvalidArgument(
                f"invalid topic pattern {pattern!r}: a wildcard must be a whole word; "
                f"{w!r} mixes '*' or '#' with other characters"
            )
        if not _WORD.fullmatch(w):
            bad = sorted({ch for ch in w if not (ch.isascii() and (ch.isalnum() or ch == "_"))})
            raise errors.InvalidArgument(
                f"invalid topic pattern {pattern!r}: characters {''.join(bad)!r} are not "
                "allowed (words are made of 0-9 A-Z a-z _; wildcards are '*' and '#')"
            )
    return pattern


def _check_routing_key(key: str, kind: int) -> list[str]:
    if not isinstance(key, str):
        raise errors.UnsupportedType(f"routing_key must be a str, not {type(key).__name__}")
    _check_key_length("routing key", key)
    if kind != _TOPIC or key == "":
        return [] if key == "" else [key]
    words = key.split(".")
    for w in words:
        if not _WORD.fullmatch(w):
            raise errors.InvalidArgument(
                f"invalid topic routing key {key!r}: words are made of 0-9 A-Z a-z _ and "
                f"separated by single dots ({w!r} is not a word)"
            )
    return words


class _Node:
    """A node of the topic trie: one pattern word per edge."""

    __slots__ = ("lit", "star", "hash", "is_hash", "ends")

    def __init__(self, is_hash: bool = False) -> None:
        self.lit: dict[str, _Node] = {}
        self.star: _Node | None = None
        self.hash: _Node | None = None
        self.is_hash = is_hash
        self.ends: list[int] = []  # bindings (positions in the router's list) ending here


class _Router:
    """Bindings compiled for one version of the table: routing key -> binding positions."""

    def __init__(self, kind: int, bindings: list[tuple[int, str, str]]) -> None:
        self.kind = kind
        self.bindings = bindings  # (table index, channel, pattern)
        self.direct: dict[str, list[int]] = {}
        self.root = _Node()
        self.targets: dict[str, _Target] = {}  # routing key -> where it goes (Exchange)
        self.version = -1  # the bindings' version it was compiled under (set by Exchange)
        for b, (_, _, pattern) in enumerate(bindings):
            if kind == _DIRECT:
                self.direct.setdefault(pattern, []).append(b)
            elif kind == _TOPIC:
                self._add(pattern, b)

    def _add(self, pattern: str, b: int) -> None:
        node = self.root
        for w in pattern.split(".") if pattern else []:
            if w == "*":
                node.star = node.star or _Node()
                node = node.star
            elif w == "#":
                node.hash = node.hash or _Node(is_hash=True)
                node = node.hash
            else:
                node = node.lit.setdefault(w, _Node())
        node.ends.append(b)

    def match(self, words: list[str], key: str) -> list[int]:
        """Positions of the bindings that match; each (node, word) pair is visited once,
        so the cost is O(len(words) x trie nodes that can match)."""
        if self.kind == _FANOUT:
            return list(range(len(self.bindings)))
        if self.kind == _DIRECT:
            return self.direct.get(key, [])
        n = len(words)
        out: list[int] = []
        seen: set[tuple[int, int]] = set()
        stack = [(self.root, 0)]
        while stack:
            node, i = stack.pop()
            mark = (id(node), i)
            if mark in seen:
                continue
            seen.add(mark)
            if node.hash is not None:
                stack.append((node.hash, i))  # '#' matching zero words
            if i == n:
                out.extend(node.ends)
                continue
            if node.is_hash:
                stack.append((node, i + 1))  # '#' taking one more word
            nxt = node.lit.get(words[i])
            if nxt is not None:
                stack.append((nxt, i + 1))
            if node.star is not None:
                stack.append((node.star, i + 1))
        return out


def topic_matches(pattern: str, routing_key: str) -> bool:
    """Does topic `pattern` match `routing_key`? (Both are checked first.)"""
    check_pattern(pattern)
    words = _check_routing_key(routing_key, _TOPIC)
    return bool(_Router(_TOPIC, [(0, "", pattern)]).match(words, routing_key))


# ---------------------------------------------------------------------------------------
# the attachment
# ---------------------------------------------------------------------------------------


def _check_name(name: str) -> str:
    try:
        return check_name(name)
    except ValueError as e:
        raise errors.InvalidArgument(str(e).replace("channel name", "exchange name")) from None


def _shm_name(name: str) -> str:
    return "/" + _PREFIX + name


def _retired_name(name: str, uid: int) -> str:
    return f"/{_RETIRED}{uid:016x}.{name}"


class _Attachment:
    """One process's mapping of an exchange segment."""

    def __init__(self, name: str, ptr: Any) -> None:
        self.name = name
        self.ptr = ffi.gc(ptr, lib.exch_detach)
        info = ffi.new("shm_exch_info *")
        lib.exch_info(self.ptr, info)
        self.kind = int(info.kind)
        self.uid = int(info.uid)
        self.pid = os.getpid()
        _attachments.add(self)

    def after_fork(self) -> None:
        lib.exch_set_identity(self.ptr, liveness.current_token())
        self.pid = os.getpid()


_attachments: weakref.WeakSet[_Attachment] = weakref.WeakSet()
_exchanges: weakref.WeakSet[Exchange] = weakref.WeakSet()
_forks = 0  # forks this process descends from: a _Target registered under another is stale


def _reset_after_fork() -> None:
    # The channel module's hook resets each channel segment's identity and its producer
    # registration (a child is a new producer); the exchange's own state must follow:
    # its token, the targets' note that their channels were registered, and the locks,
    # which a thread of the parent that no longer exists here may have held.
    global _forks
    _forks += 1
    for a in list(_attachments):
        a.after_fork()
    for ex in list(_exchanges):
        ex._lock = threading.Lock()
        ex._fast_reset()


os.register_at_fork(after_in_child=_reset_after_fork)


def _attach(
    name: str,
    create: bool,
    kind: int = 0,
    mode: int = 0o600,
    shm_name: str | None = None,
    wait: float = 5.0,
) -> _Attachment:
    """Map exchange `name` (found under `shm_name`, if given); waits up to `wait`
    seconds for a creation in progress."""
    size = int(lib.exch_segment_size())
    deadline = time.monotonic() + wait
    shm_name = shm_name or _shm_name(name)
    while True:
        try:
            if create:
                shm = posix_ipc.SharedMemory(shm_name, posix_ipc.O_CREX, mode=mode, size=size)
            else:
                shm = posix_ipc.SharedMemory(shm_name)
        except posix_ipc.ExistentialError:
            if create:
                raise ExchangeExists(
                    f"exchange {name!r} already exists: attach to it with "
                    f"Exchange.open({name!r}), or remove it first with "
                    f"`shmchan rm --exchange {name}` (or shmchan.unlink_exchange({name!r}))"
                ) from None
            raise ExchangeNotFound(f"no exchange named {name!r}") from None
        out = ffi.new("shm_exch **")
        enc = name.encode()
        uid = secrets.randbits(64) | 1
        try:
            rc = lib.exch_attach(
                shm.fd, int(create), kind, enc, len(enc), uid, liveness.current_token(), out
            )
        finally:
            shm.close_fd()
        if rc and create:
            posix_ipc.unlink_shared_memory(shm_name)
        if rc == lib.SHM_EMPTY and time.monotonic() < deadline:
            time.sleep(0.001)  # its creator is still initializing it
            continue
        if rc == lib.SHM_EMPTY:
            raise errors.LayoutMismatch(f"exchange {name!r} was never initialized by its creator")
        if rc:
            raise_for(rc, f"open exchange {name!r}")
        return _Attachment(name, out[0])


def unlink_exchange(name: str) -> None:
    """Remove an exchange. ExchangeNotFound (a ChannelNotFound) if there is none.

    From then on its publishes are refused in every process (ExchangeRemoved); the name
    is free for a new exchange at once, and the channels are not touched. A publish that
    committed before keeps its outcome: while one of its copies is still to be settled
    by a receiver, the segment is kept under a retired name (never listed), removed by
    the last settlement."""
    _check_name(name)
    file = os.path.join(SHM_DIR, _PREFIX + name)
    try:
        ino = os.stat(file).st_ino
        att = _attach(name, False, wait=0.0)
    except (FileNotFoundError, ExchangeNotFound):
        raise ExchangeNotFound(f"no exchange named {name!r}") from None
    except (errors.Error, OSError):
        _remove_name(name)  # not an exchange of this layout (or not finished): just the name
        return
    lib.exch_retire(att.ptr)  # no publish commits from here on
    try:
        if os.stat(file).st_ino != ino:
            return  # removed (and the name taken again) by someone else meanwhile
    except FileNotFoundError:
        return
    if _committed(att) == 0:
        _remove_name(name)
        return
    # A committed publish has copies to settle: receivers will look for the outcome.
    retired = _retired_name(name, att.uid)
    try:
        os.rename(file, os.path.join(SHM_DIR, retired[1:]))
    except FileNotFoundError:
        return
    _drop_retired(att)  # in case the last settlement happened just before the rename


def _remove_name(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(_shm_name(name))
    except posix_ipc.ExistentialError:
        raise ExchangeNotFound(f"no exchange named {name!r}") from None


def _committed(att: _Attachment) -> int:
    """Committed publishes with copies left to settle: receivers need their outcome."""
    info = ffi.new("shm_exch_info *")
    lib.exch_info(att.ptr, info)
    return int(info.txns_committed)


def _reap(att: _Attachment) -> int:
    """Free transaction slots held by dead publishers; returns how many were found."""
    owner = ffi.new("uint64_t *")
    found = 0
    for i in range(int(lib.EXCH_MAX_TXNS)):
        lib.exch_txn_owner(att.ptr, i, owner)
        token = int(owner[0])
        if token and not liveness.is_alive(token):
            if lib.exch_txn_reap(att.ptr, i, token) == lib.SHM_OK:
                found += 1
    return found


def _drop_retired(att: _Attachment) -> None:
    """A removed exchange's retired name, once no committed publish has a copy left to
    settle: nobody needs it now."""
    if _committed(att):
        return
    try:
        posix_ipc.unlink_shared_memory(_retired_name(att.name, att.uid))
    except posix_ipc.ExistentialError:
        pass  # removed without retiring, or by another settler


def segment_path(name: str) -> str:
    """The file an exchange lives in (its /dev/shm segment)."""
    _check_name(name)
    return os.path.realpath(os.path.join(SHM_DIR, _PREFIX + name))


def list_exchanges() -> list[str]:
    """Names of the exchanges in /dev/shm."""
    return list_names(_PREFIX)


# ---------------------------------------------------------------------------------------
# Exchange
# ---------------------------------------------------------------------------------------


class _Target:
    """Where one routing key goes under one version of the bindings: the channels (by
    name, sorted: exch_publish writes them in this order) and the bindings that matched."""

    __slots__ = ("senders", "names", "segs", "chans", "idx", "nidx", "bindings", "raw_only",
                 "max_keys", "registered", "missing")  # fmt: skip

    def __init__(self, senders: list[Sender], bindings: list[int], missing: list[str]) -> None:
        self.senders = senders
        self.missing = missing  # matched channels that did not exist: looked for on each use
        self.segs: list[Segment] = [tx._live() for tx in senders]
        self.names = [seg.name for seg in self.segs]
        self.chans = ffi.new("shm_chan *[]", [seg.ptr for seg in self.segs] or 1)
        self.idx = ffi.new("uint32_t[]", bindings or 1)
        self.nidx = len(bindings)
        self.bindings = bindings
        self.raw_only = any(seg.raw_only for seg in self.segs)
        self.max_keys = min((seg.max_keys for seg in self.segs), default=0)
        self.registered = -1  # the value of _forks when every segment was registered


class _Scratch:
    """Per-thread out-parameters of exch_publish, allocated once."""

    def __init__(self) -> None:
        self.seqs = ffi.new("uint64_t[]", _MAX_COPIES)
        self.wakes = ffi.new("int[]", _MAX_COPIES)
        self.failed = ffi.new("uint32_t *")
        self.stall = ffi.new("shm_stall *")


_local = threading.local()

# publish()'s C fast path calls the core through the functions of the cffi module loaded
# here (whichever build it is) and returns a Published.
_hot.bind_exchange(
    address(ffi.addressof(lib, "exch_publish")),
    address(ffi.addressof(lib, "exch_version")),
    address(ffi.addressof(lib, "exch_removed")),
    address(ffi.addressof(lib, "exch_note")),
    Published,
)


class Exchange(_hot.PublisherBase):
    """Routes each publish to the channels bound to it: every matched channel or none.

    Use `Exchange.create(name, kind=...)` or `Exchange.open(name)`; any number of
    processes may open the same exchange, bind, unbind and publish.

    `publish` is implemented in C (csrc/hot/publish.c) for a routing key whose route
    this process already worked out (none of its channels missing), a bytes payload and
    plain keys: one call into the core. Everything else goes to
    `_publish_slow`, which also hands each route it works out to the C side."""

    def __init__(self, att: _Attachment) -> None:
        self._att: _Attachment | None = att
        self.name = att.name
        self.kind = _KIND_NAMES[att.kind]
        self._router: _Router | None = None
        self._version = -1
        self._sender_cache: dict[str, Sender] = {}  # refreshed with the bindings
        self._lock = threading.Lock()
        self._fast_reset()
        _exchanges.add(self)

    @classmethod
    def create(cls, name: str, kind: str = "fanout", mode: int = 0o600) -> Exchange:
        """Make a new exchange (ExchangeExists, a ChannelExists, if the name is taken)."""
        _check_name(name)
        if kind not in _KINDS:
            raise errors.InvalidArgument(
                f"unknown exchange kind {kind!r}: use 'fanout', 'direct' or 'topic'"
            )
        if not isinstance(mode, int) or not 0 <= mode <= 0o777:
            raise errors.InvalidArgument(
                f"mode must be permission bits such as 0o600, not {mode!r}"
            )
        return cls(_attach(name, True, _KINDS[kind], mode))

    @classmethod
    def open(cls, name: str) -> Exchange:
        """Attach to an existing exchange (ExchangeNotFound, a ChannelNotFound, if none)."""
        _check_name(name)
        return cls(_attach(name, False))

    def __repr__(self) -> str:
        state = "closed" if self._att is None else self.kind
        return f"<shmchan.Exchange {self.name!r} {state}>"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Exchange.open, (self.name,))

    def _live(self) -> _Attachment:
        att = self._att
        if att is None:
            raise errors.Closed(f"exchange {self.name!r} is closed")
        return att

    def close(self) -> None:
        """Detach this process (idempotent). The exchange and its bindings stay."""
        self._att = None
        self._router = None
        self._sender_cache = {}
        self._fast_clear()

    if TYPE_CHECKING:  # implemented in C (csrc/hot/publish.c): its signature for callers

        def publish(
            self,
            payload: object,
            routing_key: str = "",
            keys: Any = (),
            timeout: float | None = None,
            *,
            mandatory: bool = False,
        ) -> Published:
            """Send `payload` with `keys` to every channel whose binding matches
            `routing_key`, all or nothing. Returns a Published: {channel name: the seq its
            copy got}, empty if nothing matched, and in `.missing` the matched channels
            that do not exist (removed, not yet created again): they got no copy. With
            `mandatory=True` that is refused instead: Unroutable if nothing matched or a
            matched channel is missing, and no channel gets the message. Full (after
            `timeout`) if some matched channel stayed full: then no channel got it."""
            ...

    def _fast_reset(self) -> None:
        """Point publish()'s C fast path at this process's attachment, with no route."""
        att = self._att
        if att is None:
            self._fast_clear()
        else:
            self._fast_attach(address(att.ptr), att)

    def unlink(self) -> None:
        """Remove the exchange's name (see unlink_exchange)."""
        unlink_exchange(self.name)

    def __enter__(self) -> Exchange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- bindings -----------------------------------------------------------------------

    def _pattern(self, pattern: str) -> str:
        if not isinstance(pattern, str):
            raise errors.UnsupportedType(f"pattern must be a str, not {type(pattern).__name__}")
        if self.kind == "fanout":
            return ""
        if self.kind == "topic":
            return check_pattern(pattern)
        _check_key_length("pattern", pattern)
        return pattern

    def _change(self, fn: Any, channel_name: str, pattern: str) -> int:
        att = self._live()
        chan = channel_name.encode()
        pat = pattern.encode()
        holder = ffi.new("uint64_t *")
        deadline = time.monotonic() + _WRITER_WAIT
        while True:
            rc = int(fn(att.ptr, chan, len(chan), pat, len(pat), holder))
            if rc != lib.SHM_BUSY:
                return rc
            token = int(holder[0])
            if not liveness.is_alive(token):
                lib.exch_writer_reap(att.ptr, token)  # it died changing the bindings
                continue
            if time.monotonic() > deadline:
                raise errors.Error(
                    f"exchange {self.name!r}: process {liveness.token_pid(token)} has been "
                    f"changing its bindings for {_WRITER_WAIT} s"
                )
            time.sleep(0.0005)

    def bind(self, channel_name: str | Attachment, pattern: str = "") -> None:
        """Route matching publishes to channel `channel_name` (a name, or a Channel),
        which must exist: ChannelNotFound otherwise. Binding twice is a no-op. Seen by
        every process's next publish.

        An exchange finds its channels by name in /dev/shm: a durable channel (created
        with path=) cannot be bound (InvalidArgument)."""
        if isinstance(channel_name, Attachment):  # a Channel
            if channel_name.path is not None:
                raise errors.InvalidArgument(
                    f"channel {channel_name.name!r} is durable (its file is "
                    f"{channel_name.path!r}): an exchange routes to channels by name in "
                    "/dev/shm only; bind a channel created without path="
                )
            channel_name = channel_name.name
        check_name(channel_name)
        pattern = self._pattern(pattern)
        try:
            Sender.open(channel_name)
        except errors.ChannelNotFound:
            raise errors.ChannelNotFound(
                f"no channel named {channel_name!r} in /dev/shm (an exchange routes to "
                "channels by name; a durable channel, created with path=, cannot be bound)"
            ) from None
        rc = self._change(lib.exch_bind, channel_name, pattern)
        if rc == lib.SHM_FULL:
            raise errors.Error(
                f"exchange {self.name!r} already has {lib.EXCH_MAX_BINDINGS} bindings"
            )
        if rc not in (lib.SHM_OK, lib.SHM_STALE):
            raise_for(rc, "bind")

    def unbind(self, channel_name: str, pattern: str = "") -> bool:
        """Remove a binding; returns False if there was no such binding."""
        check_name(channel_name)
        pattern = self._pattern(pattern)
        rc = self._change(lib.exch_unbind, channel_name, pattern)
        if rc not in (lib.SHM_OK, lib.SHM_STALE):
            raise_for(rc, "unbind")
        return bool(rc == lib.SHM_OK)

    def _read_bindings(self, att: _Attachment) -> tuple[int, list[tuple[int, str, str, int]]]:
        n_max = int(lib.EXCH_MAX_BINDINGS)
        out = ffi.new("shm_binding[]", n_max)
        n = ffi.new("uint32_t *")
        version = ffi.new("uint64_t *")
        lib.exch_bindings(att.ptr, out, n_max, n, version)
        rows = []
        for i in range(n[0]):
            b = out[i]
            chan = bytes(ffi.buffer(b.chan, b.chan_len)).decode(errors="replace")
            pat = bytes(ffi.buffer(b.pat, b.pat_len)).decode(errors="replace")
            rows.append((int(b.index), chan, pat, int(b.count)))
        return int(version[0]), rows

    def bindings(self) -> list[Binding]:
        """The current bindings, as (channel, pattern) pairs."""
        _, rows = self._read_bindings(self._live())
        return [Binding(chan, pat) for _, chan, pat, _ in rows]

    def _route(self, att: _Attachment) -> _Router:
        """The compiled bindings, re-read when another process changed them."""
        version = int(lib.exch_version(att.ptr))
        router = self._router
        if router is None or version != self._version:
            with self._lock:
                version, rows = self._read_bindings(att)
                router = _Router(att.kind, [(i, chan, pat) for i, chan, pat, _ in rows])
                router.version = version
                self._router, self._version = router, version
                self._sender_cache = {}
        return router

    # -- publishing ---------------------------------------------------------------------

    def _publish_slow(
        self,
        payload: object,
        routing_key: str = "",
        keys: Any = (),
        timeout: float | None = None,
        mandatory: bool = False,
    ) -> Published:
        """publish() for whatever its C fast path leaves to Python.

        Send `payload` with `keys` to every channel whose binding matches `routing_key`,
        all or nothing. Returns a Published: {channel name: the seq its copy got}, empty
        if nothing matched, and in `.missing` the matched channels that do not exist
        (removed, not yet created again): they got no copy. With `mandatory=True` that is
        refused instead: Unroutable if nothing matched or a matched channel is missing,
        and no channel gets the message. Full (after `timeout`) if some matched channel
        stayed full: then no channel got it."""
        att = self._live()
        if lib.exch_removed(att.ptr):
            raise ExchangeRemoved(
                f"exchange {self.name!r} was removed: open it again by name to publish"
            )
        deadline = deadline_of(timeout)
        retries = 0
        while True:
            router = self._route(att)
            target = router.targets.get(routing_key) if type(routing_key) is str else None
            if target is not None and target.missing and _any_exists(target.missing):
                router.targets.clear()  # a missing channel was created again: route anew
                target = None
            if target is None:
                target = self._target(att, router, routing_key)
            if mandatory and (target.missing or not target.senders):
                raise Unroutable(
                    f"exchange {self.name!r}: "
                    + (
                        f"bound channel(s) {', '.join(map(repr, target.missing))} do not exist"
                        if target.missing
                        else f"routing key {routing_key!r} matches no binding"
                    )
                    + "; published nowhere"
                )
            try:
                seqs = self._copies(att, target, payload, keys, timeout, deadline)
                break
            except ExchangeRemoved:
                raise
            except errors.ChannelRemoved:
                # A bound channel was removed (published nowhere): look the names up again
                router.targets.clear()
                self._sender_cache.clear()
                retries += 1
                if retries == 3:
                    raise
        lib.exch_note(att.ptr, target.idx, target.nidx, len(seqs))
        if type(routing_key) is str:  # the C fast path takes it from here (or forgets it)
            fast = bool(target.senders) and not target.missing
            self._fast_route(
                routing_key,
                router.version,  # (another thread may have compiled a newer one meanwhile)
                target.segs if fast else [],
                target.names if fast else [],
                target.bindings if fast else [],
            )
        return Published(zip(target.names, seqs, strict=True), target.missing)

    def _published_removed(self) -> None:
        """The C fast path's publish went through, but the exchange was removed while
        it settled its copies: it may have held the last committed slot."""
        att = self._att
        if att is not None:
            _drop_retired(att)

    def _copies(
        self,
        att: _Attachment,
        target: _Target,
        payload: object,
        keys: Any,
        timeout: float | None,
        deadline: float | None,
    ) -> list[int]:
        senders = target.senders
        if not senders:
            return []
        if len(senders) == 1:  # one copy is all-or-nothing by itself
            return [senders[0].send(payload, keys=keys, timeout=timeout)]
        return self._publish_all(att, target, payload, keys, deadline)

    def _target(self, att: _Attachment, router: _Router, routing_key: str) -> _Target:
        """Where `routing_key` goes under `router` (checked, matched, remembered)."""
        words = _check_routing_key(routing_key, att.kind)
        matched = router.match(words, routing_key)
        missing: list[str] = []
        senders = self._senders(sorted({router.bindings[b][1] for b in matched}), missing)
        target = _Target(senders, [router.bindings[b][0] for b in matched], missing)
        if len(router.targets) >= _TARGETS_CACHED:
            router.targets.clear()
        router.targets[routing_key] = target
        return target

    def _senders(self, names: list[str], missing: list[str]) -> list[Sender]:
        """Senders of the channels called `names` that exist; the others are appended to
        `missing` (the publish reports them, and looks for them again next time)."""
        out = []
        cache = self._sender_cache
        for name in names:
            tx = cache.get(name)
            if tx is None:
                try:
                    tx = cache[name] = Sender.open(name)
                except errors.ChannelNotFound:
                    missing.append(name)
                    continue
            out.append(tx)
        return out

    def publish_many(
        self,
        items: Iterable[tuple[Any, ...]],
        timeout: float | None = None,
        *,
        mandatory: bool = False,
    ) -> list[Published]:
        """publish() for each (payload, routing_key) or (payload, routing_key, keys), in
        order; each one is all or nothing on its own. `timeout` bounds each publish;
        `mandatory` applies to each."""
        out = []
        for item in items:
            if not isinstance(item, tuple) or not 1 <= len(item) <= 3:
                raise errors.UnsupportedType(
                    "publish_many takes (payload, routing_key[, keys]) tuples"
                )
            payload = item[0]
            routing_key = item[1] if len(item) > 1 else ""
            keys = item[2] if len(item) > 2 else ()
            out.append(self.publish(payload, routing_key, keys, timeout, mandatory=mandatory))
        return out

    def _publish_all(
        self,
        att: _Attachment,
        target: _Target,
        payload: object,
        keys: Any,
        deadline: float | None,
    ) -> list[int]:
        segs = target.segs
        kind, buf = codec.encode_payload(payload, target.raw_only)
        blob, nkeys = codec.encode_keys(keys, target.max_keys)
        if target.registered != _forks:  # first use, or first in a forked child
            for seg in segs:
                if not seg.registered:
                    seg.register_producer()
            target.registered = _forks
        n = len(segs)
        data = buf if type(buf) is bytes else ffi.from_buffer("char[]", buf)
        chans = target.chans
        s = self._scratch()
        seqs, wakes, failed, stall = s.seqs, s.wakes, s.failed, s.stall
        with SpaceWait("publish", deadline, "; published nowhere") as wait:
            while True:
                rc = int(
                    lib.exch_publish(
                        att.ptr, chans, n, kind, data, len(data), blob, len(blob), nkeys,
                        seqs, wakes, failed, stall,
                    )
                )  # fmt: skip
                for i in range(n):
                    if wakes[i]:
                        segs[i].post(RX, 1)
                if rc == _OK:
                    if lib.exch_removed(att.ptr):  # removed while we settled our copies
                        _drop_retired(att)
                    return list(ffi.unpack(seqs, n))
                if rc == _FULL:
                    wait.full(segs[failed[0]])
                elif rc == _STALLED:
                    wait.stalled(segs[failed[0]], stall)
                elif rc == _BUSY:  # every transaction slot is held
                    if not self._reap_txns(att):
                        left = remaining(deadline)
                        if left is not None and left <= 0:
                            raise errors.Full(
                                f"publish: every transaction slot of exchange {self.name!r} "
                                "is held by a live publisher"
                            )
                        time.sleep(0.001)
                elif rc == _REMOVED and failed[0] >= n:
                    _drop_retired(att)  # we may have held the last committed slot
                    raise ExchangeRemoved(
                        f"exchange {self.name!r} was removed: published nowhere; open it "
                        "again by name to publish"
                    )
                else:
                    what = "publish" if failed[0] >= n else f"publish to {segs[failed[0]].name!r}"
                    raise_for(rc, what)

    def _scratch(self) -> Any:
        s = getattr(_local, "s", None)
        if s is None:
            s = _local.s = _Scratch()
        return s

    def _reap_txns(self, att: _Attachment) -> int:
        """Free transaction slots held by dead publishers; returns how many were found."""
        return _reap(att)

    # -- inspection ---------------------------------------------------------------------

    def stats(self) -> ExchangeStats:
        """The exchange's counters: published, routed copies, unroutable, per binding."""
        att = self._live()
        info = ffi.new("shm_exch_info *")
        lib.exch_info(att.ptr, info)
        _, rows = self._read_bindings(att)
        return ExchangeStats(
            name=self.name,
            kind=self.kind,
            published=int(info.published),
            routed=int(info.routed),
            unroutable=int(info.unroutable),
            bindings=tuple(BindingStats(chan, pat, count) for _, chan, pat, count in rows),
            txns_busy=int(info.txns_busy),
        )


def _any_exists(names: list[str]) -> bool:
    """Does a channel of one of these names exist now? (An attempt to open each: a bound
    channel is missing only while its consumer re-creates it.)"""
    for name in names:
        try:
            Sender.open(name)
        except errors.ChannelNotFound:
            continue
        return True
    return False


def ls_lines() -> list[str]:
    """`python -m shmchan ls`'s section on exchanges: each with its counters and bindings,
    then the removed ones kept for their receivers (see unlink_exchange)."""
    lines: list[str] = []
    for name in list_exchanges():
        try:
            ex = Exchange.open(name)
        except (errors.Error, OSError, ValueError) as e:
            lines.append(f"exchange {name}: {e}")
            continue
        try:
            s = ex.stats()
        finally:
            ex.close()
        lines.append(
            f"exchange {name} ({s.kind}): published {s.published}, routed {s.routed}, "
            f"unroutable {s.unroutable}, {len(s.bindings)} binding(s)"
        )
        if s.bindings:
            wc = max(len(b.channel) for b in s.bindings)
            wp = max(len(b.pattern) for b in s.bindings)
            existing = set(list_names())
            for b in s.bindings:
                gone = "" if b.channel in existing else "  (no such channel: gets no copies)"
                lines.append(
                    f"  -> {b.channel:<{wc}}  {b.pattern or '-':<{wp}}  {b.routed} routed{gone}"
                )
    try:
        retired = sorted(e for e in os.listdir(SHM_DIR) if e.startswith(_RETIRED))
    except FileNotFoundError:
        retired = []
    for entry in retired:
        uid, _, name = entry[len(_RETIRED) :].partition(".")
        lines.append(
            f"removed exchange {name} (uid {uid}): kept until its receivers settle the "
            f"copies of committed publishes ({SHM_DIR}/{entry})"
        )
    return lines


# ---------------------------------------------------------------------------------------
# the receiver's side: settling a dead publisher's gated record
# ---------------------------------------------------------------------------------------

_resolvers: dict[tuple[str, int], _Attachment] = {}


def _resolver(name: str, uid: int) -> _Attachment | None:
    """The exchange `name` of identity `uid`: under its name, or, once removed while a
    committed publish had copies to settle, under its retired name (see unlink_exchange).
    None if it is under neither: then no publish of it can commit any more."""
    key = (name, uid)
    att = _resolvers.get(key)
    if att is not None and att.pid == os.getpid():
        return att
    try:
        _check_name(name)
    except ValueError:
        return None
    for shm_name in (_shm_name(name), _retired_name(name, uid)):
        try:
            found = _attach(name, False, shm_name=shm_name)
        except (errors.Error, ValueError):
            continue
        if found.uid == uid:
            _resolvers[key] = found
            return found
    return None


def resolve_gate(seg: Any, pos: int, dead_owner: int) -> bool:
    """The receiver of `seg` is stuck on a gated record at `pos` whose publisher
    `dead_owner` is dead: deliver it if its publish committed, else discard it. Returns
    True if the record was settled. If the exchange is gone (unlinked, re-created), the
    outcome cannot be read: the record is discarded."""
    gate = ffi.new("shm_gate *")
    if lib.shm_gate_read(seg.ptr, pos, dead_owner, gate) != lib.SHM_OK:
        return False
    name = bytes(ffi.buffer(gate.name, gate.name_len)).decode(errors="replace")
    att = _resolver(name, int(gate.uid))
    commit = ffi.new("int *")
    if att is not None:
        if lib.exch_txn_outcome(att.ptr, gate.slot, gate.gen, dead_owner, commit) != lib.SHM_OK:
            return False
    if lib.shm_gate_resolve(seg.ptr, pos, dead_owner, commit[0]) != lib.SHM_OK:
        return False
    if att is not None:
        lib.exch_txn_settled(att.ptr, gate.slot, gate.gen)
        if lib.exch_removed(att.ptr):
            _drop_retired(att)
    return True
