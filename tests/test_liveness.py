"""Liveness: nothing parked, waiting or in flight wedges the channel.

A message that can go now must not wait for a backlog it does not share a key with, the
receiver must not sleep while records it has not looked at are waiting, and the loop
`for h in rx` must not end while a handle can still come back.

The bounds below are hang detectors, not speed targets: each is many times what the
work takes on a loaded machine, and many times smaller than what the bugs they catch
cost (a backlog of 100 000 took 13 s before; the eager window, forever).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import struct
import threading
import time

import pytest
from procs import CTX, WAIT, cpu_share, layout_fact, running, tail_claimed_by_us

import shmchan

# --- child entry points -----------------------------------------------------------------


def send_backlog_then_free(name: str, n: int, ready, done) -> None:
    """n messages on "hot", then one on "free"; `done` is set once all are sent."""
    with shmchan.Sender.open(name) as tx:
        ready.set()
        tx.send_many([(b"h", ("hot",))] * n, timeout=WAIT)
        tx.send(b"free", keys="free", timeout=WAIT)
    done.set()


def hold_forever(handle, results) -> None:
    """A worker that takes a handle over and never releases it."""
    results.put((handle.seq, handle.payload))
    time.sleep(WAIT * 4)


# --- helpers ------------------------------------------------------------------------------


def hold_hot(ch, rx):
    """Send one message on "hot" and hold its handle: everything else on "hot" parks."""
    with ch.sender() as tx:
        tx.send(b"held", keys="hot")
    h = rx.recv(timeout=WAIT)
    assert h.keys == ("hot",)
    return h


def drain_hot(rx) -> int:
    """Receive and release everything ready, all of it on "hot"; how many there were."""
    got = 0
    while (h := rx.try_recv()) is not None:
        assert h.keys == ("hot",)
        got += 1
        h.release()
    return got


def recv_in_thread(rx, timeout: float):
    """Start a thread blocked in rx.recv(timeout); returns (thread, outcome dict)."""
    outcome: dict = {}

    def run() -> None:
        try:
            h = rx.recv(timeout=timeout)
            outcome["at"] = time.monotonic()
            outcome["handle"] = h
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            outcome["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, outcome


# --- item 1: a free-key message is never held up by a parked backlog -------------------------

BACKLOGS = [
    pytest.param(100_000, 64 << 20, None, 5.0, id="100k"),
    pytest.param(100_000, 16 << 20, 16384, 5.0, id="100k-window16k"),
    pytest.param(300_000, 64 << 20, 16384, 10.0, id="300k-window16k"),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("order", ["fifo", "eager"])
@pytest.mark.parametrize(("n", "capacity", "window", "bound"), BACKLOGS)
def test_free_key_message_after_a_backlog_sent_while_the_receiver_sleeps(
    make_channel, order, n, capacity, window, bound
):
    """One handle held on "hot"; another process sends n messages on "hot" while the
    receiver is blocked in recv, then one on a free key: it arrives at once."""
    ch = make_channel(capacity=capacity, order=order, max_messages=window)
    rx = ch.receiver()
    held = hold_hot(ch, rx)
    ready, done = CTX.Event(), CTX.Event()
    child = CTX.Process(target=send_backlog_then_free, args=(ch.name, n, ready, done))
    with running(child):
        assert ready.wait(WAIT)
        thread, outcome = recv_in_thread(rx, timeout=WAIT * 4)
        assert done.wait(WAIT * 4), "the producer did not finish sending"
        sent_at = time.monotonic()
        thread.join(bound + 2 * WAIT)
        assert "error" not in outcome, outcome.get("error")
        assert "handle" in outcome, "recv never returned"
        late = outcome["at"] - sent_at
        h = outcome["handle"]
        assert h.payload == b"free"
        assert late < bound, f"the free-key message came {late:.1f} s after it was sent"
        h.release()
    assert ch.stats().queued == n
    held.release()
    rx.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_free_key_message_after_a_backlog_sent_while_nobody_looked(make_channel, order):
    """The backlog arrives while the receiver is not in recv at all; the first recv
    finds the free-key message behind it without sleeping in between."""
    n = 100_000
    ch = make_channel(capacity=16 << 20, order=order, max_messages=16384)
    rx = ch.receiver()
    held = hold_hot(ch, rx)
    with ch.sender() as tx:
        tx.send_many([(b"h", ("hot",))] * n)
        tx.send(b"free", keys="free")
    start = time.monotonic()
    h = rx.recv(timeout=WAIT)
    took = time.monotonic() - start
    assert h.payload == b"free"
    assert took < 5.0, f"recv took {took:.1f} s to find the free-key message"
    h.release()
    held.release()
    rx.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_a_free_key_keeps_flowing_behind_a_backlog_larger_than_the_window(make_channel, order):
    """A sequence on one free key, sent after a parked backlog larger than the window:
    each message goes as soon as the one before it is released, and try_recv (which
    never waits) finds it at once."""
    ch = make_channel(capacity=4 << 20, order=order, max_messages=16)
    rx = ch.receiver()
    held = hold_hot(ch, rx)
    with ch.sender() as tx:
        tx.send_many([(b"h", ("hot",))] * 5000)
        seqs = [tx.send(i, keys="cold") for i in range(20)]
        tx.send_many([(b"h", ("hot",))] * 5000)
    for seq in seqs:
        h = rx.try_recv()
        assert h is not None, f"seq {seq} on a free key was not handed out"
        assert h.seq == seq
        assert rx.try_recv() is None  # the next one on "cold" waits for this one
        h.release()
    assert rx.try_recv() is None
    held.release()
    assert drain_hot(rx) == 10_000


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_many_distinct_keys_parked_behind_a_hot_key_do_not_break_the_receiver(make_channel, order):
    """Messages on (hot, k_i) for thousands of distinct k_i park behind "hot"; the
    receiver keeps going (no ChannelCorrupted), a free key still flows, and they all
    come out in order once "hot" is released."""
    ch = make_channel(capacity=4 << 20, order=order, max_messages=16)
    rx = ch.receiver()
    held = hold_hot(ch, rx)
    n = 3000
    with ch.sender() as tx:
        sent = tx.send_many([(i, ("hot", f"k{i}")) for i in range(n)])
        free = tx.send(b"free", keys="free")
    h = rx.recv(timeout=WAIT)
    assert h.seq == free
    h.release()
    held.release()
    got = []
    for _ in range(n):
        with rx.recv(timeout=WAIT) as h:
            got.append(h.seq)
    assert got == sent


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_free_keys_keep_flowing_for_laps_behind_a_parked_run_of_70k_records(make_channel, order):
    """70 000 small messages park on a held key at the ring's head, more records in one
    run than a look of the ring once visited (65 536): free-key messages of 4 KiB then
    go round the ring twice, each sent, received and released in turn. Compaction must
    slide the whole run out of the way; before, every look ended inside it, the ring
    filled behind it and the send was refused (Full) a lap in."""
    n, capacity, size = 70_000, 16 << 20, 4096
    ch = make_channel(capacity=capacity, order=order)
    rx = ch.receiver()
    held = hold_hot(ch, rx)
    with ch.sender() as tx:
        for _ in range(n // 1000):
            tx.send_many([(b"h", ("hot",))] * 1000, timeout=WAIT)
        assert rx.try_recv() is None
        assert ch.stats().queued == n
        laps = 2 * capacity // size
        for i in range(laps):
            tx.send(bytes([i & 0xFF]) * size, keys=i, timeout=2.0)
            with rx.recv(timeout=WAIT) as h:
                assert h.keys == (i,)
    assert ch.stats().queued == n
    held.release()
    assert drain_hot(rx) == n
    rx.close()


# --- item 6: `for h in rx` does not end while a handle can still come back ---------------------


def give_to_worker(ch, rx):
    """Receive one message and hand its handle to a spawned worker that holds it."""
    with ch.sender() as tx:
        seq = tx.send(b"job", keys="k")
    h = rx.recv(timeout=WAIT)
    results = CTX.Queue()
    worker = CTX.Process(target=hold_forever, args=(h, results))
    return seq, h, results, worker


@pytest.mark.timeout(120)
def test_iteration_after_shutdown_gets_the_redelivery_of_a_dead_workers_handle(ch, rx, bounded):
    """Shut down while a worker holds a handle: the loop does not end; the worker is
    killed; the loop gets the message again (attempt 2), then ends."""
    seq, h, results, worker = give_to_worker(ch, rx)
    with running(worker):
        assert results.get(timeout=WAIT) == (seq, b"job")  # the worker holds it now
        del h
        ch.shutdown()
        got = []

        def loop() -> list:
            for h2 in rx:
                with h2:
                    got.append((h2.seq, h2.attempt, h2.payload))
            return got

        killer = threading.Timer(0.5, worker.kill)
        killer.start()
        try:
            assert bounded(loop, limit=WAIT) == [(seq, 2, b"job")]
        finally:
            killer.cancel()
    st = ch.stats()
    assert (st.queued, st.inflight, st.redelivered) == (0, 0, 1)


@pytest.mark.timeout(120)
def test_recv_after_shutdown_raises_closed_only_once_no_handle_can_come_back(ch, rx):
    seq, h, results, worker = give_to_worker(ch, rx)
    with running(worker):
        assert results.get(timeout=WAIT) == (seq, b"job")
        del h
        ch.shutdown()
        with pytest.raises(shmchan.Empty):  # not Closed: the worker may still give it back
            rx.recv(timeout=0.5)
        worker.kill()
        again = rx.recv(timeout=WAIT)
        assert (again.seq, again.attempt) == (seq, 2)
        again.release()
        with pytest.raises(shmchan.Closed):
            rx.recv(timeout=WAIT)


@pytest.mark.timeout(60)
def test_iteration_after_shutdown_ends_while_this_process_holds_the_last_handle(ch, tx, rx):
    """Handles this process still holds (list() keeps them all) do not keep the loop from
    ending: only this process could give them back."""
    for i in range(3):
        tx.send(i, keys=f"k{i}")
    ch.shutdown()
    kept = list(rx)
    assert sorted(h.payload for h in kept) == [0, 1, 2]


# --- item 4: a producer frozen mid-send holds up only messages on its own keys ---------------

BIG = 32 << 20  # long enough a copy that a SIGSTOP lands inside it


def send_big(name: str, size: int, ready, keys=("big",)) -> None:
    """Producer A: one big message on `keys` (built before it says it is ready)."""
    payload = b"\x01" * size
    with shmchan.Sender.open(name) as tx:
        ready.set()
        tx.send(payload, keys=keys, timeout=WAIT)


def _layout_fact(name: str) -> int:
    from shmchan._lib import ffi, lib

    out = ffi.new("uint64_t *")
    assert lib.shm_layout_fact(name.encode(), out) == 0, name
    return int(out[0])


def _first_record_state(name: str) -> int:
    """The state byte of the record at ring position 0 (csrc/core.h REC_*)."""
    fd = os.open(f"/dev/shm/shmchan.{name}", os.O_RDONLY)
    try:
        ring = int.from_bytes(os.pread(fd, 8, _layout_fact("header.ring_off")), "little")
        meta = int.from_bytes(os.pread(fd, 8, ring + _layout_fact("record.meta")), "little")
    finally:
        os.close(fd)
    return meta & 0xFF


REC_WRITING = 1


@contextlib.contextmanager
def frozen_mid_send(make_channel, keys=("big",)):
    """A fresh channel whose first record is producer A's big message, A stopped
    (SIGSTOP) while it copies the payload. Yields (channel, A), and kills A on the way
    out if it still lives; retried until the stop lands inside the copy."""
    for _ in range(8):
        ch = make_channel(capacity=2 * BIG)
        ready = CTX.Event()
        a = CTX.Process(target=send_big, args=(ch.name, BIG, ready, keys), daemon=True)
        a.start()
        assert ready.wait(WAIT)
        deadline = time.monotonic() + WAIT
        while _first_record_state(ch.name) != REC_WRITING and time.monotonic() < deadline:
            if not a.is_alive():
                break
        os.kill(a.pid, signal.SIGSTOP)
        os.waitid(os.P_PID, a.pid, os.WSTOPPED | os.WNOWAIT)
        if _first_record_state(ch.name) == REC_WRITING:
            try:
                yield ch, a
            finally:
                if a.is_alive():
                    a.kill()
                    a.join(WAIT)
            return
        os.kill(a.pid, signal.SIGKILL)  # the copy was done already: try again
        a.join(WAIT)
    pytest.skip("could not stop the producer inside its copy")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_a_frozen_producer_holds_up_only_messages_on_its_keys(make_channel, order):
    with frozen_mid_send(lambda **kw: make_channel(order=order, **kw)) as (ch, a):
        rx = ch.receiver()
        with ch.sender() as tx:  # producer B
            others = [tx.send(i, keys=f"other{i % 3}") for i in range(30)]
            behind = tx.send(b"B on big", keys="big")
        # fifo: B's message on "big" waits behind A's; eager promises no order: it goes
        now = others if order == "fifo" else [*others, behind]
        got = []
        for _ in now:
            with rx.recv(timeout=10) as h:  # all of them, while A is frozen
                got.append(h.seq)
        assert sorted(got) == now
        assert rx.try_recv() is None
        os.kill(a.pid, signal.SIGCONT)
        with rx.recv(timeout=WAIT) as first:  # A's, whole
            assert first.keys == ("big",) and len(first.data) == BIG
            assert first.data[0] == 1 and first.data[-1] == 1
            assert first.seq < behind
        if order == "fifo":
            with rx.recv(timeout=WAIT) as second:
                assert second.seq == behind and second.payload == b"B on big"
        a.join(WAIT)
        assert a.exitcode == 0
        rx.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_a_producer_killed_while_frozen_mid_send_frees_its_keys(make_channel, order):
    with frozen_mid_send(lambda **kw: make_channel(order=order, **kw)) as (ch, a):
        rx = ch.receiver()
        with ch.sender() as tx:
            other = tx.send(b"other", keys="other")
            behind = tx.send(b"B on big", keys="big")
        with rx.recv(timeout=10) as h:  # while A is frozen
            assert h.seq in (other, behind)
            seen = {h.seq}
        a.kill()  # frozen: dies without committing
        a.join(WAIT)
        deadline = time.monotonic() + WAIT
        while seen != {other, behind} and time.monotonic() < deadline:
            with rx.recv(timeout=WAIT) as h:
                seen.add(h.seq)
        assert seen == {other, behind}
        while ch.stats().discarded == 0 and time.monotonic() < deadline:
            assert rx.try_recv() is None  # A's message is gone, never torn or delivered
            time.sleep(0.01)
        assert ch.stats().discarded == 1
        assert rx.try_recv() is None
        rx.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_a_frozen_producers_keyless_message_holds_up_nothing(make_channel, order):
    with frozen_mid_send(lambda **kw: make_channel(order=order, **kw), keys=()) as (ch, a):
        rx = ch.receiver()
        with ch.sender() as tx:
            later = [tx.send(i) for i in range(5)]
        got = []
        for _ in later:
            with rx.recv(timeout=10) as h:
                got.append(h.seq)
        assert got == later
        os.kill(a.pid, signal.SIGCONT)
        with rx.recv(timeout=WAIT) as h:
            assert h.keys == () and len(h.data) == BIG
        a.join(WAIT)
        rx.close()


_fact = layout_fact


def _one_message_through(make_channel):
    """A fresh 1 MiB channel, its sender and its receiver, one message sent and released."""
    ch = make_channel()
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"warm-up", keys="k", timeout=WAIT)
    rx.recv(timeout=WAIT).release()
    return ch, tx, rx


def test_a_receive_that_waits_on_a_stalled_record_announces_its_sleep(make_channel):
    # A record claimed but not yet written (a live producer between its claim and its
    # length) holds the receiver's scan. A receive waiting on it must announce its sleep
    # (rx_sleeping), so that the commit ending the stall posts it. It used to sleep its
    # whole stall wait (2 ms) unannounced, however soon the commit came: the first
    # free-key message after a backlog took 2 ms in some runs of the parked bench.
    ch, tx, rx = _one_message_through(make_channel)
    with tail_claimed_by_us(ch) as (seg, owner_at, owner):
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(rx.recv(timeout=WAIT)))
        waiter.start()
        sleeping = _fact("header.rx_sleeping")
        announced = False
        deadline = time.monotonic() + 10
        while not announced and time.monotonic() < deadline and waiter.is_alive():
            announced = struct.unpack_from("<I", seg, sleeping)[0] == 1
        # the claim is given back, and the next send takes the tail and wakes the receiver
        struct.pack_into("<Q", seg, owner_at, owner)
        tx.send(b"after the stall", keys="k2", timeout=WAIT)
        waiter.join(WAIT)
        assert not waiter.is_alive()
        assert [h.payload for h in got] == [b"after the stall"]
        got[0].release()
        assert announced, "the receiver waited on the stalled record without announcing it"


def test_the_receivers_spin_waits_through_a_claim(make_channel):
    # The receiver's spin before it sleeps (shm_rx_spin) waits for something a poll can
    # hand out. It used to end as soon as a producer claimed the next record: the poll
    # then found the record stalled, and the receive left the spin for Python's slow
    # path and slept on it (next test).
    from shmchan._lib import lib

    ch, tx, rx = _one_message_through(make_channel)
    with tail_claimed_by_us(ch) as (seg, owner_at, owner):
        assert lib.shm_rx_spin(rx._seg.ptr, 20_000) == lib.SHM_EMPTY  # claimed: still nothing
        struct.pack_into("<Q", seg, owner_at, owner)
    tx.send(b"committed", keys="k", timeout=WAIT)
    assert lib.shm_rx_spin(rx._seg.ptr, 20_000) == lib.SHM_OK  # a commit ends it at once
    assert rx.recv(timeout=WAIT).payload == b"committed"


def send_behind_a_claim(name: str, ready) -> None:
    """A producer whose send meets a record claimed and never written (below)."""
    with shmchan.Sender.open(name) as tx:
        ready.set()
        tx.send(b"behind the claim", keys="k2", timeout=WAIT)


@pytest.mark.timeout(60)
def test_a_sender_behind_a_claim_that_does_not_finish_sleeps_instead_of_spinning(make_channel):
    # A producer stopped between its claim and its length (SIGSTOP, a debugger) holds up
    # every sender that walks to the tail. Such a sender used to retry every 0.2 ms with
    # a spin of 2000 pauses in between: a fifth to a quarter of a core for as long as the
    # claimant stayed stopped. Now its sleeps double up to the maintenance period. A bound
    # on CPU, far above what backing off costs and below what the old loop burnt.
    ch, tx, rx = _one_message_through(make_channel)
    with tail_claimed_by_us(ch) as (seg, owner_at, owner):
        ready = CTX.Event()
        p = CTX.Process(target=send_behind_a_claim, args=(ch.name, ready))
        with running(p):
            assert ready.wait(WAIT)
            share = cpu_share(p.pid, settle=0.5)  # (settled: well past its first retries)
            assert rx.try_recv() is None  # still held up: it waited all along
            struct.pack_into("<Q", seg, owner_at, owner)  # the claim is given back
            h = rx.recv(timeout=WAIT)  # and the waiting send goes in
            assert h.payload == b"behind the claim"
            h.release()
            p.join(WAIT)
            assert p.exitcode == 0
    assert share < 0.08, f"a sender behind a stuck claim used {share:.0%} of a core"


def _paced_producer(tx: shmchan.Sender, n: int, gap: float) -> None:
    tx.send(b"ready", keys=0, timeout=WAIT)
    for i in range(n):
        until = time.perf_counter() + gap
        while time.perf_counter() < until:
            pass
        tx.send(b"x" * 64, keys=i % 64, timeout=WAIT)


def test_a_receiver_that_keeps_up_with_its_producer_stays_in_the_fast_path(
    make_channel, monkeypatch
):
    # A receiver faster than its producer waits at the tail, and often finds the next
    # record claimed but not yet written. It used to leave its C wait for Python's slow
    # path there and sleep on the semaphore, so that the commit had to post it: about
    # 1.3 % of messages at 5 us apart (128 of 10 000), and half the throughput of a
    # receiver that lagged, in the big-channel bench. Now it spins through
    # such a stall; only one that lasts SPIN_SECONDS (a producer preempted mid-send)
    # goes to Python.
    n = 5_000
    slow = [0]
    recv_slow = shmchan.Receiver._recv_slow

    def counted(self, timeout):
        slow[0] += 1
        return recv_slow(self, timeout)

    monkeypatch.setattr(shmchan.Receiver, "_recv_slow", counted)
    ch = make_channel()
    rx = ch.receiver()
    with running(CTX.Process(target=_paced_producer, args=(ch.sender(), n, 5e-6))):
        rx.recv(timeout=WAIT).release()  # the producer is up
        slow[0] = 0
        for _ in range(n):
            rx.recv(timeout=WAIT).release()
    assert slow[0] < n // 500, f"{slow[0]} of {n} receives took the slow path"


# --- a receive that sleeps when, and only when, nothing can be done ----------------------


def _poll_armed(rx: shmchan.Receiver) -> int:
    """One poll with the sleep announced, as a blocking receive makes before it sleeps:
    SHM_EMPTY means it would sleep now, SHM_AGAIN that it would poll again at once."""
    from shmchan._lib import ffi, lib

    msgs = ffi.new("shm_msg[4]")
    got, stall, waiters = ffi.new("uint32_t *"), ffi.new("shm_stall *"), ffi.new("uint32_t *")
    rc = lib.shm_recv(rx._seg.ptr, msgs, 4, got, 1, stall, waiters)
    assert got[0] == 0
    return rc


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


@pytest.mark.parametrize("how", ["release", "nack", "release_many"])
def test_a_release_in_another_thread_wakes_a_receive_of_the_same_process(
    make_channel, monkeypatch, how
):
    # The common "receive in one thread, work and release in others" shape. A release
    # made in the receiver's own process is applied at once, under the receiver's lock,
    # and it posted nobody: a receive asleep in another thread waiting for that key slept
    # on until its next upkeep (up to 0.1 s; here, with upkeep every 30 s, its timeout).
    from shmchan import _segment

    monkeypatch.setattr(_segment, "MAINTENANCE_SECONDS", 30.0)
    ch = make_channel()
    tx, rx = ch.sender(), ch.receiver()
    for round_ in range(3):
        tx.send((round_, 1), keys="a", timeout=WAIT)
        tx.send((round_, 2), keys="a", timeout=WAIT)  # waits behind the first
        first = rx.recv(timeout=WAIT)
        assert first.payload == (round_, 1)
        rx.maintain()  # upkeep done: not due again during this round
        got: list = []
        errors: list = []

        def receive(got: list = got, errors: list = errors) -> None:
            try:
                got.append(rx.recv(timeout=10))
                got.append(time.monotonic())
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        waiter = threading.Thread(target=receive)
        waiter.start()
        time.sleep(0.05)  # let it go to sleep on the semaphore
        released = time.monotonic()
        if how == "release":
            first.release()
        elif how == "nack":
            first.nack()  # comes back first: the same message again
        else:
            rx.release_many([first])
        waiter.join(WAIT)
        assert not waiter.is_alive()
        assert errors == [], f"the receive failed: {errors!r}"
        # A hang detector: woken, it returns within a millisecond; not woken, it slept
        # out its 10 s timeout and found the message in its last look.
        assert got[1] - released < 5, f"the receive was not woken ({got[1] - released:.1f} s)"
        if how == "nack":
            assert got[0].payload == (round_, 1)
            got[0].release()
            got[:] = [rx.recv(timeout=WAIT)]
        assert got[0].payload == (round_, 2)
        got[0].release()


def test_after_shutdown_a_receive_with_messages_still_queued_sleeps(ch, tx, rx):
    # A shut-down channel with a message waiting behind a key this process holds: the
    # receive must sleep until the release, not poll. The re-check before sleeping
    # counted the shutdown as new work until the channel was drained, so every poll
    # returned "again" and the receive spun a core for its whole timeout (KeyedPool's
    # manager met this while draining).
    tx.send(b"a1", keys="a", timeout=WAIT)
    tx.send(b"a2", keys="a", timeout=WAIT)
    h1 = rx.recv(timeout=WAIT)
    ch.shutdown()
    from shmchan._lib import lib

    assert _poll_armed(rx) == lib.SHM_EMPTY, "the receive would poll again instead of sleeping"
    c0, t0 = _cpu(), time.monotonic()
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=0.5)
    cpu, wall = _cpu() - c0, time.monotonic() - t0
    assert cpu < wall / 2, f"the receive burned {cpu:.2f} s of CPU in {wall:.2f} s"
    h1.release()
    h2 = rx.recv(timeout=WAIT)
    assert h2.payload == b"a2"
    h2.release()
    with pytest.raises(shmchan.Closed):
        rx.recv(timeout=WAIT)


def _send_big(name: str, size: int) -> None:
    with shmchan.Sender.open(name) as tx:
        tx.send(b"x" * size, keys="big", timeout=WAIT)


@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_a_finished_placeholder_with_no_room_in_the_window_lets_the_receiver_sleep(
    make_channel, order
):
    # Every slot of the window is out (held handles). A large message is first seen
    # while its producer still writes it (a placeholder); once committed it still cannot
    # be taken in. Under fifo the re-check before sleeping counted it as work whatever
    # the room, so a receive polled in a loop for its whole timeout.
    from shmchan._lib import lib

    ch = make_channel(capacity=64 << 20, max_messages=16, order=order)
    tx, rx = ch.sender(), ch.receiver()
    # The receiver must look while the 32 MiB are being written (a few ms): on a loaded
    # machine it may not run then, so the scenario is staged again (at most 5 times).
    for _ in range(5):
        held = []
        for i in range(16):
            tx.send(b"h", keys=f"k{i}", timeout=WAIT)
            held.append(rx.recv(timeout=WAIT))
        p = CTX.Process(target=_send_big, args=(ch.name, 32 << 20))
        with running(p):
            seen_writing = False
            deadline = time.monotonic() + WAIT
            while p.is_alive() and time.monotonic() < deadline:  # look while it is written
                assert rx.try_recv() is None
                seen_writing = seen_writing or _writing_count(rx) > 0
            p.join(WAIT)
        if seen_writing:
            break
        for h in held:  # missed it: take the big one out of the way and stage it again
            h.release()
        rx.recv(timeout=WAIT).release()
    assert seen_writing, "the receiver never saw the record while it was being written"
    assert rx.try_recv() is None  # committed, and no room for it
    assert _poll_armed(rx) == lib.SHM_EMPTY, "the receive would poll again instead of sleeping"
    for h in held:
        h.release()
    big = rx.recv(timeout=WAIT)  # the release made room: it goes
    assert len(big.data) == 32 << 20
    big.release()


def _writing_count(rx: shmchan.Receiver) -> int:
    from shmchan._lib import ffi, lib

    base = lib.shm_base(rx._seg.ptr)
    return int(ffi.cast("uint32_t *", base + _fact("header.writing_n"))[0])


@pytest.mark.timeout(120)
def test_a_placeholder_that_commits_while_its_key_wakes_is_taken_in_once(make_channel):
    # fifo: a record seen while still being written (a placeholder) is parked on its key
    # and kept on the writing list. A release of the key's last holder puts the key on the
    # wake list. If the producer commits between a poll's pass over the writing list and
    # its pass over the wake list, the wake used to take the record in while it stayed on
    # the writing list: it was handed out and released, and the next poll found a
    # finished record on the list and reported the channel corrupt (seen under load in
    # test_send_many_larger_than_the_free_space_waits_and_goes_on_in_order, 44 of 150
    # runs). The commit is placed there with a pause point and a stopped producer.
    from shmchan._lib import lib

    ch = make_channel(capacity=128 << 20, order="fifo")
    tx, rx = ch.sender(), ch.receiver()
    size = 64 << 20
    for _ in range(5):  # the producer must be stopped while it still writes
        tx.send(b"first", keys="big", timeout=WAIT)
        first = rx.recv(timeout=WAIT)
        p = CTX.Process(target=_send_big, args=(ch.name, size))
        with running(p):
            deadline = time.monotonic() + WAIT
            while p.is_alive() and _writing_count(rx) == 0 and time.monotonic() < deadline:
                assert rx.try_recv() is None
            os.kill(p.pid, signal.SIGSTOP)
            try:
                assert rx.try_recv() is None  # a commit before the stop leaves the list
                staged = _writing_count(rx) > 0
                if staged:
                    r_notify, w_notify = os.pipe()
                    r_wait, w_wait = os.pipe()
                    lib.shm_test_pause_at(lib.SHM_PAUSE_INGEST_WAKE, w_notify, r_wait)
                    got: list[object] = []
                    first.release()  # the key's line empties: it goes on the wake list
                    poll = threading.Thread(target=lambda got=got: got.append(rx.try_recv()))
                    poll.start()  # stops between the writing and the wake pass
                    assert select.select([r_notify], [], [], WAIT)[0], "no pause"
                    os.read(r_notify, 1)
            finally:
                os.kill(p.pid, signal.SIGCONT)
            if staged:
                p.join(WAIT)  # the big record is committed now
                assert p.exitcode == 0
                os.write(w_wait, b"g")
                poll.join(WAIT)
                for fd in (r_notify, w_notify, r_wait, w_wait):
                    os.close(fd)
                break
        first.release()
        big = rx.recv(timeout=WAIT)
        big.release()
    else:
        pytest.fail("the producer finished its record before it could be stopped, 5 times")
    # The big record is handed out once, and the channel goes on.
    handles = [h for h in got if h is not None]
    if not handles:
        handles.append(rx.recv(timeout=WAIT))
    (big,) = handles
    assert len(big.data) == size
    big.release()
    assert rx.try_recv() is None  # the old code: ChannelCorrupted here
    tx.send(b"after", keys="big", timeout=WAIT)
    after = rx.recv(timeout=WAIT)
    assert after.payload == b"after"
    after.release()
