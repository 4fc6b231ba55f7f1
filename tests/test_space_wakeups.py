"""Senders waiting for space are woken by a rationed rule (csrc/ring.c, "senders waiting
for space"): no wake-up before a quarter of the ring is free, at most one post per receive
call or release, a post only when none is pending, passed on by the sender that woke --
and never a sender left asleep while there is room."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from procs import CTX, WAIT, child_env, running

import shmchan
from shmchan import _segment
from shmchan._lib import ffi, lib

CAPACITY = 64 << 10
PAYLOAD = bytes(64)


def _fill(tx: Any) -> int:
    """Send 64 B messages until the channel is full; returns how many went in."""
    n = 0
    while True:
        try:
            tx.send(PAYLOAD, n, timeout=0)
        except shmchan.Full:
            return n
        n += 1


def _waiter(ch_name: str) -> Any:
    """Another attachment of the channel, registered as a producer (its own registry entry)."""
    ch = shmchan.Channel.open(ch_name)
    seg = ch._seg
    seg.register_producer()
    return ch


def _arm(ch: Any, arm: int) -> int:
    pass_on = ffi.new("int *")
    assert lib.shm_space_wait(ch._seg.ptr, arm, pass_on) == 0
    return int(pass_on[0])


def _take_post(seg: Any) -> None:
    """Consume a pending post of the senders' semaphore, if any (as a woken sender would)."""
    seg.wait(1, 0.0)


def test_receiver_wakes_no_sender_before_a_quarter_is_free_and_one_per_call_after(
    make_channel: Callable[..., Any],
) -> None:
    ch = make_channel(capacity=CAPACITY)
    tx, rx = ch.sender(), ch.receiver()
    sent = _fill(tx)
    waiters = [_waiter(ch._seg.name) for _ in range(4)]
    try:
        for w in waiters:
            _arm(w, 1)
        record = CAPACITY // sent  # bytes one message takes in the ring, about
        early = (CAPACITY // 4) // record - 2  # drained before a quarter can be free
        posts_at: list[int] = []
        for i in range(sent):
            before = rx._seg.tx_posts
            h = rx.recv(timeout=WAIT)
            after_recv = rx._seg.tx_posts
            h.release()
            after_release = rx._seg.tx_posts
            assert after_recv - before <= 1 and after_release - after_recv <= 1
            if after_release > before:
                posts_at.append(i)
            _take_post(waiters[0]._seg)  # a woken sender took it: the next call may post
        assert posts_at, "waiting senders were never woken although the ring drained"
        assert posts_at[0] >= early, (posts_at[0], early)
    finally:
        for w in waiters:
            _arm(w, 0)
            w.close()


def test_no_second_post_while_one_is_pending(make_channel: Callable[..., Any]) -> None:
    ch = make_channel(capacity=CAPACITY)
    tx, rx = ch.sender(), ch.receiver()
    sent = _fill(tx)
    w = _waiter(ch._seg.name)
    try:
        _arm(w, 1)
        for _ in range(sent):
            rx.recv(timeout=WAIT).release()
        assert rx._seg.tx_posts == 1  # the first post was never consumed: no more needed
    finally:
        _arm(w, 0)
        w.close()


def test_a_woken_sender_passes_the_wake_up_on_only_to_a_remaining_waiter(
    make_channel: Callable[..., Any],
) -> None:
    ch = make_channel(capacity=CAPACITY)
    a, b = _waiter(ch._seg.name), _waiter(ch._seg.name)
    try:
        _arm(a, 1)
        _arm(b, 1)
        assert _arm(a, 0) == 1  # b still waits and the ring has room: pass it on
        assert _arm(b, 0) == 0  # nobody left
        assert _arm(b, 0) == 0  # not waiting: a no-op
    finally:
        a.close()
        b.close()


# --------------------------------------------------------------------------- processes


def _producer(name: str, me: int, count: int, out: Any) -> None:
    # No periodic re-check: a sender wakes only by a post, so a lost wake-up shows as Full.
    _segment.MAINTENANCE_SECONDS = 3600.0
    try:
        tx = shmchan.Sender.open(name)
        for i in range(count):
            tx.send(me.to_bytes(4, "little") + i.to_bytes(4, "little") + PAYLOAD, me, WAIT)
        out.put((me, "ok"))
    except BaseException as e:  # reported to the test, which fails on it
        out.put((me, repr(e)))


def test_many_producers_on_a_tiny_ring_all_finish(
    make_channel: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 producers, a ring of a few records, no periodic re-check on either side: every
    message arrives, in order per producer, and no producer waits out its timeout."""
    monkeypatch.setattr(_segment, "MAINTENANCE_SECONDS", 3600.0)
    nprod, count = 12, 300
    ch = make_channel(capacity=1024)
    rx = ch.receiver()
    out = CTX.Queue()
    procs = [
        CTX.Process(target=_producer, args=(ch._seg.name, p, count, out)) for p in range(nprod)
    ]
    next_of = [0] * nprod
    with running(*procs):
        for _ in range(nprod * count):
            h = rx.recv(timeout=WAIT)
            d = h.payload
            p, i = int.from_bytes(d[:4], "little"), int.from_bytes(d[4:8], "little")
            assert i == next_of[p]
            next_of[p] += 1
            h.release()
        results = dict(out.get(timeout=WAIT) for _ in range(nprod))
        for p in procs:
            p.join(WAIT)
    assert results == {p: "ok" for p in range(nprod)}
    assert next_of == [count] * nprod


# --------------------------------------------------------------------------- threads


def _fact(name: str) -> int:
    """Where a field lives, from the C core itself (csrc/segment.c shm_layout_fact)."""
    out = ffi.new("uint64_t *")
    assert lib.shm_layout_fact(name.encode(), out) == 0, name
    return int(out[0])


def _space_waiters(ch: Any) -> int:
    """The header's count of senders waiting for space (csrc/core.h space_waiters)."""
    off = _fact("header.space_waiters")
    return int.from_bytes(ch._seg.mem[off : off + 4], "little")


def _until(cond: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@pytest.mark.timeout(60)
def test_threads_waiting_through_one_sender_are_each_counted_and_each_woken(
    make_channel: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads of one process share its registry entry. Each must count in space_waiters,
    or the first one woken, as it stops waiting, sees nobody left to pass the wake-up on
    to and the others sleep until their next periodic look (disabled here: they would
    wait out their timeout)."""
    monkeypatch.setattr(_segment, "MAINTENANCE_SECONDS", 3600.0)
    nthreads = 4
    ch = make_channel(capacity=CAPACITY)
    tx, rx = ch.sender(), ch.receiver()
    sent = _fill(tx)
    results: dict[int, object] = {}

    def send(i: int) -> None:
        try:
            results[i] = tx.send(PAYLOAD, ("t", i), timeout=WAIT)
        except BaseException as e:  # reported to the test, which fails on it
            results[i] = e

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(nthreads)]
    for t in threads:
        t.start()
    try:
        counted = _until(lambda: _space_waiters(ch) == nthreads)
        assert counted, f"{_space_waiters(ch)} of {nthreads} waiting threads counted"
    finally:
        # drain: every blocked send goes in, each woken by a post (none by a timeout)
        for _ in range(sent + nthreads):
            rx.recv(timeout=WAIT).release()
        for t in threads:
            t.join(WAIT)
    assert all(not t.is_alive() for t in threads)
    assert all(isinstance(results[i], int) for i in range(nthreads)), results
    assert _space_waiters(ch) == 0


def _blocked_threads(name: str, nthreads: int) -> None:
    """A producer process whose threads all block in send on a full channel."""
    tx = shmchan.Sender.open(name)
    threads = [
        threading.Thread(target=tx.send, args=(PAYLOAD, ("k", i), WAIT)) for i in range(nthreads)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.timeout(60)
def test_a_sender_killed_while_waiting_for_space_stops_counting_once_reaped(
    make_channel: Callable[..., Any],
) -> None:
    """A producer SIGKILLed while its threads wait for space: the receiver's upkeep reaps
    its registry entry and takes its waiters out of space_waiters, which would otherwise
    stay up for good (the receiver posting the senders' semaphore for nobody)."""
    ch = make_channel(capacity=CAPACITY)
    _fill(ch.sender())
    p = CTX.Process(target=_blocked_threads, args=(ch.name, 2))
    with running(p):
        assert _until(lambda: _space_waiters(ch) == 2, WAIT), _space_waiters(ch)
        p.kill()
        p.join(WAIT)
    rx = ch.receiver()  # nothing received: the ring stays full, only upkeep runs
    assert _until(lambda: rx.maintain() >= 0 and _space_waiters(ch) == 0, 5.0), (
        f"space_waiters stayed at {_space_waiters(ch)} after its waiters' process died"
    )


_REAPER = r"""
import sys
import shmchan
from shmchan._lib import lib
notify, wait, name, entry, token = sys.argv[1:]
ch = shmchan.Channel.open(name)
lib.shm_test_pause_at(lib.SHM_PAUSE_PRODUCER_REAP, int(notify), int(wait))
print("reap", lib.shm_producer_reap(ch._seg.ptr, int(entry), int(token)), flush=True)
"""


def _registry_owners(ch: Any) -> list[int]:
    """The owner word of every producer registry entry (csrc/core.h shm_producer)."""
    mem = ch._seg.mem
    (base,) = mem[_fact("header.producers_off") :][:8].cast("Q")
    (count,) = mem[_fact("header.max_producers") :][:4].cast("I")
    size, at = _fact("producer.size"), _fact("producer.owner")
    return [int.from_bytes(mem[base + i * size + at :][:8], "little") for i in range(count)]


@pytest.mark.timeout(60)
def test_a_reap_cut_short_by_the_reapers_death_is_finished_by_the_next_upkeep(
    make_channel: Callable[..., Any],
) -> None:
    """A reaper killed right after marking a dead producer's registry entry (the core's
    pause point) leaves the entry marked: the receiver's upkeep finishes the reap, takes
    the dead producer's wait out of space_waiters and frees the entry for reuse."""
    ch = make_channel(capacity=CAPACITY, max_producers=8)
    _fill(ch.sender())
    p = CTX.Process(target=_blocked_threads, args=(ch.name, 1))
    with running(p):
        assert _until(lambda: _space_waiters(ch) == 1, WAIT), _space_waiters(ch)
        dead_pid = p.pid
        p.kill()
        p.join(WAIT)
    owners = _registry_owners(ch)
    (entry,) = [i for i, t in enumerate(owners) if t >> 40 == dead_pid]
    r_notify, w_notify = os.pipe()
    r_wait, w_wait = os.pipe()
    # the reaper of that entry (as reap_dead_producers would call it, found dead)
    args = [str(w_notify), str(r_wait), ch.name, str(entry), str(owners[entry])]
    reaper = subprocess.Popen(
        [sys.executable, "-c", _REAPER, *args],
        pass_fds=(w_notify, r_wait),
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([r_notify], [], [], WAIT)
        reaper.kill()  # killed between marking the entry and freeing it
        out, _ = reaper.communicate(timeout=WAIT)
        assert ready, f"the reaper never reached its pause point: {out!r}"
    finally:
        if reaper.poll() is None:
            reaper.kill()
            reaper.wait(WAIT)
        for fd in (r_notify, w_notify, r_wait, w_wait):
            os.close(fd)
    assert _registry_owners(ch)[entry] >> 63 == 1  # marked, by a reaper now dead
    assert _space_waiters(ch) == 1
    rx = ch.receiver()
    assert _until(lambda: rx.maintain() >= 0 and _registry_owners(ch)[entry] == 0, 5.0), (
        f"entry {entry} still held: {_registry_owners(ch)[entry]:#x}"
    )
    assert _space_waiters(ch) == 0


@pytest.mark.timeout(120)
def test_a_woken_sender_refused_again_does_not_keep_the_wake_up_from_one_that_fits(
    make_channel: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two senders wait on a full ring: first one whose message needs 60 % of it, then one
    of 64 bytes. A release frees 40 %: the one post goes to the first waiter, which is
    refused again and goes back to sleep. The wake-up must still reach the second, whose
    message fits (with the periodic look disabled, it would wait out its timeout, and
    its last look then finds the room)."""
    monkeypatch.setattr(_segment, "MAINTENANCE_SECONDS", 3600.0)
    ch = make_channel(capacity=CAPACITY)
    tx, rx = ch.sender(), ch.receiver()
    sent = _fill(tx)
    handles = []
    while len(handles) < sent:
        handles += rx.recv_many(sent, timeout=WAIT)
    results: dict[str, object] = {}

    def send(what: str, size: int, timeout: float) -> None:
        try:
            results[what] = tx.send(bytes(size), what, timeout=timeout)
        except BaseException as e:  # reported to the test, which fails on it
            results[what] = e

    big = threading.Thread(target=send, args=("big", CAPACITY * 6 // 10, 60.0), daemon=True)
    small = threading.Thread(target=send, args=("small", 64, 60.0), daemon=True)
    try:
        big.start()
        assert _until(lambda: _space_waiters(ch) == 1), "the big send is not waiting"
        small.start()
        assert _until(lambda: _space_waiters(ch) == 2), "the small send is not waiting"
        rx.release_many(handles[: len(handles) * 4 // 10])  # a quarter free, not 60 %
        small.join(10.0)  # milliseconds once woken; asleep, it waits out its 60 s
        assert not small.is_alive(), "the small send slept on with room for it"
        assert isinstance(results.get("small"), int), results
    finally:
        rx.release_many(handles)  # the rest: the big one fits too
        big.join(WAIT)
        small.join(WAIT)
    assert isinstance(results.get("big"), int), results
    rx.close()
