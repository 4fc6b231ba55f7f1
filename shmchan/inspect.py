"""The operators' view: which keys are held and by whom, which lines are deepest, and
why a message is not delivered yet.

Everything here reads the segment from any process (the receiver's or not) through the
C core's read-only snapshot (csrc/inspect.c): no lock is taken, nothing waits for the
receiver, and a reading that raced with it is retried a bounded number of times.

    ch.held()            -> [HeldKey(key, seq, pid, attempt, age), ...]
    ch.waiting(top=20)   -> [Line(key, depth, head_seq), ...]        deepest first
    ch.why_waiting(seq)  -> WaitChain([Wait(key, seq, pid, attempt, state, age), ...])

`why_waiting` always returns a `WaitChain` (a list): for a waiting message, the message
directly ahead of it on one of its keys, then what that one waits on, and so on until a
message that is in flight (its `pid` is the holder), delayed (its `due` time not yet
come: it keeps its keys meanwhile) or about to be handed out. For a message that is not
waiting the list is empty and `WaitChain.state` says what it is: "in flight" (with
`pid`, `attempt`, `age`), "delayed" (with `due`), "ready", "delivered", "dead letter" or
"unknown" (never sent, or dropped because its producer died mid-send).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import codec, hold, liveness
from ._lib import ffi, lib, raise_for
from ._segment import PREFIX, SHM_DIR

if TYPE_CHECKING:
    from .channel import Channel

__all__ = ["HeldKey", "Line", "Wait", "WaitChain", "Producer", "held", "waiting", "why_waiting"]
__all__ += ["producers", "segment_path", "mapping_pids", "users", "receiver_alive", "pid_alive"]

# Message states, as operators read them (SHM_VIEW_* in csrc/shmchan.h).
WAITING = "waiting"
READY = "ready"
IN_FLIGHT = "in flight"
DELIVERED = "delivered"
DEAD_LETTER = "dead letter"
DELAYED = "delayed"
UNKNOWN = "unknown"

_STATES = {
    lib.SHM_VIEW_UNKNOWN: UNKNOWN,
    lib.SHM_VIEW_WAITING: WAITING,
    lib.SHM_VIEW_READY: READY,
    lib.SHM_VIEW_INFLIGHT: IN_FLIGHT,
    lib.SHM_VIEW_DELIVERED: DELIVERED,
    lib.SHM_VIEW_DEAD: DEAD_LETTER,
    lib.SHM_VIEW_QUEUED: WAITING,  # waiting outside the receiver's window: still waiting
    lib.SHM_VIEW_DELAYED: DELAYED,
}

_CHAIN_MAX = 1000  # steps of a why_waiting chain, at most


@dataclass(frozen=True)
class HeldKey:
    """One key locked by an in-flight handle."""

    key: codec.Key
    """The key's value, as it was sent."""
    seq: int
    """The seq of the message whose handle holds it."""
    pid: int
    """The pid of the process holding that handle."""
    attempt: int
    """Which delivery of the message this is (1 = the first)."""
    age: float
    """Seconds since the message was handed out (resolution: a few ms)."""


@dataclass(frozen=True)
class Line:
    """The messages waiting for one key."""

    key: codec.Key
    """The key's value."""
    depth: int
    """Messages carrying the key that are not yet handed out (waiting or ready)."""
    head_seq: int
    """The oldest of them: the next to be handed out on this key."""


@dataclass(frozen=True)
class Wait:
    """One link of a why_waiting chain: the message directly ahead on `key`."""

    key: codec.Key
    """The key on which the message before it in the chain waits behind this one."""
    seq: int
    """This message's seq."""
    pid: int | None
    """While it is in flight: the pid of the process holding it; otherwise None."""
    attempt: int
    """Deliveries of this message so far (0 if it was never handed out)."""
    state: str
    """"in flight" (the end of the chain), "waiting" (the chain goes on), "delayed"
    (held back until `due`, keeping its keys), "ready" (the next recv() hands it out),
    or "delivered" (released while we looked)."""
    age: float | None = None
    """While it is in flight: seconds since it was handed out; otherwise None."""
    due: float | None = None
    """While it is delayed: when it may be handed out, as a time.time() value."""


class WaitChain(list[Wait]):
    """The answer of why_waiting(seq): a list of Wait, plus what the message itself is.

    Empty unless `state` is "waiting"."""

    seq: int
    """The message asked about."""
    state: str
    """"waiting", "in flight", "ready", "delivered", "dead letter" or "unknown"."""
    keys: tuple[codec.Key, ...]
    """Its keys (empty if it was not found)."""
    pid: int | None
    """In flight: the pid holding it."""
    attempt: int
    """Deliveries so far."""
    age: float | None
    """In flight: seconds since it was handed out."""
    due: float | None
    """Delayed: when it may be handed out, as a time.time() value."""
    partial: bool
    """True if the receiver was too busy for a consistent reading, or the chain was cut."""
    paused: str | None
    """Why a pause holds it back, if one does: "channel paused" or "key K paused" (K one
    of its keys, or of the messages it waits behind); None otherwise."""

    def __repr__(self) -> str:
        return f"WaitChain(seq={self.seq}, state={self.state!r}, {list.__repr__(self)})"


@dataclass(frozen=True)
class Producer:
    """A process registered as a sender."""

    pid: int
    """Its pid."""
    sent: int
    """Messages it sent through this registration."""
    alive: bool
    """False if it died without detaching (its entry is reclaimed later)."""


# --------------------------------------------------------------------------- reading


class _Views:
    """Out-parameters for one call of the core's view functions, grown on SHM_FULL."""

    def __init__(self, n: int, blob: int) -> None:
        self.n = max(n, 1)
        self.views = ffi.new("shm_view[]", self.n)
        self.blob_cap = max(blob, 4096)
        self.blob = ffi.new("uint8_t[]", self.blob_cap)
        self.count = ffi.new("uint32_t *")
        self.partial = ffi.new("uint32_t *")

    def keys(self, v: Any) -> tuple[codec.Key, ...]:
        off, size = int(v.blob_off), int(v.blob_len)
        if off + size > self.blob_cap:
            return ()
        return codec.decode_keys(bytes(ffi.buffer(self.blob + off, size)), int(v.nkeys))

    def key(self, v: Any) -> tuple[bool, codec.Key]:
        keys = self.keys(v)
        i = int(v.key_index)
        return (True, keys[i]) if i < len(keys) else (False, "")


def _segment(ch: Channel) -> Any:
    return ch._live()


def _pid(token: int) -> int | None:
    return liveness.token_pid(token) if token > 1 else None


def held(ch: Channel) -> list[HeldKey]:
    """Every key held by an in-flight handle, oldest hand-out first."""
    seg = _segment(ch)
    size = 64
    out: list[HeldKey] = []
    for _ in range(16):
        v = _Views(size, size * 64)
        rc = lib.shm_view_held(seg.ptr, v.views, v.n, v.count, v.blob, v.blob_cap)
        if rc == lib.SHM_FULL:
            size *= 4
            continue
        if rc:
            raise_for(rc, "held")
        for i in range(v.count[0]):
            m = v.views[i]
            pid = _pid(int(m.holder)) or 0
            for key in v.keys(m):
                out.append(HeldKey(key, int(m.seq), pid, int(m.attempt), m.age_ns / 1e9))
        break
    out.sort(key=lambda h: (-h.age, h.seq))
    return out


def waiting(ch: Channel, top: int = 20) -> list[Line]:
    """The `top` deepest lines of waiting messages, deepest first."""
    if not isinstance(top, int) or isinstance(top, bool):
        raise TypeError(f"top must be an int, not {type(top).__name__}")
    if not 0 <= top <= lib.SHM_VIEW_TOP_MAX:
        raise ValueError(f"top must be between 0 and {lib.SHM_VIEW_TOP_MAX}, got {top}")
    if top == 0:
        return []
    seg = _segment(ch)
    blob = top * 256
    for _ in range(16):
        v = _Views(top, blob)
        rc = lib.shm_view_lines(seg.ptr, top, v.views, v.count, v.blob, v.blob_cap, v.partial)
        if rc == lib.SHM_FULL:
            blob *= 4
            continue
        if rc:
            raise_for(rc, "waiting")
        out: list[Line] = []
        for i in range(v.count[0]):
            m = v.views[i]
            found, key = v.key(m)
            if found:
                out.append(Line(key, int(m.depth), int(m.seq)))
        out.sort(key=lambda line: (-line.depth, line.head_seq))
        return out
    raise AssertionError("key blobs kept growing")  # pragma: no cover


def _paused_reason(st: hold.PauseState, chain: WaitChain) -> str | None:
    """The pause that holds back a message waiting or ready (see WaitChain.paused)."""
    if chain.state not in (WAITING, READY):
        return None
    if st.paused:
        return "channel paused"
    if not st.hashes:
        return None
    paused = set(st.hashes)
    for key in (*chain.keys, *(w.key for w in chain)):
        if hold.key_hash(key) in paused:
            return f"key {key!r} paused"
    return None


def why_waiting(ch: Channel, seq: int) -> WaitChain:
    """What message `seq` waits on; see the module's docstring for the answer's shape."""
    if not isinstance(seq, int) or isinstance(seq, bool):
        raise TypeError(f"seq must be an int, not {type(seq).__name__}")
    if seq < 0:
        raise ValueError(f"seq must be >= 0, got {seq}")
    seg = _segment(ch)
    blob = 1 << 16
    for _ in range(16):
        v = _Views(_CHAIN_MAX, blob)
        me = ffi.new("shm_view *")
        rc = lib.shm_view_why(
            seg.ptr, seq, me, v.views, v.n, v.count, v.blob, v.blob_cap, v.partial
        )
        if rc == lib.SHM_FULL:
            blob *= 4
            continue
        if rc:
            raise_for(rc, "why_waiting")
        chain = WaitChain()
        for i in range(v.count[0]):
            m = v.views[i]
            _, key = v.key(m)
            state = _STATES.get(int(m.state), UNKNOWN)
            inflight = state == IN_FLIGHT
            chain.append(
                Wait(
                    key=key,
                    seq=int(m.seq),
                    pid=_pid(int(m.holder)) if inflight else None,
                    attempt=int(m.attempt),
                    state=state,
                    age=m.age_ns / 1e9 if inflight else None,
                    due=int(m.due_ns) / 1e9 if state == DELAYED else None,
                )
            )
        state = _STATES.get(int(me.state), UNKNOWN)
        chain.seq = seq
        chain.state = state
        chain.keys = v.keys(me) if int(me.blob_len) or int(me.nkeys) == 0 else ()
        chain.pid = _pid(int(me.holder)) if state == IN_FLIGHT else None
        chain.attempt = int(me.attempt)
        chain.age = me.age_ns / 1e9 if state == IN_FLIGHT else None
        chain.due = int(me.due_ns) / 1e9 if state == DELAYED else None
        cut = len(chain) == v.n and chain[-1].state == WAITING
        chain.partial = bool(v.partial[0]) or cut
        chain.paused = _paused_reason(hold.state(seg), chain)
        return chain
    raise AssertionError("key blobs kept growing")  # pragma: no cover


def producers(ch: Channel) -> list[Producer]:
    """The processes registered as senders, live or not (yet reclaimed)."""
    seg = _segment(ch)
    cfg = ffi.new("shm_config *")
    lib.shm_read_config(seg.ptr, cfg)
    size = max(int(cfg.max_producers), 1)
    tokens = ffi.new("uint64_t[]", size)
    sent = ffi.new("uint64_t[]", size)
    n = ffi.new("uint32_t *")
    lib.shm_view_producers(seg.ptr, tokens, sent, size, n)
    return [
        Producer(
            liveness.token_pid(int(tokens[i])), int(sent[i]), liveness.is_alive(int(tokens[i]))
        )
        for i in range(n[0])
    ]


# --------------------------------------------------------------------------- who uses it


def segment_path(name: str, path: str | None = None) -> str:
    """The file a channel lives in: its /dev/shm segment, or `path` for path= channels."""
    return os.path.realpath(path if path is not None else os.path.join(SHM_DIR, PREFIX + name))


def mapping_pids(paths: list[str]) -> dict[str, set[int]]:
    """For each file in `paths` (channels' segments), the pids of the processes that map
    it, read from /proc/PID/maps in one pass; processes we may not inspect are left out."""
    found: dict[str, set[int]] = {os.path.realpath(p): set() for p in paths}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    # "addr perms offset dev inode   /path" (+ " (deleted)" once unlinked)
                    fields = line.split(maxsplit=5)
                    if len(fields) < 6:
                        continue
                    name = fields[5].rstrip("\n").removesuffix(" (deleted)")
                    if name in found:
                        found[name].add(int(entry))
        except (OSError, ValueError):
            continue
    return found


def users(ch: Channel, path: str) -> dict[int, list[str]]:
    """Every live process that still uses the channel, with how: it maps the segment, is
    the receiver, is registered as a producer, or holds a handle. This process is left
    out (it maps the segment only to look)."""
    me = os.getpid()
    out: dict[int, list[str]] = {}

    def add(pid: int | None, how: str) -> None:
        if pid is not None and pid != me:
            out.setdefault(pid, [])
            if how not in out[pid]:
                out[pid].append(how)

    for pid in sorted(mapping_pids([path])[os.path.realpath(path)]):
        add(pid, "maps it")
    st = ch.stats()
    receiver = _receiver_token(ch)
    if receiver and liveness.is_alive(receiver):
        add(st.receiver_pid, "receiver")
    for p in producers(ch):
        if p.alive:
            add(p.pid, "producer")
    for h in held(ch):
        if pid_alive(h.pid):
            add(h.pid, f"holds seq {h.seq}")
    return out


def _receiver_token(ch: Channel) -> int:
    owner = ffi.new("uint64_t *")
    lib.shm_rx_owner(_segment(ch).ptr, owner)
    return int(owner[0])


def pid_alive(pid: int) -> bool:
    """Is process `pid` running (not a zombie)? For a pid without its start time, as a
    process's own records give it; a process we may not inspect counts as running."""
    import psutil  # on first use: keeps `import shmchan` light

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def receiver_alive(ch: Channel) -> bool:
    """Is the channel's receiver seat held by a live process?"""
    token = _receiver_token(ch)
    return bool(token) and liveness.is_alive(token)
