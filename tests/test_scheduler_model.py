"""The scheduler: which message may be handed out when.

First small examples of each rule, then a hypothesis state machine that drives
random send / try_recv / release / nack / stale-release sequences against a
reference lock manager written here, for order="fifo" and order="eager".
"""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import shmchan


def drain(rx) -> list:
    """Every handle try_recv gives right now (left live)."""
    out = []
    while (h := rx.try_recv()) is not None:
        out.append(h)
    return out


# --- fifo: examples ------------------------------------------------------------------


def test_fifo_same_key_waits_until_the_holder_releases(tx, rx):
    tx.send(b"1", keys="a")
    tx.send(b"2", keys="a")
    first = rx.recv(timeout=5)
    assert rx.try_recv() is None
    first.release()
    assert rx.recv(timeout=5).payload == b"2"


def test_fifo_hands_out_one_key_in_send_order(tx, rx):
    seqs = [tx.send(i, keys="a") for i in range(30)]
    got = []
    for _ in seqs:
        with rx.recv(timeout=5) as h:
            got.append(h.seq)
    assert got == seqs


def test_fifo_disjoint_keys_are_handed_out_together(tx, rx):
    tx.send(b"1", keys="a")
    tx.send(b"2", keys="b")
    tx.send(b"3", keys=("c", "d"))
    assert sorted(h.payload for h in drain(rx)) == [b"1", b"2", b"3"]


def test_fifo_messages_without_keys_are_never_blocked(tx, rx):
    tx.send(b"held", keys="a")
    tx.send(b"waiting", keys="a")
    tx.send(b"free1")
    tx.send(b"free2", keys=())
    held = rx.recv(timeout=5)
    assert held.payload == b"held"
    assert sorted(h.payload for h in drain(rx)) == [b"free1", b"free2"]


def test_fifo_message_passes_a_blocked_one_with_disjoint_keys(tx, rx):
    tx.send(b"held", keys="a")
    tx.send(b"blocked", keys="a")
    tx.send(b"other", keys="c")
    held = rx.recv(timeout=5)  # kept live: holds "a"
    assert [h.payload for h in drain(rx)] == [b"other"]
    assert held.payload == b"held"


def test_fifo_waiting_multi_key_message_blocks_later_messages_on_its_free_key(tx, rx):
    tx.send(b"m1", keys="a")
    tx.send(b"m2", keys=("a", "b"))  # waits for a
    tx.send(b"m3", keys="b")  # b is free, but m2 is ahead of it on b
    m1 = rx.recv(timeout=5)
    assert rx.try_recv() is None
    m1.release()
    m2 = rx.recv(timeout=5)
    assert m2.payload == b"m2"
    assert rx.try_recv() is None
    m2.release()
    assert rx.recv(timeout=5).payload == b"m3"


def test_fifo_later_multi_key_message_does_not_pass_on_any_key(tx, rx):
    tx.send(b"m1", keys="a")
    tx.send(b"m2", keys=("a", "b"))
    tx.send(b"m3", keys=("b", "c"))  # behind m2 on b
    tx.send(b"m4", keys="c")  # behind m3 on c
    tx.send(b"m5", keys="d")  # disjoint: passes
    held = rx.recv(timeout=5)  # kept live: holds "a"
    assert [h.payload for h in drain(rx)] == [b"m5"]
    assert held.payload == b"m1"


def test_fifo_multi_key_message_waits_for_all_its_keys(tx, rx):
    tx.send(b"a", keys="a")
    tx.send(b"b", keys="b")
    tx.send(b"ab", keys=("a", "b"))
    ha, hb = rx.recv(timeout=5), rx.recv(timeout=5)
    ha.release()
    assert rx.try_recv() is None  # b still held
    hb.release()
    assert rx.recv(timeout=5).payload == b"ab"


def test_fifo_release_in_any_order_hands_out_in_seq_order_per_key(tx, rx):
    tx.send(b"a1", keys="a")
    tx.send(b"b1", keys="b")
    tx.send(b"a2", keys="a")
    tx.send(b"b2", keys="b")
    first = {h.payload: h for h in drain(rx)}
    assert sorted(first) == [b"a1", b"b1"]
    first[b"b1"].release()
    assert [h.payload for h in drain(rx)] == [b"b2"]
    first[b"a1"].release()
    assert [h.payload for h in drain(rx)] == [b"a2"]


def test_fifo_message_sent_while_key_held_waits(tx, rx):
    tx.send(b"1", keys="a")
    first = rx.recv(timeout=5)
    tx.send(b"2", keys="a")
    assert rx.try_recv() is None
    first.release()
    assert rx.recv(timeout=5).payload == b"2"


def test_fifo_keyless_messages_come_in_send_order(tx, rx):
    seqs = [tx.send(i) for i in range(20)]
    assert [h.seq for h in drain(rx)] == seqs


# --- nack ---------------------------------------------------------------------------


def test_nack_redelivers_the_same_seq_with_attempt_plus_one(tx, rx):
    seq = tx.send(b"x", keys="a")
    first = rx.recv(timeout=5)
    assert first.attempt == 1
    first.nack()
    again = rx.recv(timeout=5)
    assert (again.seq, again.attempt, again.payload) == (seq, 2, b"x")


def test_nack_counts_attempts_up(tx, rx):
    tx.send(b"x", keys="a")
    attempts = []
    for _ in range(4):
        h = rx.recv(timeout=5)
        attempts.append(h.attempt)
        h.nack()
    assert attempts == [1, 2, 3, 4]


def test_nacked_message_comes_before_later_messages_on_its_key(tx, rx):
    first_seq = tx.send(b"1", keys="a")
    tx.send(b"2", keys="a")
    rx.recv(timeout=5).nack()
    h = rx.recv(timeout=5)
    assert h.seq == first_seq
    assert rx.try_recv() is None


def test_nacked_multi_key_message_keeps_its_place_on_every_key(tx, rx):
    first_seq = tx.send(b"ab", keys=("a", "b"))
    tx.send(b"b", keys="b")
    tx.send(b"a", keys="a")
    rx.recv(timeout=5).nack()
    assert [h.seq for h in drain(rx)] == [first_seq]


def test_nacked_message_without_keys_is_redelivered(tx, rx):
    seq = tx.send(b"x")
    rx.recv(timeout=5).nack()
    h = rx.recv(timeout=5)
    assert (h.seq, h.attempt) == (seq, 2)


def test_nack_frees_the_keys_until_redelivery(ch, tx, rx):
    tx.send(b"x", keys=("a", "b"))
    rx.recv(timeout=5).nack()
    st = ch.stats()
    assert (st.inflight, st.held_keys, st.queued) == (0, 0, 1)


# --- stale handles ---------------------------------------------------------------------


def test_second_release_does_not_free_the_next_holders_key(tx, rx):
    tx.send(b"1", keys="a")
    tx.send(b"2", keys="a")
    tx.send(b"3", keys="a")
    h1 = rx.recv(timeout=5)
    h1.release()
    h2 = rx.recv(timeout=5)
    h1.release()  # stale: no-op
    h1.ack()
    assert rx.try_recv() is None
    h2.release()
    assert rx.recv(timeout=5).payload == b"3"


def test_release_of_a_nacked_handle_does_not_free_the_redelivered_one(tx, rx):
    tx.send(b"1", keys="a")
    tx.send(b"2", keys="a")
    old = rx.recv(timeout=5)
    old.nack()
    new = rx.recv(timeout=5)
    old.release()  # stale: its message was redelivered
    assert rx.try_recv() is None
    new.release()
    assert rx.recv(timeout=5).payload == b"2"


def test_nack_of_a_stale_handle_does_not_requeue_the_live_one(tx, rx):
    seq = tx.send(b"1", keys="a")
    old = rx.recv(timeout=5)
    old.nack()
    new = rx.recv(timeout=5)
    old.nack()  # stale: no-op
    assert rx.try_recv() is None
    new.release()
    assert rx.try_recv() is None
    assert new.seq == seq


# --- eager -------------------------------------------------------------------------------


def test_eager_later_message_passes_a_blocked_multi_key_one(make_channel):
    ch = make_channel(order="eager")
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(b"m1", keys="a")
        tx.send(b"m2", keys=("a", "b"))
        tx.send(b"m3", keys="b")
        held = rx.recv(timeout=5)  # kept live: holds "a"
        assert [h.payload for h in drain(rx)] == [b"m3"]
        assert held.payload == b"m1"


def test_eager_never_hands_out_two_messages_sharing_a_key(make_channel):
    ch = make_channel(order="eager")
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(b"1", keys=("a", "b"))
        tx.send(b"2", keys="b")
        tx.send(b"3", keys=("c", "a"))
        assert [h.payload for h in drain(rx)] == [b"1"]


def test_eager_blocked_message_is_handed_out_once_its_keys_are_free(make_channel):
    ch = make_channel(order="eager")
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(b"1", keys="a")
        tx.send(b"2", keys="a")
        rx.recv(timeout=5).release()
        assert rx.recv(timeout=5).payload == b"2"


# --- the model ---------------------------------------------------------------------------

KEY_POOL = ["a", "b", b"a", 1, 2, "c"]


@dataclass
class Msg:
    seq: int
    keys: tuple
    payload: object
    attempt: int = 0  # deliveries so far
    live: bool = False
    done: bool = False


@dataclass
class LockManager:
    """Reference: per-key lines of seqs; fifo = heads every line, eager = none of its keys held."""

    order: str
    msgs: dict[int, Msg] = field(default_factory=dict)
    lines: dict[object, list[int]] = field(default_factory=dict)

    @staticmethod
    def ident(key: object) -> tuple[type, object]:
        return (type(key), key)  # "1", b"1" and 1 are different keys

    def send(self, seq: int, keys: tuple, payload: object) -> None:
        self.msgs[seq] = Msg(seq, keys, payload)
        for k in keys:
            self.lines.setdefault(self.ident(k), []).append(seq)

    def held(self) -> set:
        return {self.ident(k) for m in self.msgs.values() if m.live for k in m.keys}

    def ready(self) -> set[int]:
        held = self.held()
        out = set()
        for m in self.msgs.values():
            if m.live or m.done:
                continue
            ids = [self.ident(k) for k in m.keys]
            if any(i in held for i in ids):
                continue
            if self.order == "fifo" and any(self.lines[i][0] != m.seq for i in ids):
                continue
            out.add(m.seq)
        return out

    def deliver(self, seq: int) -> None:
        m = self.msgs[seq]
        m.live, m.attempt = True, m.attempt + 1

    def release(self, seq: int) -> None:
        m = self.msgs[seq]
        m.live, m.done = False, True
        for k in m.keys:
            self.lines[self.ident(k)].remove(seq)

    def nack(self, seq: int) -> None:
        self.msgs[seq].live = False


def dedup(keys: list) -> tuple:
    out: list = []
    seen = set()
    for k in keys:
        if LockManager.ident(k) not in seen:
            seen.add(LockManager.ident(k))
            out.append(k)
    return tuple(out)


class SchedulerMachine(RuleBasedStateMachine):
    """Drives one channel and the reference model with the same operations."""

    order = "fifo"
    check_stats = False
    max_messages: int | None = None  # the receiver's window; None = the default
    names: object = None  # set by the test: a factory of unique channel names

    def __init__(self) -> None:
        super().__init__()
        self.name = type(self).names()
        self.ch = shmchan.Channel.create(
            self.name, capacity=1 << 20, order=self.order, max_messages=self.max_messages
        )
        self.tx = self.ch.sender()
        self.rx = self.ch.receiver()
        self.model = LockManager(self.order)
        self.live: dict[int, object] = {}  # seq -> the live handle
        self.stale: list[object] = []  # handles already released or nacked
        self.counter = 0
        self.delivered = self.redeliveries = self.released = self.nacks = 0

    def teardown(self) -> None:
        self.live.clear()
        self.stale.clear()
        self.rx.close()
        self.tx.close()
        self.ch.close()
        shmchan.unlink(self.name)

    @rule(keys=st.lists(st.sampled_from(KEY_POOL), max_size=3))
    def send(self, keys):
        self.counter += 1
        payload = (self.counter, keys)
        seq = self.tx.send(payload, keys=keys)
        assert all(seq > s for s in self.model.msgs), "seq must increase"
        self.model.send(seq, dedup(keys), payload)

    @rule()
    def try_recv(self):
        h = self.rx.try_recv()
        if h is None:
            self.check_nothing_was_ready("try_recv")
            return
        self.check_delivery(h, "try_recv")

    def check_delivery(self, h, call):
        """h must be a message the model allows now; it is live from here on."""
        ready = self.model.ready()
        assert h.seq in ready, f"{call} handed out seq {h.seq}; allowed were {sorted(ready)}"
        m = self.model.msgs[h.seq]
        self.model.deliver(h.seq)
        assert h.keys == m.keys
        assert h.payload == m.payload
        assert h.attempt == m.attempt
        self.live[h.seq] = h
        self.delivered += 1
        self.redeliveries += h.attempt > 1

    def check_nothing_was_ready(self, call):
        # The one allowed exception: a window whose every slot is a live handle
        # (max_messages also bounds the handles out at once).
        ready = self.model.ready()
        window_full = self.max_messages is not None and len(self.live) >= self.max_messages
        assert not ready or window_full, f"{call} gave nothing although {sorted(ready)} are ready"

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        seq = data.draw(st.sampled_from(sorted(self.live)))
        h = self.live.pop(seq)
        h.release()
        self.model.release(seq)
        self.stale.append(h)
        self.released += 1

    @rule(n=st.integers(2, 12))
    def recv_many(self, n):
        """A receive of many (the run that hands messages out as it takes them in:
        csrc/batchin.c): each handle must be one the model allows given those before it.
        It may return fewer than n (what one poll found), but not none while one is ready."""
        try:
            hs = self.rx.recv_many(n, timeout=0)
        except shmchan.Empty:
            hs = []
        assert len(hs) <= n
        for h in hs:
            self.check_delivery(h, "recv_many")
        if not hs:  # fewer than n is allowed; none while one is ready is not
            self.check_nothing_was_ready("recv_many")

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release_many(self, data):
        """Release several live handles in one call, stale ones mixed in (each a no-op)
        and one live handle possibly twice: the release run (csrc/handles.c)."""
        seqs = data.draw(
            st.lists(st.sampled_from(sorted(self.live)), min_size=1, max_size=8, unique=True)
        )
        hs = [self.live.pop(seq) for seq in seqs]
        batch = list(hs)
        if self.stale:
            batch += data.draw(st.lists(st.sampled_from(self.stale), max_size=3))
        if data.draw(st.booleans()):
            batch.append(hs[0])  # the same handle again: released once
        batch = data.draw(st.permutations(batch))
        self.rx.release_many(batch)
        for seq, h in zip(seqs, hs, strict=True):
            self.model.release(seq)
            self.stale.append(h)
            self.released += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def nack(self, data):
        seq = data.draw(st.sampled_from(sorted(self.live)))
        h = self.live.pop(seq)
        h.nack()
        self.model.nack(seq)
        self.stale.append(h)
        self.nacks += 1

    @precondition(lambda self: self.stale)
    @rule(data=st.data())
    def release_stale(self, data):
        h = data.draw(st.sampled_from(self.stale))
        h.release()  # must be a no-op

    @precondition(lambda self: self.stale)
    @rule()
    def forget_stale(self):
        """Drop the stale handle objects: their garbage collection must release nothing."""
        self.stale.clear()
        gc.collect()

    @invariant()
    def core_bookkeeping_is_consistent(self):
        """The C core's own cross-check of its lines, pending counts and ready heap."""
        from shmchan._lib import ffi, lib

        what = ffi.new("uint32_t *")
        assert lib.shm_check_scheduler(self.rx._seg.ptr, what) == 0, f"check {what[0]} failed"

    @invariant()
    def no_two_live_handles_share_a_key(self):
        seen: set = set()
        for h in self.live.values():
            ids = {LockManager.ident(k) for k in h.keys}
            assert not ids & seen
            seen |= ids

    @invariant()
    def stats_match_the_model(self):
        if not self.check_stats:
            return
        s = self.ch.stats()
        m = self.model
        queued = sum(1 for x in m.msgs.values() if not x.live and not x.done)
        assert s.sent == len(m.msgs)
        assert s.queued == queued
        assert s.inflight == len(self.live)
        assert s.held_keys == len(m.held())
        assert s.delivered == self.delivered
        assert s.released == self.released
        # "redelivered" may count nacks or the redeliveries they cause; either is fine.
        assert s.redelivered in (self.redeliveries, self.nacks)


class EagerMachine(SchedulerMachine):
    order = "eager"


class SmallWindowMachine(SchedulerMachine):
    """The smallest window, so that backlogs overflow it: waiting messages are evicted and
    later ones taken in out of order (csrc/window.c); the model must not notice."""

    max_messages = 16

    @rule(keys=st.lists(st.sampled_from(KEY_POOL), max_size=2), n=st.integers(4, 24))
    def send_burst(self, keys, n):
        for _ in range(n):
            self.send(keys)


class LookaheadMachine(SmallWindowMachine):
    """Parking limited to one key that has nothing but parked records (a test setting),
    so that the scan stops often and messages on free keys further on are taken in by
    the look-ahead (csrc/lookahead.c), ahead of records the scan has not reached; the
    model must not notice."""


class StatsMachine(SchedulerMachine):
    """Same operations; the counters and gauges in stats() follow the model exactly."""

    check_stats = True


MODEL_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "machine",
    [SchedulerMachine, EagerMachine, SmallWindowMachine],
    ids=["fifo", "eager", "fifo-small-window"],
)
def test_scheduler_matches_the_reference_lock_manager(machine, new_chan_name, monkeypatch):
    monkeypatch.setattr(machine, "names", staticmethod(new_chan_name))
    run_state_machine_as_test(machine, settings=MODEL_SETTINGS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_the_look_ahead_matches_the_reference_lock_manager(new_chan_name, monkeypatch, order):
    from shmchan._lib import lib

    monkeypatch.setattr(LookaheadMachine, "names", staticmethod(new_chan_name))
    monkeypatch.setattr(LookaheadMachine, "order", order)
    assert lib.shm_test_park_keys(1) == 0
    try:
        run_state_machine_as_test(LookaheadMachine, settings=MODEL_SETTINGS)
    finally:
        assert lib.shm_test_park_keys(0) == 0


@pytest.mark.timeout(300)
def test_stats_match_the_reference_lock_manager(new_chan_name, monkeypatch):
    monkeypatch.setattr(StatsMachine, "names", staticmethod(new_chan_name))
    run_state_machine_as_test(StatsMachine, settings=MODEL_SETTINGS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_random_workload_never_has_two_live_handles_sharing_a_key(make_channel, order):
    """A longer plain random run (no shrinking) as a cheap soak of the invariant."""
    rng = random.Random(1234)
    ch = make_channel(order=order)
    model = LockManager(order)
    live: dict[int, object] = {}
    with ch.sender() as tx, ch.receiver() as rx:
        for step in range(3000):
            op = rng.random()
            if op < 0.4:
                keys = rng.sample(KEY_POOL, rng.randint(0, 3))
                model.send(tx.send(step, keys=keys), dedup(keys), step)
            elif op < 0.75:
                ready = model.ready()
                h = rx.try_recv()
                assert (h is None) == (not ready)
                if h is not None:
                    assert h.seq in ready
                    model.deliver(h.seq)
                    live[h.seq] = h
            elif live:
                seq = rng.choice(sorted(live))
                h = live.pop(seq)
                if op < 0.95:
                    h.release()
                    model.release(seq)
                else:
                    h.nack()
                    model.nack(seq)


def test_messages_free_at_once_come_out_in_seq_order(tx, rx):
    """One producer's messages come out in send order whenever their keys allow: B is free
    again once A is released, so C (sent after B) must not overtake it."""
    a = tx.send(b"A", keys="k1")
    b = tx.send(b"B", keys="k1")
    c = tx.send(b"C", keys="k2")
    got = []
    for _ in range(3):
        h = rx.recv(timeout=5)
        got.append(h.seq)
        h.release()
    assert got == [a, b, c]
