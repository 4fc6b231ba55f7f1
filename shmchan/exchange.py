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

A channel gets one copy per publish however many of its bindings match. Publishing to
two or more channels is one transaction (see csrc/exchange.c): each copy is written as a
gated record, then one atomic store commits them all. A publisher killed at any
instruction leaves a copy in every matched channel or in none; receivers settle the
records of a dead publisher from the commit word (``resolve_gate``, called by the
channel's receiver when it stalls on such a record).
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
from typing import Any, NamedTuple

import posix_ipc

from . import channel as _channel
from . import codec, errors, liveness
from ._lib import ffi, lib, raise_for

__all__ = [
    "Exchange",
    "ExchangeStats",
    "BindingStats",
    "Binding",
    "ExchangeNotFound",
    "ExchangeExists",
    "unlink_exchange",
    "list_exchanges",
    "check_pattern",
    "topic_matches",
]

_PREFIX = "shmchan-x."  # /dev/shm/shmchan-x.NAME (channels are shmchan.NAME)
_FANOUT, _DIRECT, _TOPIC = (
    int(lib.EXCH_KIND_FANOUT),
    int(lib.EXCH_KIND_DIRECT),
    int(lib.EXCH_KIND_TOPIC),
)
_KINDS = {"fanout": _FANOUT, "direct": _DIRECT, "topic": _TOPIC}
_OK, _FULL, _STALLED, _BUSY = (
    int(lib.SHM_OK),
    int(lib.SHM_FULL),
    int(lib.SHM_STALLED),
    int(lib.SHM_BUSY),
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
        return _channel._check_name(name)
    except ValueError as e:
        raise errors.InvalidArgument(str(e).replace("channel name", "exchange name")) from None


def _shm_name(name: str) -> str:
    return "/" + _PREFIX + name


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


os.register_at_fork(after_in_child=_reset_after_fork)


def _attach(name: str, create: bool, kind: int = 0, mode: int = 0o600) -> _Attachment:
    size = int(lib.exch_segment_size())
    deadline = time.monotonic() + 5.0
    while True:
        try:
            if create:
                shm = posix_ipc.SharedMemory(
                    _shm_name(name), posix_ipc.O_CREX, mode=mode, size=size
                )
            else:
                shm = posix_ipc.SharedMemory(_shm_name(name))
        except posix_ipc.ExistentialError:
            if create:
                raise ExchangeExists(f"exchange {name!r} already exists") from None
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
            posix_ipc.unlink_shared_memory(_shm_name(name))
        if rc == lib.SHM_EMPTY and time.monotonic() < deadline:
            time.sleep(0.001)  # its creator is still initializing it
            continue
        if rc == lib.SHM_EMPTY:
            raise errors.LayoutMismatch(f"exchange {name!r} was never initialized by its creator")
        if rc:
            raise_for(rc, f"open exchange {name!r}")
        return _Attachment(name, out[0])


def unlink_exchange(name: str) -> None:
    """Remove an exchange's name. ExchangeNotFound (a ChannelNotFound) if there is none.
    Processes that have it open keep working; the channels are not touched."""
    _check_name(name)
    try:
        posix_ipc.unlink_shared_memory(_shm_name(name))
    except posix_ipc.ExistentialError:
        raise ExchangeNotFound(f"no exchange named {name!r}") from None


def list_exchanges() -> list[str]:
    """Names of the exchanges in /dev/shm."""
    try:
        entries = os.listdir(_channel._SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(e[len(_PREFIX) :] for e in entries if e.startswith(_PREFIX))


# ---------------------------------------------------------------------------------------
# Exchange
# ---------------------------------------------------------------------------------------


class _Target:
    """Where one routing key goes under one version of the bindings: the channels (by
    name, sorted: exch_publish writes them in this order) and the bindings that matched."""

    __slots__ = ("senders", "names", "segs", "chans", "idx", "nidx", "raw_only", "max_keys",
                 "registered")  # fmt: skip

    def __init__(self, senders: list[_channel.Sender], bindings: list[int]) -> None:
        self.senders = senders
        self.segs: list[_channel._Segment] = [tx._live() for tx in senders]
        self.names = [seg.name for seg in self.segs]
        self.chans = ffi.new("shm_chan *[]", [seg.ptr for seg in self.segs] or 1)
        self.idx = ffi.new("uint32_t[]", bindings or 1)
        self.nidx = len(bindings)
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


class Exchange:
    """Routes each publish to the channels bound to it: every matched channel or none.

    Use `Exchange.create(name, kind=...)` or `Exchange.open(name)`; any number of
    processes may open the same exchange, bind, unbind and publish."""

    def __init__(self, att: _Attachment) -> None:
        self._att: _Attachment | None = att
        self.name = att.name
        self.kind = _KIND_NAMES[att.kind]
        self._router: _Router | None = None
        self._version = -1
        self._sender_cache: dict[str, _channel.Sender] = {}  # refreshed with the bindings
        self._lock = threading.Lock()
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

    def bind(self, channel_name: str, pattern: str = "") -> None:
        """Route matching publishes to channel `channel_name` (which must exist:
        ChannelNotFound otherwise). Binding twice is a no-op. Seen by every process's
        next publish."""
        _channel._check_name(channel_name)
        pattern = self._pattern(pattern)
        _channel.Sender.open(channel_name)  # ChannelNotFound if it does not exist
        rc = self._change(lib.exch_bind, channel_name, pattern)
        if rc == lib.SHM_FULL:
            raise errors.Error(
                f"exchange {self.name!r} already has {lib.EXCH_MAX_BINDINGS} bindings"
            )
        if rc not in (lib.SHM_OK, lib.SHM_STALE):
            raise_for(rc, "bind")

    def unbind(self, channel_name: str, pattern: str = "") -> bool:
        """Remove a binding; returns False if there was no such binding."""
        _channel._check_name(channel_name)
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
                self._router, self._version = router, version
                self._sender_cache = {}
        return router

    # -- publishing ---------------------------------------------------------------------

    def publish(
        self,
        payload: object,
        routing_key: str = "",
        keys: Any = (),
        timeout: float | None = None,
    ) -> dict[str, int]:
        """Send `payload` with `keys` to every channel whose binding matches `routing_key`,
        all or nothing. Returns {channel name: the seq its copy got}; {} if nothing
        matched. Full (after `timeout`) if some matched channel stayed full: then no
        channel got it."""
        att = self._live()
        deadline = _channel._deadline(timeout)
        retries = 0
        while True:
            router = self._route(att)
            target = router.targets.get(routing_key) if type(routing_key) is str else None
            if target is None:
                target = self._target(att, router, routing_key)
            try:
                seqs = self._copies(att, target, payload, keys, timeout, deadline)
                break
            except errors.ChannelRemoved:
                # A bound channel was removed (published nowhere): look the names up again
                router.targets.clear()
                self._sender_cache.clear()
                retries += 1
                if retries == 3:
                    raise
        lib.exch_note(att.ptr, target.idx, target.nidx, len(seqs))
        return dict(zip(target.names, seqs, strict=True))

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
        senders = self._senders(sorted({router.bindings[b][1] for b in matched}))
        target = _Target(senders, [router.bindings[b][0] for b in matched])
        if len(router.targets) >= _TARGETS_CACHED:
            router.targets.clear()
        router.targets[routing_key] = target
        return target

    def _senders(self, names: list[str]) -> list[_channel.Sender]:
        """Senders of the channels called `names` that exist (a channel removed since it
        was bound is skipped: as in AMQP, its bindings go with it)."""
        out = []
        cache = self._sender_cache
        for name in names:
            tx = cache.get(name)
            if tx is None:
                try:
                    tx = cache[name] = _channel.Sender.open(name)
                except errors.ChannelNotFound:
                    continue
            out.append(tx)
        return out

    def publish_many(
        self, items: Iterable[tuple[Any, ...]], timeout: float | None = None
    ) -> list[dict[str, int]]:
        """publish() for each (payload, routing_key) or (payload, routing_key, keys), in
        order; each one is all or nothing on its own. `timeout` bounds each publish."""
        out = []
        for item in items:
            if not isinstance(item, tuple) or not 1 <= len(item) <= 3:
                raise errors.UnsupportedType(
                    "publish_many takes (payload, routing_key[, keys]) tuples"
                )
            payload = item[0]
            routing_key = item[1] if len(item) > 1 else ""
            keys = item[2] if len(item) > 2 else ()
            out.append(self.publish(payload, routing_key, keys, timeout))
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
        armed: _channel._Segment | None = None
        stalled_since: float | None = None
        stall_began = 0.0
        nap = _channel._STALL_NAP_SECONDS
        try:
            while True:
                rc = int(
                    lib.exch_publish(
                        att.ptr, chans, n, kind, data, len(data), blob, len(blob), nkeys,
                        seqs, wakes, failed, stall,
                    )
                )  # fmt: skip
                for i in range(n):
                    if wakes[i]:
                        segs[i].post(_channel._RX, 1)
                if rc == _OK:
                    return list(ffi.unpack(seqs, n))
                left = _channel._remaining(deadline)
                if rc == _FULL:
                    stalled_since = None  # a stall after this one starts its own count
                    full = segs[failed[0]]
                    if armed is None or armed.name != full.name:
                        if armed is not None:
                            _disarm(armed)
                        lib.shm_space_wait(full.ptr, 1, full.scratch().pass_on)
                        armed = full
                        full.post(_channel._RX, 1)  # an idle receiver may compact
                        continue  # re-check after announcing ourselves
                    if left is not None and left <= 0:
                        raise errors.Full(
                            _channel.full_message(full, "publish") + "; published nowhere"
                        )
                    wait = _channel._MAINTENANCE_SECONDS
                    full.wait(_channel._TX, wait if left is None else min(wait, left))
                elif rc == _STALLED:
                    now = time.monotonic()
                    if stalled_since is None:
                        stalled_since = stall_began = now
                        nap = _channel._STALL_NAP_SECONDS
                    elif now - stalled_since > _channel._STALL_CHECK_SECONDS:
                        _channel._resolve_stall(segs[failed[0]], stall, consumer=False)
                        stalled_since = now
                    if left is not None and left <= 0:
                        raise errors.Full("publish: stuck behind a producer that does not finish")
                    # As Sender._wait_and_retry: retries every nap for the first
                    # _STALL_CHECK_SECONDS, then sleeps doubling up to the maintenance period.
                    time.sleep(nap if left is None else min(nap, left))
                    if now - stall_began >= _channel._STALL_CHECK_SECONDS:
                        nap = min(2 * nap, _channel._MAINTENANCE_SECONDS)
                elif rc == _BUSY:  # every transaction slot is held
                    if not self._reap_txns(att):
                        if left is not None and left <= 0:
                            raise errors.Full(
                                f"publish: every transaction slot of exchange {self.name!r} "
                                "is held by a live publisher"
                            )
                        time.sleep(0.001)
                else:
                    what = "publish" if failed[0] >= n else f"publish to {segs[failed[0]].name!r}"
                    raise_for(rc, what)
        finally:
            if armed is not None:
                _disarm(armed)

    def _scratch(self) -> Any:
        s = getattr(_local, "s", None)
        if s is None:
            s = _local.s = _Scratch()
        return s

    def _reap_txns(self, att: _Attachment) -> int:
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

    # -- inspection ---------------------------------------------------------------------

    def stats(self) -> ExchangeStats:
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


def _disarm(seg: _channel._Segment) -> None:
    """Stop counting ourselves among `seg`'s senders waiting for space (as Sender does)."""
    pass_on = seg.scratch().pass_on
    lib.shm_space_wait(seg.ptr, 0, pass_on)
    if pass_on[0]:
        seg.wake_sender()  # pass the wake-up on to the next waiter (csrc/ring.c)


def ls_lines() -> list[str]:
    """`python -m shmchan ls`'s section on exchanges: each with its counters and bindings."""
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
            for b in s.bindings:
                lines.append(f"  -> {b.channel:<{wc}}  {b.pattern or '-':<{wp}}  {b.routed} routed")
    return lines


# ---------------------------------------------------------------------------------------
# the receiver's side: settling a dead publisher's gated record
# ---------------------------------------------------------------------------------------

_resolvers: dict[str, _Attachment] = {}


def _resolver(name: str, uid: int) -> _Attachment | None:
    att = _resolvers.get(name)
    if att is None or att.uid != uid or att.pid != os.getpid():
        try:
            _check_name(name)
            att = _attach(name, False)
        except (errors.Error, ValueError):
            return None
        _resolvers[name] = att
    return att if att.uid == uid else None


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
    return True
