"""The consumer killed (the failure model).

A receiver process may be SIGKILLed at any instruction, inside a C call included; the
next process to ask for the receiver carries on (rebuilding the scheduler's state if
the dead one was in the middle of an operation: csrc/rebuild.c). No accepted message
is lost, every message is delivered exactly once except those in flight at the death
(which come back with attempt + 1), per-key order holds among released handles, two live
handles never share a key, and handles held by live workers stay valid.

Children are spawned; every blocking call has a timeout; every child is killed and
joined in `finally`.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import multiprocessing
import os
import random
import signal
import struct
import time
from dataclasses import dataclass, field

import pytest
from procs import CTX, WAIT, running, take_receiver_seat

import shmchan


def wait_dead_unreaped(pid: int) -> None:
    """Block until `pid` (our child) has died, leaving it a zombie (not reaped)."""
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


# --- messages: numbered, checksummed, keyed by their number --------------------------------

KEY_POOL = ("a", "b", "c", "d", "e")
HEAD = struct.Struct("<IIQ")  # producer id, message number, body length
DIGEST = 16


def message(producer_id: int, n: int) -> tuple[bytes, tuple[str, ...]]:
    """(payload, keys) of message n of a producer, the same in every process."""
    rng = random.Random(f"{producer_id}:{n}")  # str seeds are hashed with sha512: stable
    keys = tuple(rng.sample(KEY_POOL, rng.randint(0, 3)))
    body = rng.randbytes(rng.randint(0, 2000))
    head = HEAD.pack(producer_id, n, len(body))
    return head + hashlib.blake2b(head + body, digest_size=DIGEST).digest() + body, keys


def check_message(data: bytes, keys: tuple) -> tuple[int, int]:
    """(producer id, n) of a whole payload carrying the keys it was sent with."""
    if len(data) < HEAD.size + DIGEST:
        raise AssertionError(f"payload too short: {len(data)} bytes")
    producer_id, n, size = HEAD.unpack_from(data)
    if data != message(producer_id, n)[0]:
        raise AssertionError(f"torn or corrupt payload claiming to be ({producer_id}, {n}, {size})")
    if keys != message(producer_id, n)[1]:
        raise AssertionError(f"message ({producer_id}, {n}) arrived with keys {keys}")
    return producer_id, n


SEND_LOG = struct.Struct("<QII")  # seq, producer id, n: written after send returned


def produce_until_stopped(name: str, producer_id: int, log_path: str, stop) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with shmchan.Channel.open(name) as ch, ch.sender() as tx:
        n = 0
        while not stop.is_set():
            payload, keys = message(producer_id, n)
            seq = tx.send(payload, keys=keys, timeout=WAIT)
            os.write(fd, SEND_LOG.pack(seq, producer_id, n))
            n += 1


def read_send_log(path: str) -> list[tuple[int, int, int]]:
    with open(path, "rb") as f:
        data = f.read()
    usable = len(data) - len(data) % SEND_LOG.size
    return [SEND_LOG.unpack_from(data, off) for off in range(0, usable, SEND_LOG.size)]


# --- consumer event log --------------------------------------------------------------------
# One line per event, one write() each, written only after the event happened:
#   S                                  the receiver was acquired
#   R seq attempt producer n keys      a handle was received (payload and keys checked)
#   L seq                              a handle was released
#   X reason                           a check failed in the consumer (then it exits)


@dataclass
class Event:
    kind: str
    seq: int = 0
    attempt: int = 0
    origin: tuple[int, int] = (0, 0)
    keys: tuple[str, ...] = ()


@dataclass
class Generation:
    """The events of one consumer process, in the order they happened."""

    events: list[Event] = field(default_factory=list)
    killed: bool = True


def encode_event(e: Event) -> bytes:
    if e.kind == "R":
        return f"R {e.seq} {e.attempt} {e.origin[0]} {e.origin[1]} {','.join(e.keys)}\n".encode()
    return f"L {e.seq}\n".encode()


def read_events(path: str) -> list[Event]:
    try:
        with open(path, "rb") as f:
            text = f.read().decode()
    except FileNotFoundError:
        return []
    out = []
    for line in text.split("\n")[:-1]:  # a torn last line has no newline: dropped
        kind, *rest = line.split(" ")
        if kind == "X":
            raise AssertionError(f"consumer check failed: {line}")
        if kind == "S":
            out.append(Event("S"))
        elif kind == "R":
            seq, attempt, pid, n, keys = rest
            out.append(
                Event(
                    "R",
                    int(seq),
                    int(attempt),
                    (int(pid), int(n)),
                    tuple(k for k in keys.split(",") if k),
                )
            )
        elif kind == "L":
            out.append(Event("L", int(rest[0])))
    return out


def consume_and_log(name: str, log_path: str, seed: int) -> None:
    """Receive, hold some handles, release them in random order, log every step; forever."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    rng = random.Random(seed)
    with shmchan.Channel.open(name) as ch:
        rx = take_receiver_seat(ch)
        os.write(fd, b"S\n")
        held: list[tuple[shmchan.Handle, Event]] = []
        while True:
            if held:
                got = rx.try_recv()
                batch = [got] if got is not None else []
                if not batch:  # what is queued may wait for keys we hold
                    h, e = held.pop(rng.randrange(len(held)))
                    h.release()
                    os.write(fd, encode_event(Event("L", e.seq)))
                    continue
            else:
                try:
                    batch = rx.recv_many(rng.randint(1, 8), timeout=0.2)
                except shmchan.Empty:
                    continue
            for h in batch:
                try:
                    data = h.data.tobytes() if rng.random() < 0.3 else h.payload
                    origin = check_message(data, h.keys)
                except AssertionError as exc:
                    os.write(fd, f"X seq {h.seq}: {exc}\n".encode())
                    os._exit(3)
                e = Event("R", h.seq, h.attempt, origin, h.keys)
                os.write(fd, encode_event(e))
                held.append((h, e))
            while len(held) > rng.randint(0, 5):
                h, e = held.pop(rng.randrange(len(held)))
                h.release()
                os.write(fd, encode_event(Event("L", e.seq)))


# --- the receiver seat ---------------------------------------------------------------------


def hold_receiver_until_killed(name: str, ready) -> None:
    with shmchan.Channel.open(name) as ch:
        rx = ch.receiver()
        ready.set()
        time.sleep(WAIT * 4)
        rx.close()


@pytest.mark.timeout(60)
def test_receiver_is_busy_while_its_holder_lives_and_free_once_it_is_dead(ch):
    ready = CTX.Event()
    child = CTX.Process(target=hold_receiver_until_killed, args=(ch.name, ready))
    with running(child):
        assert ready.wait(WAIT), "child never took the receiver"
        with pytest.raises(shmchan.ReceiverBusy):
            ch.receiver()
        with pytest.raises(shmchan.ReceiverBusy):  # still busy: nothing changed
            ch.receiver()
        os.kill(child.pid, signal.SIGKILL)
        wait_dead_unreaped(child.pid)  # a zombie is dead: its seat is free before reaping
        with ch.receiver() as rx:
            assert rx.try_recv() is None


# --- handles of live workers survive their consumer -------------------------------------------


def consume_and_hand_over(name: str, handles) -> None:
    """Receive one message, pass its handle to a worker (by pickling), then wait to be killed."""
    with shmchan.Channel.open(name) as ch:
        rx = ch.receiver()
        handles.put(rx.recv(timeout=WAIT))
        time.sleep(WAIT * 4)


def work_on_handle(handles, results, go) -> None:
    h = handles.get(timeout=WAIT)
    results.put(("holding", h.seq, h.payload, h.attempt))
    if go.wait(WAIT):
        h.release()
        results.put(("released", h.seq))
    time.sleep(WAIT * 4)  # stay alive: a dead holder's handles are revoked, not released


@pytest.mark.timeout(60)
def test_handle_held_by_a_live_worker_stays_valid_after_its_consumer_is_killed(ch, tx):
    first = tx.send(b"first", keys="k")
    second = tx.send(b"second", keys="k")
    handles, results, go = CTX.Queue(), CTX.Queue(), CTX.Event()
    consumer = CTX.Process(target=consume_and_hand_over, args=(ch.name, handles))
    worker = CTX.Process(target=work_on_handle, args=(handles, results, go))
    with running(consumer, worker):
        assert results.get(timeout=WAIT) == ("holding", first, b"first", 1)
        os.kill(consumer.pid, signal.SIGKILL)
        consumer.join(WAIT)
        with ch.receiver() as rx:
            # The worker lives: its handle is neither revoked nor redelivered, and "k" stays
            # held (maintenance runs on every poll; give it several rounds).
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                with contextlib.suppress(shmchan.Empty):
                    got = rx.recv(timeout=0.1)
                    pytest.fail(
                        f"seq {got.seq} attempt {got.attempt} handed out while the worker holds k"
                    )
            go.set()
            assert results.get(timeout=WAIT) == ("released", first)
            h = rx.recv(timeout=WAIT)
            assert (h.seq, h.payload, h.attempt) == (second, b"second", 1)
            h.release()
            assert rx.try_recv() is None
            stats = ch.stats()
            assert (stats.inflight, stats.queued, stats.redelivered) == (0, 0, 0)


# --- a receiver killed inside revocation ----------------------------------------------------
def _fact(name: str) -> int:
    """Where a field lives, from the C core itself (csrc/segment.c shm_layout_fact)."""
    from shmchan._lib import ffi, lib

    out = ffi.new("uint64_t *")
    assert lib.shm_layout_fact(name.encode(), out) == 0, name
    return int(out[0])


RECEIVER_OFFSET, DIRTY_OFFSET = _fact("header.receiver"), _fact("header.dirty")
MAX_MESSAGES_OFFSET, SLOTS_OFFSET = _fact("header.max_messages"), _fact("header.slots_off")
SLOT_SIZE, SLOT_HOLDER, SLOT_SEQ = _fact("slot.size"), _fact("slot.holder"), _fact("slot.seq")
HOLDER_REVOKED = 1  # csrc/core.h: a slot's holder word once revocation has claimed it
SLOT_INFLIGHT = 3


def mark_dirty(name: str) -> None:
    """Raise channel `name`'s dirty flag, as a receiver that died inside an update leaves
    it: the next receiver must rebuild."""
    fd = os.open(f"/dev/shm/shmchan.{name}", os.O_RDWR)
    try:
        os.pwrite(fd, (1).to_bytes(4, "little"), DIRTY_OFFSET)
    finally:
        os.close(fd)


def consume_one_and_hold(name: str, results) -> None:
    with shmchan.Channel.open(name) as ch:
        rx = ch.receiver()
        h = rx.recv(timeout=WAIT)  # kept referenced: a collected handle is released
        results.put(h.seq)
        time.sleep(WAIT * 4)


def leave_revocation_half_done(segment_path: str, seq: int, dead_pid: int) -> None:
    """Put the segment in the state a receiver SIGKILLed inside shm_revoke leaves when it
    dies between its two CASes (holder: dead token -> REVOKED, then state: INFLIGHT ->
    NACKED): the slot still INFLIGHT, its holder REVOKED, the header dirty."""
    fd = os.open(segment_path, os.O_RDWR)
    try:
        header = os.pread(fd, 4096, 0)
        max_messages = int.from_bytes(
            header[MAX_MESSAGES_OFFSET : MAX_MESSAGES_OFFSET + 4], "little"
        )
        slots_off = int.from_bytes(header[SLOTS_OFFSET : SLOTS_OFFSET + 8], "little")
        for s in range(1, max_messages + 1):
            slot = os.pread(fd, SLOT_SIZE, slots_off + s * SLOT_SIZE)
            if int.from_bytes(slot[SLOT_SEQ : SLOT_SEQ + 8], "little") != seq:
                continue
            assert slot[0] == SLOT_INFLIGHT, "slot layout does not match csrc/core.h"
            holder = int.from_bytes(slot[SLOT_HOLDER : SLOT_HOLDER + 8], "little")
            assert holder >> 40 == dead_pid, "slot layout does not match csrc/core.h"
            os.pwrite(
                fd, HOLDER_REVOKED.to_bytes(8, "little"), slots_off + s * SLOT_SIZE + SLOT_HOLDER
            )
            os.pwrite(fd, (1).to_bytes(4, "little"), DIRTY_OFFSET)
            return
        raise AssertionError(f"no slot holds seq {seq}: layout does not match csrc/core.h")
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
def test_message_comes_back_after_a_receiver_died_halfway_through_revoking_it(make_channel):
    """A consumer holding a message is killed; its successor is killed inside the revocation
    of that handle, after claiming the holder word and before requeueing the message. The
    next receiver must still redeliver the message (attempt 2) and free its key."""
    ch = make_channel(max_messages=16)
    with ch.sender() as tx:
        first = tx.send(b"first", keys="k")
        second = tx.send(b"second", keys="k")
    results = CTX.Queue()
    child = CTX.Process(target=consume_one_and_hold, args=(ch.name, results))
    with running(child):
        assert results.get(timeout=WAIT) == first
        os.kill(child.pid, signal.SIGKILL)
        child.join(WAIT)
    leave_revocation_half_done(f"/dev/shm/shmchan.{ch.name}", first, child.pid)
    with ch.receiver() as rx:
        try:
            h = rx.recv(timeout=3)
        except shmchan.Empty:
            pytest.fail("the half-revoked message never came back: its key 'k' stays held")
        assert (h.seq, h.attempt, h.payload) == (first, 2, b"first")
        h.release()
        h = rx.recv(timeout=WAIT)
        assert (h.seq, h.attempt) == (second, 1)
        h.release()


def consume_two_and_hold(name: str, results) -> None:
    with shmchan.Channel.open(name) as ch:
        rx = ch.receiver()
        got = [rx.recv(timeout=WAIT) for _ in range(2)]  # kept referenced: not released
        results.put(sorted(h.seq for h in got))
        time.sleep(WAIT * 4)


@pytest.mark.timeout(60)
def test_rebuild_with_a_full_window_hands_out_each_message_once(make_channel):
    """A message taken in out of order (past a window full of waiting ones) and handed out
    must stay one message when a successor rebuilds (rebuild.c) and its window fills up
    before it reaches that record again."""
    ch = make_channel(max_messages=16)
    with ch.sender() as tx:
        hot = [tx.send(b"hot", keys="hot") for _ in range(40)]
        cold = tx.send(b"cold", keys="cold")
    results = CTX.Queue()
    child = CTX.Process(target=consume_two_and_hold, args=(ch.name, results))
    with running(child):
        assert results.get(timeout=WAIT) == [hot[0], cold]
        os.kill(child.pid, signal.SIGKILL)
        child.join(WAIT)
    mark_dirty(ch.name)  # as if it died inside an update: the next receiver must rebuild
    seen: list[tuple[int, int]] = []
    with ch.receiver() as rx:
        while len(seen) < 41:
            try:
                h = rx.recv(timeout=3)
            except shmchan.Empty:
                break
            seen.append((h.seq, h.attempt))
            h.release()
        with pytest.raises(shmchan.Empty):
            rx.recv(timeout=0.5)
    assert sorted(s for s, _ in seen) == sorted([*hot, cold]), "lost or delivered twice"
    attempts = dict(seen)
    assert attempts[hot[0]] == attempts[cold] == 2  # the dead holder's, redelivered
    assert all(attempts[s] == 1 for s in hot[1:])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_rebuild_of_a_full_window_delivers_the_whole_backlog(make_channel, order):
    """A receiver that rebuilds (the previous one died inside an update) with more
    messages queued than its window holds still hands every one of them out."""
    ch = make_channel(max_messages=16, order=order)
    with ch.sender() as tx:
        seqs = [tx.send(b"x", keys="hot") for _ in range(40)]
    mark_dirty(ch.name)
    got = []
    with ch.receiver() as rx:
        while len(got) < len(seqs):
            try:
                h = rx.recv(timeout=3)
            except shmchan.Empty:
                break
            got.append(h.seq)
            h.release()
    assert got == seqs


# --- torture ---------------------------------------------------------------------------------

CONSUMER_GENERATIONS = 18
MAX_BATCH = 8  # consumers receive at most this many handles per call


class Killer:
    """SIGKILLs consumer processes: at a random moment, or inside a receiver operation."""

    def __init__(self, segment_path: str) -> None:
        with open(segment_path, "rb") as f:
            self._header = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)

    def close(self) -> None:
        self._header.close()

    def _receiver_pid(self) -> int:
        return int.from_bytes(self._header[RECEIVER_OFFSET : RECEIVER_OFFSET + 8], "little") >> 40

    def _dirty(self) -> bool:
        return self._header[DIRTY_OFFSET] != 0

    def kill_inside_an_operation(self, pid: int, budget: float) -> bool:
        """Freeze the consumer (SIGSTOP) when its dirty flag is up; if it is still up with
        the process frozen, the SIGKILL lands inside the operation. True if it did."""
        assert self._receiver_pid() == pid, "RECEIVER_OFFSET does not match csrc/core.h"
        end = time.monotonic() + budget
        while time.monotonic() < end:
            if not self._dirty():
                continue
            os.kill(pid, signal.SIGSTOP)
            os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOWAIT)
            if self._dirty():
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
                return True
            os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
        return False

    def died_inside_an_operation(self, pid: int) -> bool:
        return self._receiver_pid() == pid and self._dirty()


def wait_for_line(path: str, line: bytes, proc: multiprocessing.process.BaseProcess) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline and proc.is_alive():
        with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
            if line in f.read().split(b"\n"):
                return
        time.sleep(0.005)
    raise AssertionError(f"{proc.name} never logged {line!r} (exit code {proc.exitcode})")


@pytest.mark.torture
@pytest.mark.timeout(120)
def test_consumers_killed_at_random_moments_lose_nothing_and_keep_order(make_channel, tmp_path):
    """Issue #3 item 3: a consumer is SIGKILLed 12 times while producers keep sending; each
    time a new consumer process takes over. A third of the kills land at random moments
    while it consumes, a third while it starts (maybe inside the rebuild of its dead
    predecessor's state), a third inside a receiver operation (frozen with SIGSTOP when its
    dirty flag is up, then killed), which makes the next consumer rebuild (rebuild.c).
    Then this process drains. The logs of every consumer must show: each accepted message
    delivered, exactly once unless it was in flight at a death (then again with a higher
    attempt), per-key seq order among hand-outs and releases, no key shared by two live
    handles."""
    rng = random.Random(3)
    ch = make_channel(capacity=256 << 10)
    killer = Killer(f"/dev/shm/shmchan.{ch.name}")
    stop = CTX.Event()
    send_logs = [str(tmp_path / f"send{i}.log") for i in range(2)]
    producers = [
        CTX.Process(
            target=produce_until_stopped, args=(ch.name, i, send_logs[i], stop), daemon=True
        )
        for i in range(2)
    ]
    generations: list[Generation] = []
    inside = 0
    consumers: list[multiprocessing.process.BaseProcess] = []
    try:
        for p in producers:
            p.start()
        for g in range(CONSUMER_GENERATIONS):
            log = str(tmp_path / f"consumer{g}.log")
            c = CTX.Process(target=consume_and_log, args=(ch.name, log, g), daemon=True)
            consumers.append(c)
            c.start()
            how = g % 3
            if how == 0:  # at a random moment while it consumes
                wait_for_line(log, b"S", c)
                time.sleep(rng.uniform(0.05, 0.8))
                os.kill(c.pid, signal.SIGKILL)
            elif how == 1:  # at a random moment while it starts
                time.sleep(rng.uniform(0.0, 0.4))
                os.kill(c.pid, signal.SIGKILL)
            else:  # inside a receiver operation
                wait_for_line(log, b"S", c)
                time.sleep(rng.uniform(0.05, 0.3))
                assert killer.kill_inside_an_operation(c.pid, budget=5.0), (
                    f"consumer {g}: never caught inside a receiver operation"
                )
            wait_dead_unreaped(c.pid)
            inside += killer.died_inside_an_operation(c.pid)
            c.join(WAIT)
            assert c.exitcode == -signal.SIGKILL, f"consumer {g} exited with {c.exitcode}"
            generations.append(Generation(read_events(log)))

        # The last consumer is this process: drain while the producers stop, then the rest.
        final = Generation(killed=False)
        generations.append(final)
        held: list[tuple[shmchan.Handle, Event]] = []

        def release_one() -> None:
            h, e = held.pop(rng.randrange(len(held)))
            h.release()
            final.events.append(Event("L", e.seq))

        with ch.receiver() as rx:
            stop.set()
            while True:
                try:
                    h = rx.try_recv() if held else rx.recv(timeout=0.5)
                except shmchan.Empty:
                    if not any(p.is_alive() for p in producers):
                        break  # the producers are done and nothing is left
                    continue
                if h is None:
                    release_one()  # what is queued may wait for keys we hold
                    continue
                e = Event("R", h.seq, h.attempt, check_message(h.payload, h.keys), h.keys)
                final.events.append(e)
                held.append((h, e))
                while len(held) > rng.randint(0, 4):
                    release_one()
            assert rx.try_recv() is None
            stats = ch.stats()
        for p in producers:
            p.join(WAIT)
            assert p.exitcode == 0, f"producer exited with {p.exitcode}"
    finally:
        stop.set()
        killer.close()
        for p in producers + consumers:
            if p.is_alive():
                p.kill()
            p.join(WAIT)

    sends = {seq: (pid, n) for path in send_logs for seq, pid, n in read_send_log(path)}
    check_consumer_history(generations, sends)
    assert (stats.queued, stats.inflight, stats.used_bytes) == (0, 0, 0), stats
    redelivered = sum(e.attempt > 1 for g in generations for e in g.events if e.kind == "R")
    print(
        f"{len(sends)} logged sends, {CONSUMER_GENERATIONS} consumers killed "
        f"({inside} inside an operation), {redelivered} redeliveries"
    )
    assert len(sends) > 1000, "too little was sent for the test to mean anything"


def check_consumer_history(
    generations: list[Generation], sends: dict[int, tuple[int, int]]
) -> None:
    """The delivery guarantees, from what the consumers logged in the order it happened."""
    deliveries: dict[int, list[tuple[int, Event]]] = {}  # seq -> [(generation, R event)]
    released: dict[int, int] = {}  # seq -> generation that logged its release
    last_released_on_key: dict[str, int] = {}
    last_received_on_key: dict[str, tuple[int, int]] = {}  # key -> (seq, attempt)
    orphans = 0  # redeliveries whose earlier delivery was never logged (kill right after recv)
    live_at_death: list[tuple[int, set[int]]] = []

    for g, gen in enumerate(generations):
        live: dict[int, Event] = {}  # this consumer's live handles, by seq
        for e in gen.events:
            if e.kind == "R":
                assert sends.get(e.seq, e.origin) == e.origin, (
                    f"seq {e.seq} is not the message sent"
                )
                held_keys = {k for other in live.values() for k in other.keys}
                assert not held_keys & set(e.keys), (
                    f"consumer {g}: seq {e.seq} keys {e.keys} handed out while "
                    f"{sorted(held_keys)} are held"
                )
                assert e.seq not in released, (
                    f"seq {e.seq} delivered again after its release was logged"
                )
                before = deliveries.setdefault(e.seq, [])
                assert all(g2 < g for g2, _ in before), (
                    f"seq {e.seq} delivered twice to consumer {g}"
                )
                if before:
                    assert e.attempt > before[-1][1].attempt, f"seq {e.seq}: attempt did not grow"
                elif e.attempt > 1:
                    orphans += 1
                for k in e.keys:  # per-key hand-out order: by seq, a redelivery repeats its seq
                    seq, attempt = last_received_on_key.get(k, (0, 0))
                    assert (e.seq, e.attempt) > (seq, attempt), (
                        f"key {k!r}: seq {e.seq} attempt {e.attempt} handed out after seq {seq} "
                        f"attempt {attempt}"
                    )
                    last_received_on_key[k] = (e.seq, e.attempt)
                before.append((g, e))
                live[e.seq] = e
            elif e.kind == "L":
                got = live.pop(e.seq)
                released[e.seq] = g
                for k in got.keys:
                    assert e.seq > last_released_on_key.get(k, 0), (
                        f"key {k!r}: seq {e.seq} released after seq {last_released_on_key[k]}"
                    )
                    last_released_on_key[k] = e.seq
        if gen.killed:
            live_at_death.append((g, set(live)))
        else:
            assert not live, "the final consumer released everything"

    for g, held in live_at_death:
        # What a killed consumer held comes back later, except perhaps the one handle it was
        # releasing when killed (released, but its log line never written).
        lost = sorted(s for s in held if not any(g2 > g for g2, _ in deliveries[s]))
        assert len(lost) <= 1, f"consumer {g} held {lost} at its death: never redelivered"
    assert orphans <= MAX_BATCH * len(generations), f"{orphans} redeliveries of unseen deliveries"
    missing = sorted(seq for seq in sends if seq not in deliveries)
    assert not missing, f"{len(missing)} accepted messages never delivered, e.g. {missing[:10]}"


_WRITER_VICTIM = """
    import sys
    import shmchan
    from shmchan._lib import lib
    name, notify, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tx = shmchan.Channel.open(name).sender()
    lib.shm_test_pause_at(lib.SHM_PAUSE_SEND_WRITTEN, notify, wait)
    tx.send(b"y" * 200, keys="k", timeout=10)
"""


@pytest.mark.timeout(120)
def test_a_writer_killed_before_raising_the_tail_hint_leaves_no_hint_inside_finished_bytes(
    chan_name: str,
) -> None:
    # A producer killed between publishing its record's length and raising the tail hint
    # leaves the hint at its record. Once the receiver finishes that record, head and
    # compaction may pass it and rewrite its bytes, so the hint must not stay there: a
    # producer's walk starting from it would read garbage, and start there again for as
    # long as nobody raised the hint, until its send failed as corrupt. The receiver that
    # discards the dead writer's record raises the hint past it, as a claim's repairer does.
    from procs import header_u64, kill_at_pause

    ch = shmchan.Channel.create(chan_name, capacity=1 << 20)
    try:
        tx, rx = ch.sender(), ch.receiver()
        for i in range(10):
            tx.send(b"x" * 100, keys=f"a{i}")
        for _ in range(10):
            rx.recv(timeout=5).release()
        kill_at_pause(_WRITER_VICTIM, chan_name, "a send's published length")
        stuck = header_u64(ch, "header.tail_hint")  # the dead writer's record
        with pytest.raises(shmchan.Empty):
            rx.recv(timeout=2)  # discards the dead writer's record: nothing to hand out
        assert ch.stats().discarded == 1
        assert header_u64(ch, "header.tail_hint") > stuck
        seq = tx.send(b"z", keys="k")
        h = rx.recv(timeout=5)
        assert (h.seq, h.payload) == (seq, b"z")
        h.release()
    finally:
        ch.close()
        shmchan.unlink(chan_name)
