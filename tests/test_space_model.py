"""Ring space around any mix of long-lived records: a model-based test (csrc/compact.c).

A hypothesis state machine drives one small channel through sends on random keys, the
receiver's polls, handles held, released and nacked (and so dead letters), zero-copy views
(`handle.data`) kept and dropped, and dead letters discarded. A reference model below knows
every message that is still live -- queued, in flight, or a dead letter -- and the bytes its
record takes in the ring. It checks:

* space: while the live records, the one being sent included, take at most a quarter of
  the ring, a send the ring refuses gets in once the receiver has polled once, whatever is
  held, parked behind a held key, dead-lettered or pinned by a view, wherever it lies;
* order: under fifo a message is handed out only once every earlier message on each of
  its keys was released or became a dead letter; under either order no two live handles
  share a key; a handed-out message carries its payload, keys and attempt;
* views: a kept view reads its message's bytes until its handle goes.

The channels start with the smallest key table (16 entries, a test-only setting), so that
its growth, and probe runs crowded enough to meet at one home entry, come up in nearly
every example; the core's self-check after each step verifies the table (no gap in a
probe run, every key found from its home).
"""

from __future__ import annotations

from dataclasses import dataclass

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
from procs import check_core

import shmchan
from shmchan._lib import lib
from shmchan.codec import encode_keys

CAPACITY = 16 << 10
KEYS = ("a", "b", "c", "d", "e")
SIZES = (0, 24, 100, 300, 800)
MAX_ATTEMPTS = 2
MAX_VIEWS = 3  # each view can pin its record as an island (at most 32 at once)


def record_bytes(keys: tuple[str, ...], size: int) -> int:
    """The bytes a message takes in the ring (csrc/core.h rec_size): the fixed part, a
    hash and a link per key, the key blob and the payload, each padded to 8."""
    blob, n = encode_keys(keys, 64)
    return 56 + 16 * n + -(-len(blob) // 8) * 8 + -(-size // 8) * 8


@dataclass
class Msg:
    keys: tuple[str, ...]
    payload: bytes
    record: int
    state: str = "queued"  # queued, live (in flight) or dead (a dead letter)
    deliveries: int = 0


class SpaceMachine(RuleBasedStateMachine):
    order = "fifo"
    names = staticmethod(lambda: "unset")  # replaced by the test (conftest's names)

    def __init__(self) -> None:
        super().__init__()
        self.name = self.names()
        self.ch = shmchan.Channel.create(
            self.name,
            capacity=CAPACITY,
            order=self.order,
            max_attempts=MAX_ATTEMPTS,
            max_messages=512,  # more than the ring can hold: 16 KiB / 56 bytes
        )
        self.tx, self.rx = self.ch.sender(), self.ch.receiver()
        self.msgs: dict[int, Msg] = {}  # the live messages: released ones leave
        self.lines: dict[str, set[int]] = {}  # per key: messages neither released nor dead
        self.live_bytes = 0  # their records' bytes
        self.last_seq = 0
        self.live: dict[int, shmchan.Handle] = {}
        self.views: dict[int, memoryview] = {}
        self.made = 0
        self.refused = 0  # sends the ring refused while they were owed room (then got in)

    def teardown(self) -> None:
        self.views.clear()
        self.live.clear()
        self.rx.close()
        self.tx.close()
        self.ch.close()
        shmchan.unlink(self.name)

    # -- the model -----------------------------------------------------------------------
    def take(self, h: shmchan.Handle) -> None:
        """A handle the receiver handed out: check it against the model, then hold it."""
        m = self.msgs.get(h.seq)
        assert m is not None and m.state == "queued", f"handed out seq {h.seq}: {m}"
        for other in self.live.values():
            assert not set(other.keys) & set(m.keys), f"{h.seq} and {other.seq} share a key"
        if self.order == "fifo":  # the first of every line it is in
            for k in m.keys:
                assert min(self.lines[k]) == h.seq, f"seq {h.seq} passed {min(self.lines[k])}"
        m.deliveries += 1
        assert (h.keys, h.attempt) == (m.keys, m.deliveries)
        assert h.payload == m.payload  # a copy: holding a handle pins nothing
        m.state = "live"
        self.live[h.seq] = h

    def leave_lines(self, seq: int) -> None:
        for k in self.msgs[seq].keys:
            self.lines[k].discard(seq)

    def poll(self) -> None:
        h = self.rx.try_recv()
        if h is not None:
            self.take(h)

    def send_one(self, keys: tuple[str, ...], size: int) -> None:
        self.made += 1
        payload = (self.made.to_bytes(4, "little") * (size // 4 + 1))[:size]
        record = record_bytes(keys, size)
        owed = self.live_bytes + record <= CAPACITY // 4
        try:
            seq = self.tx.send(payload, keys=keys, timeout=0)
        except shmchan.Full:
            if not owed:
                return  # the ring may well be full of live data
            self.refused += 1
            self.poll()  # the receiver polls once: that must make room
            try:
                seq = self.tx.send(payload, keys=keys, timeout=0)
            except shmchan.Full:
                raise AssertionError(
                    f"refused after a poll with {self.live_bytes} live bytes of "
                    f"{CAPACITY}: {self.ch.stats()}"
                ) from None
        assert seq > self.last_seq, "seq must increase"
        self.last_seq = seq
        self.msgs[seq] = Msg(keys, payload, record)
        self.live_bytes += record
        for k in keys:
            self.lines.setdefault(k, set()).add(seq)

    def finish(self, seq: int, nack: bool) -> None:
        self.views.pop(seq, None)  # a view is good only while its handle lives
        h = self.live.pop(seq)
        m = self.msgs[seq]
        if nack:
            h.nack()
            m.state = "dead" if m.deliveries >= MAX_ATTEMPTS else "queued"
            if m.state == "dead":  # its keys go free
                self.leave_lines(seq)
        else:
            h.release()
            self.forget(seq)

    def forget(self, seq: int) -> None:
        if self.msgs[seq].state != "dead":
            self.leave_lines(seq)
        self.live_bytes -= self.msgs.pop(seq).record

    # -- rules ---------------------------------------------------------------------------
    keys_strategy = st.lists(st.sampled_from(KEYS), max_size=2, unique=True).map(tuple)

    @rule(keys=keys_strategy, size=st.sampled_from(SIZES))
    def send(self, keys, size):
        self.send_one(keys, size)

    @rule(keys=st.lists(keys_strategy, min_size=1, max_size=40), size=st.sampled_from(SIZES))
    def send_burst(self, keys, size):
        for k in keys:
            self.send_one(k, size)

    @rule(
        n=st.integers(1, 300),
        pattern=st.lists(st.one_of(st.none(), keys_strategy), min_size=1, max_size=12),
        sizes=st.lists(st.sampled_from(SIZES), min_size=1, max_size=4),
        every=st.integers(1, 12),
    )
    def traffic(self, n, pattern, sizes, every):
        """n messages flow past whatever is held: sent `every` at a time, then everything
        free to go received and released at once. Message i has the keys pattern[i %
        len(pattern)] (None: a key of its own); those on a held key park behind it,
        scattered through the ring, lap after lap."""
        for i in range(n):
            keys = pattern[i % len(pattern)]
            self.send_one((f"u{self.made}",) if keys is None else keys, sizes[i % len(sizes)])
            if i % every == every - 1 or i == n - 1:
                while (h := self.rx.try_recv()) is not None:
                    self.take(h)
                    self.finish(h.seq, nack=False)

    @rule()
    def receiver_polls(self):
        self.poll()

    @rule(hold=st.integers(0, 2))
    def drain_holding_some(self, hold):
        """Receive everything free to go; hold the first `hold`, release the rest at once
        (the receiver of a long task: its key's later messages park behind it)."""
        for i in range(200):
            h = self.rx.try_recv()
            if h is None:
                return
            self.take(h)
            if i >= hold:
                self.finish(h.seq, nack=False)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        self.finish(data.draw(st.sampled_from(sorted(self.live))), nack=False)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def nack(self, data):
        self.finish(data.draw(st.sampled_from(sorted(self.live))), nack=True)

    @precondition(lambda self: len(self.views) < MAX_VIEWS and set(self.live) - set(self.views))
    @rule(data=st.data())
    def keep_a_view(self, data):
        seq = data.draw(st.sampled_from(sorted(set(self.live) - set(self.views))))
        self.views[seq] = self.live[seq].data  # pins the record where it lies

    @precondition(lambda self: self.views)
    @rule(data=st.data())
    def drop_a_view(self, data):
        self.views.pop(data.draw(st.sampled_from(sorted(self.views)))).release()

    @precondition(lambda self: any(m.state == "dead" for m in self.msgs.values()))
    @rule(data=st.data())
    def discard_a_dead_letter(self, data):
        letters = {d.seq: d for d in self.ch.dead_letters()}
        dead = {seq for seq, m in self.msgs.items() if m.state == "dead"}
        assert set(letters) == dead
        seq = data.draw(st.sampled_from(sorted(dead)))
        assert letters[seq].payload == self.msgs[seq].payload
        assert letters[seq].discard()
        self.forget(seq)

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def views_read_their_messages(self):
        for seq, view in self.views.items():
            assert view == self.msgs[seq].payload, f"the view of seq {seq} was overwritten"

    @invariant()
    def core_bookkeeping_is_consistent(self):
        check_core(self.rx)

    @invariant()
    def stats_follow_the_model(self):
        s = self.ch.stats()
        states = [m.state for m in self.msgs.values()]
        assert (s.queued, s.inflight, s.dead_letters) == (
            states.count("queued"),
            states.count("live"),
            states.count("dead"),
        )


class EagerSpaceMachine(SpaceMachine):
    order = "eager"


SPACE_SETTINGS = settings(
    max_examples=80,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("machine", [SpaceMachine, EagerSpaceMachine], ids=["fifo", "eager"])
def test_space_is_reclaimed_around_whatever_is_held(machine, new_chan_name, monkeypatch):
    monkeypatch.setattr(machine, "names", staticmethod(new_chan_name))
    assert lib.shm_test_keytab_first(16) == 0  # grows 16, 32, 64, ... as keys come
    try:
        run_state_machine_as_test(machine, settings=SPACE_SETTINGS)
    finally:
        assert lib.shm_test_keytab_first(0) == 0
