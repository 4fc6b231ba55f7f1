"""The look-ahead: a message on free keys behind a backlog that may not park within the
tables' budget is still received, and the tables stay within their tenth of the ring.

A backlog whose messages each carry a held hot key and a key of their own would cost a
key table entry per message if the receiver parked all of it; it parks only as far as
the tables' budget allows and looks further ahead, in its own memory, for a message that
may go (csrc/lookahead.c). These tests check that such a message is received while the
hot key is held, that the tables stay within their budget meanwhile, and that what was
taken in ahead of the scan keeps every order and survives a receiver's death.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import shmchan
from tests.procs import WAIT, check_core, child_env, layout_fact, take_receiver_seat

MiB = 1 << 20
DEV_SHM = "/dev/shm"
FLOOR = 64 << 10  # the tables' first chunks, committed at create (budget.c)


def _tables_and_ring(name: str) -> tuple[int, int]:
    """(bytes of the tables committed, bytes of the ring committed), as Stats reports them
    (test_footprint checks that those are the header's marks)."""
    ch = shmchan.Channel.open(name)
    try:
        st = ch.stats()
    finally:
        ch.close()
    return st.table_bytes, st.ring_committed_bytes


def _hold_hot(ch: Any, rx: Any) -> Any:
    with ch.sender() as tx:
        tx.send(b"hot", keys=("hot",))
    h = rx.recv(timeout=WAIT)
    assert h.keys == ("hot",)
    return h


def _polled_seqs(rx: Any, polls: int = 20) -> list[int]:
    """The seqs `polls` calls of try_recv hand out, each released once all are in."""
    got = [h for h in (rx.try_recv() for _ in range(polls)) if h is not None]
    for h in got:
        h.release()
    return [h.seq for h in got]


def _drain(rx: Any, n: int) -> list[Any]:
    """n messages, one handle at a time, as (seq, keys, payload)."""
    got = []
    for _ in range(n):
        with rx.recv(timeout=WAIT) as h:
            got.append((h.seq, h.keys, h.payload))
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=0.2)
    return got


@pytest.fixture
def stopped_scan(make_channel: Any) -> Iterator[Callable[[int], tuple[Any, ...]]]:
    """make(keys): a channel whose receiver holds "hot" and parks records on at most `keys`
    keys that have nothing but parked records (a test setting), with ten messages on
    ("hot", a new key) behind "hot": the scan stops among them. Returns (ch, rx, tx, hot,
    the ten seqs)."""
    from shmchan._lib import lib

    made: list[tuple[Any, Any]] = []

    def make(keys: int) -> tuple[Any, ...]:
        assert lib.shm_test_park_keys(keys) == 0
        ch = make_channel(capacity=4 * MiB)
        rx = ch.receiver()
        hot = _hold_hot(ch, rx)
        tx = ch.sender()
        made.append((tx, rx))
        backlog = tx.send_many([(i, ("hot", f"u{i}")) for i in range(10)])
        return ch, rx, tx, hot, backlog

    try:
        yield make
    finally:
        assert lib.shm_test_park_keys(0) == 0
        for tx, rx in made:
            tx.close()
            rx.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_a_free_key_behind_a_backlog_of_new_keys_goes_and_the_tables_keep_their_budget(
    make_channel: Any, order: str
) -> None:
    capacity = 16 * MiB
    ch = make_channel(capacity=capacity, order=order)
    rx = ch.receiver()
    hot = _hold_hot(ch, rx)
    tx = ch.sender()
    sent: list[int] = []
    worst = 0.0
    while ch.stats().used_bytes < capacity // 4:  # about 30 000 messages
        batch = [(len(sent) + j, ("hot", f"u{len(sent) + j}")) for j in range(500)]
        sent += tx.send_many(batch, timeout=WAIT)
        assert rx.try_recv() is None  # a poll: everything waits for "hot"
        tables, ring = _tables_and_ring(ch.name)
        assert tables <= max(ring // 10, FLOOR), (len(sent), tables, ring)
        worst = max(worst, tables / ring)
    print(f"{order}: {len(sent)} waiting, worst tables' share {100 * worst:.1f} %")
    free = tx.send(b"free", keys=("free",))
    h = rx.recv(timeout=WAIT)  # while "hot" is held
    assert (h.seq, h.payload) == (free, b"free")
    tables, ring = _tables_and_ring(ch.name)
    assert tables <= max(ring // 10, FLOOR) + 4096, (tables, ring)  # its slot, at most
    h.release()
    check_core(rx)
    hot.release()
    got = _drain(rx, len(sent))
    # every message exactly once, in seq order (they all share "hot")
    assert [g[0] for g in got] == sent
    assert [g[2] for g in got] == list(range(len(sent)))
    st = ch.stats()
    assert (st.queued, st.inflight, st.released) == (0, 0, len(sent) + 2)
    tx.close()
    rx.close()


@pytest.mark.timeout(120)
def test_a_sequence_on_a_free_key_keeps_flowing_behind_a_backlog_of_new_keys(
    make_channel: Any,
) -> None:
    # Each message on "cold" goes as soon as the one before it is released, though the
    # second is behind the first on its key: the look-ahead passes it while the first is
    # out, and looks again after the release.
    ch = make_channel(capacity=4 * MiB)
    rx = ch.receiver()
    hot = _hold_hot(ch, rx)
    tx = ch.sender()
    n = 6000
    first = tx.send_many([(i, ("hot", f"u{i}")) for i in range(n)])
    cold = [tx.send(f"c{i}", keys=("cold", f"v{i}")) for i in range(20)]
    second = tx.send_many([(n + i, ("hot", f"w{i}")) for i in range(n)])
    for seq in cold:
        h = rx.recv(timeout=WAIT)
        assert h.seq == seq, (h.seq, cold)
        h.release()
    assert rx.try_recv() is None
    check_core(rx)
    hot.release()
    got = _drain(rx, 2 * n)
    assert [g[0] for g in got] == first + second
    tx.close()
    rx.close()


@pytest.mark.timeout(120)
def test_what_the_look_ahead_passes_keeps_its_order_on_every_key(stopped_scan: Any) -> None:
    # Behind the stopped scan: a message on ("a", "b"), then one on "b", then one on
    # "c". The look-ahead takes the first (free); the second shares "b" with it and waits
    # for its release; "c" is free. Order on "b" is kept.
    ch, rx, tx, hot, backlog = stopped_scan(2)
    ab = tx.send(b"ab", keys=("a", "b"))
    b = tx.send(b"b", keys=("b",))
    c = tx.send(b"c", keys=("c",))
    h1 = rx.recv(timeout=WAIT)
    assert h1.seq == ab
    h2 = rx.recv(timeout=WAIT)
    assert h2.seq == c  # "b" waits behind ab, which is out
    assert rx.try_recv() is None
    check_core(rx)
    h1.release()
    h3 = rx.recv(timeout=WAIT)
    assert h3.seq == b
    h2.release()
    h3.release()
    check_core(rx)
    hot.release()
    assert [g[0] for g in _drain(rx, 10)] == backlog


@pytest.mark.timeout(120)
def test_the_look_ahead_leaves_paused_and_delayed_messages_to_the_scan(stopped_scan: Any) -> None:
    ch, rx, tx, hot, backlog = stopped_scan(1)
    ch.pause_key("p")
    p = tx.send(b"p", keys=("p",))
    d = tx.send(b"d", keys=("d",), delay=0.5)
    free = tx.send(b"free", keys=("free",))
    h = rx.recv(timeout=WAIT)
    assert h.seq == free  # past the paused and the delayed one
    h.release()
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=0.3)  # "p" is paused, "d" not due
    check_core(rx)
    ch.resume_key("p")
    hot.release()
    got = [g[0] for g in _drain(rx, 12)]
    assert sorted(got) == sorted([*backlog, p, d])
    assert [s for s in got if s in backlog] == backlog


@pytest.mark.timeout(120)
def test_inspecting_a_message_taken_in_ahead_of_the_scan(stopped_scan: Any) -> None:
    ch, rx, tx, hot, waiting = stopped_scan(1)
    free = tx.send(b"free", keys=("free",))
    h = rx.recv(timeout=WAIT)
    assert h.seq == free
    held = {k.key: k.seq for k in ch.held()}
    assert held == {"hot": hot.seq, "free": free}
    lines = {line.key: line.depth for line in ch.waiting(top=5)}
    assert lines.get("hot") == len(waiting) and "free" not in lines
    why = ch.why_waiting(waiting[-1])
    assert why is not None
    h.release()
    hot.release()
    assert len(_drain(rx, 10)) == 10


_VICTIM = """
    import os, sys, time
    import shmchan
    from shmchan._lib import lib
    name, w = sys.argv[1], int(sys.argv[2])
    lib.shm_test_park_keys(8)      # the scan stops early, whatever the budget allows
    rx = shmchan.Channel.open(name).receiver()
    hot = rx.recv(timeout=30)      # "hot": the backlog behind it waits
    h = rx.recv(timeout=30)        # taken in ahead of the scan
    os.write(w, f"{hot.seq} {h.seq} {h.payload!r}\\n".encode())
    time.sleep(120)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("rebuild", [False, True], ids=["carry-on", "rebuild"])
def test_a_receiver_killed_holding_a_message_taken_in_ahead_loses_nothing(
    make_channel: Any, rebuild: bool
) -> None:
    ch = make_channel(capacity=4 * MiB)
    tx = ch.sender()
    tx.send(b"hot", keys=("hot",))
    n = 4000
    backlog = tx.send_many([(i, ("hot", f"u{i}")) for i in range(n)])
    free = [tx.send(f"f{i}", keys=("free",)) for i in range(3)]  # one key: in order
    r, w = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_VICTIM), ch.name, str(w)],
        pass_fds=(w,),
        env=child_env(),
    )
    try:
        os.close(w)
        with os.fdopen(r) as f:
            line = f.readline()
        hot_seq, taken_seq, payload = line.split(" ", 2)
        assert int(taken_seq) == free[0] and payload.strip() == "'f0'", line
        child.send_signal(signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
    if rebuild:  # as if it had died inside an operation: the next receiver rebuilds
        with open(os.path.join(DEV_SHM, f"shmchan.{ch.name}"), "r+b") as seg:
            os.pwrite(seg.fileno(), (1).to_bytes(4, "little"), layout_fact("header.dirty"))
    rx = take_receiver_seat(ch)
    check_core(rx)
    got = []
    deadline = time.monotonic() + 60
    while len(got) < n + 4 and time.monotonic() < deadline:
        try:
            h = rx.recv(timeout=5)
        except shmchan.Empty:
            break
        got.append((h.seq, h.attempt, h.keys))
        h.release()
    seqs = [g[0] for g in got]
    assert sorted(seqs) == sorted([int(hot_seq), *backlog, *free])  # each exactly once
    on_hot = [g[0] for g in got if "hot" in g[2]]
    assert on_hot == [int(hot_seq), *backlog]  # per-key order kept
    assert [g[0] for g in got if "free" in g[2]] == free
    attempts = {g[0]: g[1] for g in got}
    assert attempts[free[0]] == 2 and attempts[int(hot_seq)] == 2  # redelivered
    check_core(rx)
    rx.close()
    tx.close()


@pytest.mark.timeout(120)
def test_a_backlog_of_delayed_messages_keeps_the_tables_budget(make_channel: Any) -> None:
    # Delayed messages on distinct keys are not needed before their time: the receiver
    # takes them in only within the budget and leaves the rest in the ring; a message on a
    # free key behind them goes at once, and each delayed one comes out once it is due.
    capacity = 4 * MiB
    ch = make_channel(capacity=capacity)
    rx = ch.receiver()
    tx = ch.sender()
    delayed: list[int] = []
    sent_at = time.monotonic()
    while ch.stats().used_bytes < capacity // 4:  # about 7 000 messages
        delayed += [
            tx.send(b"x" * 64, keys=(f"u{len(delayed) + j}",), delay=2.0) for j in range(500)
        ]
        assert rx.try_recv() is None  # a poll: nothing is due yet
        tables, ring = _tables_and_ring(ch.name)
        assert tables <= max(ring // 10, FLOOR), (len(delayed), tables, ring)
    free = tx.send(b"free", keys=("free",))
    with rx.recv(timeout=WAIT) as h:
        assert h.seq == free
    assert time.monotonic() - sent_at < 2.0 or pytest.skip("the machine was too slow to tell")
    got = []
    while len(got) < len(delayed):
        with rx.recv(timeout=WAIT) as h:
            got.append(h.seq)
    assert time.monotonic() - sent_at >= 2.0  # none came before its time
    assert sorted(got) == delayed
    tx.close()
    rx.close()


@pytest.mark.timeout(120)
def test_a_delayed_message_left_in_the_ring_wakes_the_receiver_when_due(stopped_scan: Any) -> None:
    # The tables' budget is spent by a backlog of new keys behind a held "hot"; then
    # messages delayed 30 s, then messages delayed 0.5 s. The first are taken in as far
    # as the budget allows, the rest left in the ring; a recv that blocks must return a
    # 0.5 s message once it falls due, though nothing on the delayed list is due for 30 s.
    ch, rx, tx, hot, backlog = stopped_scan(1)
    long_ = [tx.send(b"long", keys=(f"l{i}",), delay=30) for i in range(3000)]
    short = [tx.send(b"short", keys=(f"s{i}",), delay=0.5) for i in range(20)]
    assert rx.try_recv() is None
    h = rx.recv(timeout=10)
    assert h.seq in short
    h.release()
    for _ in range(19):
        with rx.recv(timeout=WAIT) as h:
            assert h.seq in short
    check_core(rx)
    hot.release()
    assert [g[0] for g in _drain(rx, len(backlog))] == backlog
    assert ch.stats().queued == len(long_)


@pytest.mark.timeout(180)
def test_free_traffic_past_a_stopped_scan_never_runs_the_ring_out_of_space(
    make_channel: Any,
) -> None:
    # The scan stops at a backlog of new keys behind a held "hot"; free messages after it
    # go through the look-ahead and are released, three rings' worth. Their bytes lie past
    # the stopped scan; once the ring runs short of space the receiver parks the backlog
    # after all (past the tables' budget), so that its space can be reclaimed: no send
    # waits for "hot".
    capacity = 1 * MiB
    ch = make_channel(capacity=capacity)
    rx = ch.receiver()
    hot = _hold_hot(ch, rx)
    tx = ch.sender()
    backlog = tx.send_many([(i, ("hot", f"u{i}")) for i in range(2000)])
    assert rx.try_recv() is None
    payload = b"f" * 1000
    for i in range(3 * capacity // len(payload)):
        seq = tx.send(payload, keys=("free", f"v{i}"), timeout=WAIT)  # shmchan.Full: failed
        with rx.recv(timeout=WAIT) as h:
            assert h.seq == seq
    check_core(rx)
    hot.release()
    assert [g[0] for g in _drain(rx, len(backlog))] == backlog


@pytest.mark.timeout(120)
def test_a_dead_letter_ahead_of_the_scan_frees_its_key_for_what_the_look_ahead_passed(
    make_channel: Any,
) -> None:
    # Behind the stopped scan: m on "k", then x on "k". The look-ahead takes m in and
    # passes x (m holds "k"). m comes back out of attempts: a dead letter, its key free,
    # but nothing released. x must still go.
    from shmchan._lib import lib

    assert lib.shm_test_park_keys(1) == 0
    try:
        ch = make_channel(capacity=4 * MiB, max_attempts=1)
        rx = ch.receiver()
        hot = _hold_hot(ch, rx)
        tx = ch.sender()
        backlog = tx.send_many([(i, ("hot", f"u{i}")) for i in range(10)])
        m = tx.send(b"m", keys=("k",))
        x = tx.send(b"x", keys=("k",))
        h = rx.recv(timeout=WAIT)
        assert h.seq == m
        assert rx.try_recv() is None  # x waits behind m on "k"
        h.nack()  # out of attempts: a dead letter, "k" free
        assert [d.seq for d in ch.dead_letters()] == [m]
        seqs = _polled_seqs(rx)
        assert seqs == [x], f"x ({x}) on free key 'k' not handed out: {seqs}"
        check_core(rx)
        hot.release()
        assert [g[0] for g in _drain(rx, 10)] == backlog
        tx.close()
        rx.close()
    finally:
        assert lib.shm_test_park_keys(0) == 0


@pytest.mark.timeout(120)
def test_a_resumed_key_lets_the_look_ahead_take_what_it_passed(stopped_scan: Any) -> None:
    # The look-ahead passes p (its key paused) and reaches the tail; the resume, with no
    # release since, must still let p go while the scan stays stopped.
    ch, rx, tx, hot, backlog = stopped_scan(1)
    ch.pause_key("p")
    p = tx.send(b"p", keys=("p",))
    assert rx.try_recv() is None  # p passed: paused
    ch.resume_key("p")
    seqs = _polled_seqs(rx)
    assert seqs == [p], f"p ({p}), resumed, not handed out: {seqs}"
    hot.release()
    assert [g[0] for g in _drain(rx, 10)] == backlog
