"""Senders waiting for space are woken by a rationed rule (csrc/ring.c, "senders waiting
for space"): no wake-up before a quarter of the ring is free, at most one post per receive
call or release, a post only when none is pending, passed on by the sender that woke --
and never a sender left asleep while there is room."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from procs import CTX, WAIT, running

import shmchan
from shmchan import channel
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
    channel._MAINTENANCE_SECONDS = 3600.0
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
    monkeypatch.setattr(channel, "_MAINTENANCE_SECONDS", 3600.0)
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
