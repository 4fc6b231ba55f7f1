"""The operators' view: held(), waiting(), why_waiting(), read from any process."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
from procs import CTX, WAIT, running

import shmchan
from shmchan import inspect

# --------------------------------------------------------------------------- helpers


def hold_keys(name: str, ready: Any, done: Any) -> None:
    """Child: become the receiver, take one message and hold it until `done`."""
    ch = shmchan.Channel.open(name)
    rx = ch.receiver()
    h = rx.recv(timeout=WAIT)
    ready.set()
    done.wait(WAIT)
    h.release()
    rx.close()


def hold_and_stay_busy(name: str, ready: Any, done: Any) -> None:
    """Child: hold the message on "hot", then send, receive and release other messages
    as fast as it can until `done` (the receiver busy in another process)."""
    ch = shmchan.Channel.open(name)
    rx = ch.receiver()
    tx = ch.sender()
    held = rx.recv(timeout=WAIT)
    ready.set()
    i = 0
    while not done.is_set():
        tx.send(b"x", keys=(f"free{i % 64}",))
        h = rx.try_recv()
        while h is not None:
            h.release()
            h = rx.try_recv()
        i += 1
    held.release()
    rx.close()


def assert_chain_ends_at(chain: inspect.WaitChain, seq: int, pid: int) -> None:
    assert chain.state == "waiting"
    assert chain[-1].state == "in flight"
    assert chain[-1].seq == seq
    assert chain[-1].pid == pid
    assert all(w.state == "waiting" and w.pid is None for w in chain[:-1])


# --------------------------------------------------------------------------- held


def test_held_names_the_holding_process_and_every_key(ch: shmchan.Channel) -> None:
    with ch.sender() as tx:
        seq = tx.send(b"m", keys=("acct:1", 7))
    ready, done = CTX.Event(), CTX.Event()
    p = CTX.Process(target=hold_keys, args=(ch.name, ready, done))
    with running(p):
        assert ready.wait(WAIT)
        first = ch.held()
        time.sleep(0.1)
        later = ch.held()
        done.set()
    assert {(h.key, h.seq, h.pid, h.attempt) for h in first} == {
        ("acct:1", seq, p.pid, 1),
        (7, seq, p.pid, 1),
    }
    assert len(first) == 2
    assert all(0 <= h.age < WAIT for h in first)
    assert later[0].age >= first[0].age + 0.05
    assert all(isinstance(h, shmchan.HeldKey) for h in first)


def test_nothing_is_held_once_released(ch: shmchan.Channel, rx: Any) -> None:
    with ch.sender() as tx:
        tx.send(b"m", keys=("a",))
    h = rx.recv(timeout=WAIT)
    assert [k.key for k in ch.held()] == ["a"]
    h.release()
    assert ch.held() == []


# --------------------------------------------------------------------------- waiting


def test_waiting_lists_the_deepest_lines_first(ch: shmchan.Channel, rx: Any) -> None:
    tx = ch.sender()
    tx.send(b"0", keys=("a",))
    h = rx.recv(timeout=WAIT)
    for _ in range(3):
        tx.send(b"1", keys=("a",))  # sent after the recv: not looked at by the receiver yet
    five = tx.send(b"2", keys=("a", "b"))
    tx.send(b"3", keys=("c",))
    lines = ch.waiting()
    # "c" is free: its message is ready, still not handed out, so it counts
    assert lines == [
        shmchan.Line("a", 4, 2),
        shmchan.Line("b", 1, five),
        shmchan.Line("c", 1, five + 1),
    ]
    rx.recv(timeout=WAIT).release()  # the receiver looks at everything: "c" goes
    assert ch.waiting() == [shmchan.Line("a", 4, 2), shmchan.Line("b", 1, five)]
    assert ch.waiting(top=1) == [shmchan.Line("a", 4, 2)]
    h.release()  # seq 2 is free to go, but not handed out yet
    assert ch.waiting()[0] == shmchan.Line("a", 4, 2)
    assert rx.recv(timeout=WAIT).seq == 2
    assert ch.waiting()[0] == shmchan.Line("a", 3, 3)


def test_waiting_counts_messages_left_out_of_the_window(
    make_channel: Callable[..., shmchan.Channel],
) -> None:
    ch = make_channel(max_messages=16)
    tx, rx = ch.sender(), ch.receiver()
    for _ in range(100):
        tx.send(b"a", keys=("a",))
    h = rx.recv(timeout=WAIT)
    assert rx.try_recv() is None  # the rest waits on "a"; the window holds 16
    assert ch.stats().window <= 16
    assert ch.waiting() == [shmchan.Line("a", 99, 2)]
    chain = ch.why_waiting(100)  # outside the window
    assert [w.seq for w in chain] == list(range(99, 0, -1))
    assert_chain_ends_at(chain, h.seq, os.getpid())
    h.release()
    rx.close()


def test_waiting_validates_top(ch: shmchan.Channel) -> None:
    with pytest.raises(ValueError):
        ch.waiting(top=-1)
    with pytest.raises(TypeError):
        ch.waiting(top=1.5)  # type: ignore[arg-type]
    assert ch.waiting(top=0) == []


# --------------------------------------------------------------------------- why_waiting


def test_why_waiting_follows_the_keys_to_the_holder(ch: shmchan.Channel) -> None:
    tx = ch.sender()
    s1 = tx.send(b"1", keys=("a",))
    s2 = tx.send(b"2", keys=("a", "b"))
    s3 = tx.send(b"3", keys=("b",))
    ready, done = CTX.Event(), CTX.Event()
    p = CTX.Process(target=hold_keys, args=(ch.name, ready, done))
    with running(p):
        assert ready.wait(WAIT)
        chain = ch.why_waiting(s3)
        held = ch.why_waiting(s1)
        done.set()
    assert [(w.key, w.seq, w.state) for w in chain] == [
        ("b", s2, "waiting"),
        ("a", s1, "in flight"),
    ]
    assert_chain_ends_at(chain, s1, p.pid)
    assert chain[-1].attempt == 1 and chain[-1].age is not None
    assert chain.keys == ("b",)
    assert isinstance(chain[0], shmchan.Wait)
    # the holder itself is not waiting: an empty chain that says so
    assert held == [] and held.state == "in flight" and held.pid == p.pid


def test_why_waiting_says_what_a_message_is_when_it_does_not_wait(
    make_channel: Callable[..., shmchan.Channel],
) -> None:
    ch = make_channel(max_attempts=1)
    tx, rx = ch.sender(), ch.receiver()
    done = tx.send(b"d", keys=("a",))
    rx.recv(timeout=WAIT).release()
    dead = tx.send(b"x", keys=("a",))
    rx.recv(timeout=WAIT).nack()
    taken = tx.send(b"r", keys=("b",))
    h = rx.recv(timeout=WAIT)
    assert h.seq == taken
    later = tx.send(b"l", keys=("c",))
    assert ch.why_waiting(done).state == "delivered"
    assert ch.why_waiting(dead).state == "dead letter"
    assert ch.why_waiting(taken).state == "in flight"
    assert ch.why_waiting(taken).pid == os.getpid()
    assert ch.why_waiting(later).state == "ready"  # not looked at yet, nothing ahead
    assert ch.why_waiting(later) == []
    assert ch.why_waiting(later + 100).state == "unknown"
    assert ch.why_waiting(0).state == "unknown"
    rx.close()


def test_views_stay_consistent_while_the_receiver_is_busy_elsewhere(
    ch: shmchan.Channel,
) -> None:
    tx = ch.sender()
    hot = tx.send(b"h", keys=("hot",))
    behind = [tx.send(b"w", keys=("hot", f"other{i}")) for i in range(3)]
    ready, done = CTX.Event(), CTX.Event()
    p = CTX.Process(target=hold_and_stay_busy, args=(ch.name, ready, done))
    with running(p):
        assert ready.wait(WAIT)
        deadline = time.monotonic() + 1.5
        rounds = partial = 0
        delivered = ch.stats().delivered
        while time.monotonic() < deadline:
            held = [h for h in ch.held() if h.key == "hot"]
            assert [(h.seq, h.pid) for h in held] == [(hot, p.pid)]
            line = [x for x in ch.waiting(top=100) if x.key == "hot"]
            assert [(x.depth, x.head_seq) for x in line] == [(3, behind[0])]
            chain = ch.why_waiting(behind[-1])
            if chain.partial:
                # The documented way out when no consistent read came in its tries (a
                # receiver busy on the other core): flagged, never passed off as whole.
                partial += 1
                continue
            assert [w.seq for w in chain] == [behind[1], behind[0], hot], chain
            assert_chain_ends_at(chain, hot, p.pid)
            rounds += 1
        busy = ch.stats().delivered - delivered
        done.set()
    assert rounds >= 3 and rounds >= partial, (rounds, partial)  # mostly whole answers
    assert busy > 100  # the receiver really was working meanwhile


def test_eager_order_reports_holders_and_waiters(
    make_channel: Callable[..., shmchan.Channel],
) -> None:
    ch = make_channel(order="eager")
    tx, rx = ch.sender(), ch.receiver()
    first = tx.send(b"1", keys=("a",))
    h = rx.recv(timeout=WAIT)
    second = tx.send(b"2", keys=("a",))
    assert rx.try_recv() is None
    assert [(k.key, k.seq) for k in ch.held()] == [("a", first)]
    assert ch.waiting() == [shmchan.Line("a", 1, second)]
    chain = ch.why_waiting(second)
    assert [(w.key, w.seq, w.state) for w in chain] == [("a", first, "in flight")]
    h.release()
    rx.close()


def test_producers_lists_live_senders(ch: shmchan.Channel) -> None:
    tx = ch.sender()
    tx.send(b"x")
    tx.send(b"y")
    assert inspect.producers(ch) == [inspect.Producer(os.getpid(), 2, True)]
