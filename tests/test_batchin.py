"""A receive of many messages takes a run of new records in and hands each out as it is
taken in (csrc/batchin.c): the same messages, in the same order, under the same key
locks as the one-at-a-time path, whichever calls the producers and the consumer mix."""

from __future__ import annotations

import os
import random
import threading
from typing import Any

import pytest
from procs import (
    check_core,
    drain_checked,
    header_u32,
    receiver_after_kill,
    send_to_a_waiting_receiver,
)

import shmchan

KEYS = ["a", "b", "c", 1, 2, b"z"]


class Model:
    """What the consumer may see: every sent message once; a message only when each
    earlier message on each of its keys was released (fifo), so never two held messages
    sharing a key."""

    def __init__(self) -> None:
        self.keys: dict[int, tuple[Any, ...]] = {}  # seq -> its keys
        self.released: set[int] = set()
        self.delivered: set[int] = set()
        self.held: dict[int, tuple[Any, ...]] = {}

    def sent(self, seq: int, keys: tuple[Any, ...]) -> None:
        self.keys[int(seq)] = keys

    def got(self, seq: int, keys: tuple[Any, ...]) -> None:
        seq = int(seq)
        assert seq in self.keys and seq not in self.delivered, seq
        assert set(keys) == set(self.keys[seq]), (seq, keys, self.keys[seq])
        for k in keys:
            for h, hk in self.held.items():
                assert k not in hk, f"{seq} handed out while {h} holds {k!r}"
            for earlier, ek in self.keys.items():
                if earlier < seq and k in ek:
                    assert earlier in self.released, f"{seq} before {earlier} on {k!r}"
        self.delivered.add(seq)
        self.held[seq] = keys

    def release(self, seq: int) -> None:
        seq = int(seq)
        del self.held[seq]
        self.released.add(seq)


def _keys_of(rnd: random.Random) -> tuple[Any, ...]:
    r = rnd.random()
    if r < 0.15:
        return ()
    if r < 0.75:
        return (rnd.choice(KEYS),)
    return tuple(dict.fromkeys(rnd.sample(KEYS, 2)))


def _send_arg(keys: tuple[Any, ...]) -> Any:
    return keys[0] if len(keys) == 1 else keys


@pytest.mark.parametrize("order_seed", range(6))
def test_mixed_sends_and_receives_keep_per_key_order_and_locks(
    make_channel: Any, order_seed: int
) -> None:
    rnd = random.Random(order_seed)
    ch = make_channel(capacity=1 << 20)
    tx, rx = ch.sender(), ch.receiver()
    m = Model()
    handles: list[Any] = []  # Handles held
    batches: list[Any] = []  # (Batch, [seq per index]) with messages still held

    def take_batch(b: Any) -> None:
        seqs = [int(s) for s in b.seqs]
        for i, s in enumerate(seqs):
            m.got(s, b.keys(i))
        batches.append((b, seqs, set(range(len(seqs)))))

    for step in range(400):
        if step % 50 == 0:
            check_core(rx)
        op = rnd.random()
        if op < 0.2:
            keys = _keys_of(rnd)
            m.sent(tx.send(b"s", keys=keys), keys)
        elif op < 0.4:
            ks = [_keys_of(rnd) for _ in range(rnd.randint(1, 40))]
            seqs = tx.send_batch(b"b" * len(ks), [1] * len(ks), [_send_arg(k) for k in ks])
            for s, k in zip(seqs, ks, strict=True):
                m.sent(s, k)
        elif op < 0.5:
            h = rx.try_recv()
            if h is not None:
                m.got(h.seq, h.keys)
                handles.append(h)
        elif op < 0.6:
            try:
                hs = rx.recv_many(rnd.randint(1, 64), timeout=0)
            except shmchan.Empty:
                hs = []
            for h in hs:
                m.got(h.seq, h.keys)
                handles.append(h)
        elif op < 0.75:
            try:
                take_batch(rx.recv_batch(rnd.randint(1, 64), timeout=0))
            except shmchan.Empty:
                pass
        elif handles and op < 0.85:
            h = handles.pop(rnd.randrange(len(handles)))
            m.release(h.seq)
            h.release()
        elif batches:
            b, seqs, left = batches[rnd.randrange(len(batches))]
            which = rnd.sample(sorted(left), rnd.randint(1, len(left)))
            if rnd.random() < 0.2:  # one message leaves the batch as a Handle
                i = which[0]
                left.discard(i)
                handles.append(b.handle(i))
            else:
                for i in which:
                    m.release(seqs[i])
                    left.discard(i)
                b.release(which)
            batches[:] = [t for t in batches if t[2]]
    # Release everything and drain: every message comes, once, in key order.
    for h in handles:
        m.release(h.seq)
        h.release()
    for b, seqs, left in batches:
        for i in left:
            m.release(seqs[i])
        b.release()
    while len(m.delivered) < len(m.keys):
        b = rx.recv_batch(rnd.randint(1, 64), timeout=5)
        take_batch(b)
        for s in batches.pop()[1]:
            m.release(s)
        b.release()
    assert m.delivered == set(m.keys)
    assert rx.try_recv() is None
    check_core(rx)


def test_a_run_stops_at_a_record_that_must_wait_and_the_rest_keeps_its_place(
    make_channel: Any,
) -> None:
    ch = make_channel()
    tx, rx = ch.sender(), ch.receiver()
    first = tx.send(b"A", keys="k1")
    held = rx.recv(timeout=5)
    assert held.seq == first
    # B and D are free, C waits for A: one receive hands out B and D, not C.
    seqs = list(tx.send_batch(b"BCD", [1, 1, 1], ["k2", "k1", "k3"]))
    b = rx.recv_batch(10, timeout=5)
    assert b.payloads() == [b"B", b"D"] and list(b.seqs) == [seqs[0], seqs[2]]
    # E on k2 (held by B) waits too; F is free and comes though sent after E.
    tx.send_batch(b"EF", [1, 1], ["k2", "k4"])
    nxt = rx.recv_batch(10, timeout=5)
    assert nxt.payloads() == [b"F"]
    with pytest.raises(shmchan.Empty):
        rx.recv_batch(10, timeout=0.05)
    held.release()  # C may go now; E still waits for B
    c = rx.recv_batch(10, timeout=5)
    assert c.payloads() == [b"C"]
    b.release()
    e = rx.recv_batch(10, timeout=5)
    assert e.payloads() == [b"E"]
    for x in (nxt, c, e):
        x.release()
    assert ch.stats().inflight == 0


def test_one_producers_free_messages_come_in_send_order_whatever_the_receive_sizes(
    make_channel: Any,
) -> None:
    # Small receives leave messages ready in the window; a large one after them must
    # hand those out before any record it has not looked at yet.
    ch = make_channel(capacity=4 << 20)
    tx, rx = ch.sender(), ch.receiver()
    n = 3000
    seqs = list(tx.send_batch(bytes(n), [1] * n, list(range(n))))
    got: list[int] = []
    sizes = [1, 7, 1000, 2, 300]
    while len(got) < n:
        size = sizes[len(got) % len(sizes)]
        if size == 1:
            h = rx.recv(timeout=5)
            got.append(h.seq)
            h.release()
            continue
        b = rx.recv_batch(size, timeout=5)
        got.extend(int(s) for s in b.seqs)
        b.release()
    assert got == seqs


@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_messages_of_many_new_keys_each_hold_every_key_they_were_taken_in_with(
    make_channel: Any, order: str
) -> None:
    # A run takes in a message on keys absent from the table with one probe per key,
    # which the insertion carries on from (sched.c sched_take_in_free). Many keys per
    # message fill the table's probe runs, so a key often finds its insertion point
    # taken by a key of the same message inserted just before it.
    rnd = random.Random(7)
    ch = make_channel(capacity=4 << 20, max_keys=8, order=order)
    tx, rx = ch.sender(), ch.receiver()
    for rnd_round in range(6):
        n = 200
        fresh = rnd.sample(range(10**9), 8 * n)  # no key shared: every message is free
        keys = [tuple(fresh[8 * i : 8 * i + 8]) for i in range(n)]
        seqs = list(tx.send_batch(bytes(n), [1] * n, keys))
        held: list[Any] = []
        got: list[int] = []
        while len(got) < n:  # all free, so all come, in send order
            held.append(rx.recv_batch(n, timeout=5))
            got.extend(int(s) for s in held[-1].seqs)
        assert got == seqs, rnd_round
        check_core(rx)
        # Every key of every held message is locked: a message on any one of them waits.
        probes = [k[rnd.randrange(8)] for k in keys[:50]]
        tx.send_batch(bytes(50), [1] * 50, probes)
        with pytest.raises(shmchan.Empty):
            rx.recv_batch(50, timeout=0)
        for b in held:
            b.release()
        later = rx.recv_batch(50, timeout=5)
        assert len(later) == 50
        later.release()
        check_core(rx)
    assert ch.stats().inflight == 0 and ch.stats().held_keys == 0


def _within_committed(ch: Any) -> None:
    """Every slot and node the receiver ever used lies in what its tables committed."""
    assert header_u32(ch, "header.fresh_slots") <= header_u32(ch, "header.slots_committed")
    assert header_u32(ch, "header.fresh_nodes") <= header_u32(ch, "header.nodes_committed")


@pytest.mark.parametrize("nkeys", [0, 1, 8])
def test_a_run_stops_where_the_committed_tables_end_and_the_general_poll_goes_on(
    make_channel: Any, nkeys: int
) -> None:
    # The run counts the tables' room once and takes off each message's share: it must
    # stop where the committed slots, nodes or key entries end, never use a slot or a
    # node beyond them (the general poll commits more, within the tables' budget). Each
    # round asks for more than the last, so every round's run meets that end.
    ch = make_channel(capacity=8 << 20, max_keys=8)
    tx, rx = ch.sender(), ch.receiver()
    for n in (40, 100, 250, 600, 1500):
        keys = [tuple(range(i * 8, i * 8 + nkeys)) for i in range(n)]
        seqs = list(tx.send_batch(bytes(n), [1] * n, keys))
        held: list[Any] = []
        got: list[int] = []
        while len(got) < n:
            held.append(rx.recv_batch(n, timeout=5))
            got.extend(int(s) for s in held[-1].seqs)
            _within_committed(ch)
        assert got == seqs
        check_core(rx)
        for b in held:
            b.release()


def test_a_run_stops_where_the_window_is_full_and_goes_on_after_a_release(
    make_channel: Any,
) -> None:
    ch = make_channel(capacity=4 << 20, max_messages=64)
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"x", keys="held")
    first = rx.recv(timeout=5)  # it stays out: the window has 63 slots for the runs
    seqs = list(tx.send_batch(bytes(300), [1] * 300, [(i,) for i in range(300)]))
    got: list[int] = []
    while len(got) < 300:
        b = rx.recv_batch(300, timeout=5)
        assert len(b) <= 63
        got.extend(int(s) for s in b.seqs)
        check_core(rx)
        b.release()
    assert got == seqs
    first.release()


_RUN_VICTIM = """
    import sys
    import shmchan
    from shmchan._lib import lib
    name, notify, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rx = shmchan.Channel.open(name).receiver()
    lib.shm_test_pause_at(lib.SHM_PAUSE_RUN_TAKEN, notify, wait)
    rx.recv_batch(100, timeout=10)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_a_receiver_killed_between_a_runs_take_in_and_hand_out_loses_nothing(
    chan_name: str, order: str
) -> None:
    # The run hands a message out straight from its take-in, with no READY state
    # between: killed there, the slot is FREE while the record and the key table name
    # it. The next receiver rebuilds and hands every message out once, in key order.
    ch = shmchan.Channel.create(chan_name, capacity=1 << 20, order=order)
    try:
        tx = ch.sender()
        seqs = list(tx.send_batch(bytes(20), [1] * 20, [f"k{i % 10}" for i in range(20)]))
        rx = receiver_after_kill(ch, _RUN_VICTIM, chan_name, "a run's second take-in")
        got: list[tuple[int, int]] = []
        while len(got) < 20:
            b = rx.recv_batch(100, timeout=10)
            got.extend(zip((int(s) for s in b.seqs), (int(a) for a in b.attempts), strict=True))
            check_core(rx)
            b.release()
        assert sorted(s for s, _ in got) == seqs  # each once
        if order == "fifo":
            assert [s for s, _ in got] == seqs  # k0..k9, then k0..k9 again
        # the first was handed out to the dead receiver: its second attempt
        assert dict(got)[seqs[0]] == 2 and all(a == 1 for s, a in got if s != seqs[0])
        assert ch.stats().inflight == 0
        rx.close()
    finally:
        ch.close()
        shmchan.unlink(chan_name)


_RECV_VICTIM = """
    import sys
    import shmchan
    from shmchan._lib import lib
    name, notify, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rx = shmchan.Channel.open(name).receiver()
    rx.recv(timeout=10).release()
    held = rx.recv(timeout=10)  # kept: the dead receiver's, redelivered
    lib.shm_test_pause_at(lib.SHM_PAUSE_RECV_TAKEN, notify, wait)
    rx.recv(timeout=10)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_a_receiver_killed_between_a_single_recvs_take_in_and_hand_out_loses_nothing(
    chan_name: str, order: str
) -> None:
    # A single recv also takes a free-key message straight from the ring to its
    # hand-out. Killed between the two: one message released, one out, one taken in
    # with its slot FREE. The next receiver hands out every unreleased message once, the
    # one that was out with its second attempt, and key order holds.
    ch = shmchan.Channel.create(chan_name, capacity=1 << 20, order=order)
    try:
        tx = ch.sender()
        seqs = [tx.send(bytes([i]), keys=f"k{i % 3}") for i in range(9)]
        rx = receiver_after_kill(ch, _RECV_VICTIM, chan_name, "a single recv's take-in")
        assert (ch.stats().released, ch.stats().queued) == (1, 8)
        got = drain_checked(rx)
        assert sorted(s for s, _, _ in got) == seqs[1:]  # each once, the released one gone
        assert all(p == bytes([seqs.index(s)]) for s, _, p in got)
        assert {s: a for s, a, _ in got} == {s: 2 if s == seqs[1] else 1 for s in seqs[1:]}
        if order == "fifo":
            for k in range(3):
                on_key = [s for s, _, _ in got if seqs.index(s) % 3 == k]
                assert on_key == sorted(on_key)
        stats = ch.stats()
        assert (stats.inflight, stats.window, stats.used_bytes) == (0, 0, 0)
        rx.close()
    finally:
        ch.close()
        shmchan.unlink(chan_name)


_SCRIBBLED_VICTIM = """
    import sys
    import shmchan
    from shmchan._lib import lib
    name, notify, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rx = shmchan.Channel.open(name).receiver()
    lib.shm_test_pause_at(lib.SHM_PAUSE_RUN_TAKEN, notify, wait)
    b = rx.recv_batch(3, timeout=10)
    assert b.payloads() == [b"aaaa"], b.payloads()  # the scribbled one is not handed out
    try:
        rx.recv_batch(3, timeout=1)
    except shmchan.ChannelCorrupted:
        sys.exit(3)
    print(rx.recv_batch(3, timeout=1).lengths.tolist())
"""


@pytest.mark.timeout(120)
def test_a_record_scribbled_on_during_a_run_is_refused_not_described_out_of_bounds(
    chan_name: str,
) -> None:
    # The run hands a message out from the check its take-in made: a producer that writes
    # a huge payload length into the record between the two must get the receive refused
    # as corrupt, never a description reaching past the record.
    from procs import child_at_pause, layout_fact

    ch = shmchan.Channel.create(chan_name, capacity=1 << 20)
    try:
        tx = ch.sender()
        tx.send_batch(b"aaaabbbbcccc", [4, 4, 4], ["a", "b", "c"])
        with child_at_pause(_SCRIBBLED_VICTIM, chan_name, "a run's second take-in") as (child, go):
            fd = os.open(f"/dev/shm/shmchan.{chan_name}", os.O_RDWR)
            try:
                ring = int.from_bytes(os.pread(fd, 8, layout_fact("header.ring_off")), "little")
                meta = int.from_bytes(os.pread(fd, 8, ring + layout_fact("record.meta")), "little")
                second = ring + (meta >> 8)  # the record after the first (META_LEN)
                at = second + layout_fact("record.data_len")
                assert int.from_bytes(os.pread(fd, 8, at), "little") == 4
                os.pwrite(fd, (1 << 40).to_bytes(8, "little"), at)
            finally:
                os.close(fd)
            os.write(go, b"\0")
            assert child.wait(30) == 3
    finally:
        ch.close()
        shmchan.unlink(chan_name)


@pytest.mark.timeout(60)
def test_single_recvs_served_by_the_run_let_head_follow_once_a_parked_record_goes(
    make_channel: Any,
) -> None:
    # While B waits behind A's key, thousands of free messages are received one recv at a
    # time, each straight from its take-in (the run), and released: they lie past the
    # parked B, so neither ingest_pos nor head may pass them yet. Once A and B are gone,
    # the recvs that follow must still let ingest_pos walk over them (a few thousand
    # records per poll), or head stays behind them and a consumer that releases every
    # message at once sees its producer's sends refused for a full ring.
    ch = make_channel(capacity=1 << 20)
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"A", keys="k")
    a = rx.recv(timeout=5)
    tx.send(b"B", keys="k")
    assert rx.try_recv() is None  # B parks behind A
    for _ in range(5000):  # more than one poll's walk of ingest_pos (window.c WALK_BATCH)
        tx.send(b"c", keys="x")
        rx.recv(timeout=5).release()
    a.release()
    b = rx.recv(timeout=5)
    assert b.payload == b"B"
    b.release()
    for i in range(30000):  # about three rings' worth, one message out at a time
        try:
            tx.send(b"e", keys="y", timeout=0)
        except shmchan.Full:
            pytest.fail(f"send {i} refused for a full ring with nothing in flight")
        rx.recv(timeout=5).release()
    assert ch.stats().inflight == 0


@pytest.mark.timeout(120)
def test_a_receiver_waiting_in_recv_walks_ingest_pos_all_the_way_for_a_sender_that_needs_it(
    make_channel: Any,
) -> None:
    # While B waits behind A's key, 450 000 keyless messages are received and released:
    # they lie past the parked B, so neither ingest_pos nor head may pass them yet. Once A
    # and B are gone, ingest_pos owes a walk over all of them, WALK_BATCH records a poll.
    # A receiver waiting in recv, woken by a sender that finds the ring full, must finish
    # that walk rather than go back to sleep after one batch with the walk still owed:
    # asleep, it walks one batch per upkeep period (0.1 s), and the sender below, whose
    # message needs almost the whole ring, would wait about ten seconds with nothing
    # queued and nothing in flight.
    capacity = 64 << 20
    ch = make_channel(capacity=capacity)
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"A", keys="k")
    a = rx.recv(timeout=5)
    tx.send(b"B", keys="k")
    assert rx.try_recv() is None  # B parks behind A
    for _ in range(450):
        tx.send_many([(b"c", ())] * 1000)
        rx.release_many(rx.recv_many(1000, timeout=5))
    while True:
        try:
            rx.release_many(rx.recv_many(1000, timeout=0))
        except shmchan.Empty:
            break
    a.release()
    b = rx.recv(timeout=5)
    assert b.payload == b"B"
    b.release()
    st = ch.stats()
    assert (st.queued, st.inflight) == (0, 0)
    assert st.used_bytes > capacity // 3  # finished records head has not passed yet
    send_to_a_waiting_receiver(ch, tx, rx, bytes(capacity - (1 << 20)), timeout=2, keys="y")
    tx.close()
    rx.close()


@pytest.mark.timeout(120)
def test_a_receiver_waiting_in_recv_frees_the_space_behind_a_parked_record_that_left(
    make_channel: Any, monkeypatch: Any
) -> None:
    # As above, but nobody waits for the space: a receiver that goes on waiting in recv
    # must still finish the walk it owes (ingest_pos, then head, over every finished
    # record), not one batch per wake-up. With the upkeep period (the receiver's longest
    # sleep) longer than the test, a receiver that sleeps with the walk owed keeps the
    # space until then.
    from shmchan import _segment

    monkeypatch.setattr(_segment, "MAINTENANCE_SECONDS", 60.0)
    capacity = 64 << 20
    ch = make_channel(capacity=capacity)
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"A", keys="k")
    a = rx.recv(timeout=5)
    tx.send(b"B", keys="k")
    assert rx.try_recv() is None  # B parks behind A
    for _ in range(450):
        tx.send_many([(b"c", ())] * 1000)
        rx.release_many(rx.recv_many(1000, timeout=5))
    while True:
        try:
            rx.release_many(rx.recv_many(1000, timeout=0))
        except shmchan.Empty:
            break
    a.release()
    b = rx.recv(timeout=5)
    assert b.payload == b"B"
    b.release()
    st = ch.stats()
    assert (st.queued, st.inflight) == (0, 0)
    assert st.used_bytes > capacity // 3  # finished records head has not passed yet
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(rx.recv(timeout=30)))
    waiter.start()
    try:
        used = ch.stats().used_bytes
        for _ in range(100):  # 10 s at most; the walk takes milliseconds
            if used < capacity // 100:
                break
            waiter.join(timeout=0.1)
            used = ch.stats().used_bytes
        assert used < capacity // 100, f"{used} bytes still used, nothing queued or in flight"
    finally:
        tx.send(b"end")
        waiter.join(timeout=40)
    assert [h.payload for h in got] == [b"end"]
    got[0].release()
    tx.close()
    rx.close()
