"""Handles: what they report, every way of releasing one, leases, in-process pickling."""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import shmchan


def test_handle_reports_seq_keys_payload_and_first_attempt(tx, rx):
    seq = tx.send({"n": 1}, keys=("a", 2))
    h = rx.recv(timeout=5)
    assert (h.seq, h.keys, h.payload, h.attempt) == (seq, ("a", 2), {"n": 1}, 1)


def test_payload_can_be_read_twice(tx, rx):
    tx.send({"n": 1})
    h = rx.recv(timeout=5)
    assert h.payload == h.payload == {"n": 1}


# --- data --------------------------------------------------------------------------


def test_data_is_a_memoryview_of_the_bytes(tx, rx):
    tx.send(b"zero-copy")
    h = rx.recv(timeout=5)
    assert isinstance(h.data, memoryview)
    assert h.data.tobytes() == b"zero-copy"


def test_data_is_read_only(tx, rx):
    tx.send(b"zero-copy")
    h = rx.recv(timeout=5)
    view = h.data
    assert view.readonly
    with pytest.raises(TypeError):
        view[0] = 0


def test_data_of_a_large_payload_has_its_full_length(tx, rx):
    payload = bytes(range(256)) * 1000
    tx.send(payload)
    h = rx.recv(timeout=5)
    assert h.data.nbytes == len(payload)
    assert h.data == payload


def test_data_after_release_raises_closed(tx, rx):
    tx.send(b"zero-copy")
    h = rx.recv(timeout=5)
    h.release()
    with pytest.raises(shmchan.Closed):
        _ = h.data


def test_data_pins_the_record_and_follows_a_redelivery(tx, rx):
    tx.send(b"first", keys="k")
    h = rx.recv(timeout=5)
    assert h.data == b"first"
    h.nack()
    again = rx.recv(timeout=5)
    assert (again.attempt, again.data.tobytes()) == (2, b"first")
    again.release()


def test_a_view_keeps_the_mapping_alive_after_everything_else_is_gone(make_channel):
    ch = make_channel()
    with ch.sender() as tx:
        tx.send(b"still readable")
    rx = ch.receiver()
    h = rx.recv(timeout=5)
    view = h.data
    h.release()
    rx.close()
    ch.close()
    del h, rx, ch, tx
    gc.collect()
    assert view.tobytes() == b"still readable"  # the bytes may be stale, never unmapped
    view.release()


# --- release ------------------------------------------------------------------------


def test_release_frees_the_key(tx, rx):
    tx.send(b"1", keys="k")
    tx.send(b"2", keys="k")
    rx.recv(timeout=5).release()
    assert rx.recv(timeout=5).payload == b"2"


def test_ack_frees_the_key(tx, rx):
    tx.send(b"1", keys="k")
    tx.send(b"2", keys="k")
    rx.recv(timeout=5).ack()
    assert rx.recv(timeout=5).payload == b"2"


def test_second_release_is_a_no_op(ch, tx, rx):
    tx.send(b"1", keys="k")
    h = rx.recv(timeout=5)
    h.release()
    h.release()
    h.ack()
    assert ch.stats().released == 1


def test_with_releases_on_exit(tx, rx):
    tx.send(b"1", keys="k")
    tx.send(b"2", keys="k")
    with rx.recv(timeout=5) as h:
        assert h.payload == b"1"
        assert rx.try_recv() is None
    assert rx.recv(timeout=5).payload == b"2"


def test_with_returns_the_handle(tx, rx):
    tx.send(b"1")
    h = rx.recv(timeout=5)
    with h as entered:
        assert entered is h


def test_with_releases_when_the_body_raises(tx, rx):
    tx.send(b"1", keys="k")
    tx.send(b"2", keys="k")
    with pytest.raises(RuntimeError):
        with rx.recv(timeout=5):
            raise RuntimeError("handler failed")
    assert rx.recv(timeout=5).payload == b"2"


def test_garbage_collected_handle_releases_its_keys(tx, rx):
    tx.send(b"1", keys="k")
    tx.send(b"2", keys="k")
    h = rx.recv(timeout=5)
    del h
    gc.collect()
    assert rx.recv(timeout=5).payload == b"2"


def test_dropped_handle_is_released_not_redelivered(ch, tx, rx):
    tx.send(b"1", keys="k")
    rx.recv(timeout=5)  # result dropped at once
    gc.collect()
    assert rx.try_recv() is None
    assert ch.stats().released == 1


CYCLE_SCRIPT = """
import gc, sys, shmchan
name, close = sys.argv[1], sys.argv[2] == "close"
try:
    ch = shmchan.Channel.create(name, capacity=1 << 20)
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"1", keys="k")
    class Holder: pass
    cycle = Holder()
    cycle.self, cycle.objects = cycle, (ch, tx, rx, rx.recv(timeout=5))
    if close:
        rx.close(); tx.close(); ch.close()
    del ch, tx, rx, cycle
    gc.collect()  # the handle is finalized together with everything it came from
    print("survived")
finally:
    shmchan.unlink(name)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("close", ["close", "open"])
def test_handle_collected_in_a_cycle_with_its_channel_does_not_crash(chan_name, close):
    """Exception tracebacks make such cycles all the time (a test failing with a live handle)."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CYCLE_SCRIPT), chan_name, close],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, f"child died with {proc.returncode}:\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip() == "survived"


def test_release_after_the_channel_closed_does_not_crash(make_channel):
    ch = make_channel()
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(b"1", keys="k")
        h = rx.recv(timeout=5)
    ch.close()
    h.release()  # may be a no-op, must not crash
    assert h.seq >= 0


def test_release_after_the_receiver_closed_does_not_crash(ch, tx):
    tx.send(b"1", keys="k")
    rx = ch.receiver()
    h = rx.recv(timeout=5)
    rx.close()
    h.release()  # may be a no-op, must not crash
    assert h.seq >= 0


# --- nack -------------------------------------------------------------------------------


def test_nack_then_release_is_a_no_op(ch, tx, rx):
    tx.send(b"1", keys="k")
    h = rx.recv(timeout=5)
    h.nack()
    h.release()
    st = ch.stats()
    assert (st.released, st.queued) == (0, 1)


# --- leases ----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_expired_lease_redelivers_the_message(make_channel):
    ch = make_channel(lease=0.3)
    with ch.sender() as tx, ch.receiver() as rx:
        seq = tx.send(b"x", keys="k")
        first = rx.recv(timeout=5)
        again = rx.recv(timeout=10)
        assert (again.seq, again.attempt) == (seq, 2)
        assert first.seq == seq


@pytest.mark.timeout(30)
def test_release_of_an_expired_handle_does_not_free_the_redelivered_one(make_channel):
    ch = make_channel(lease=0.3)
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(b"1", keys="k")
        tx.send(b"2", keys="k")
        expired = rx.recv(timeout=5)
        again = rx.recv(timeout=10)
        assert again.seq == expired.seq
        expired.release()  # stale
        assert rx.try_recv() is None
        again.release()
        assert rx.recv(timeout=5).payload == b"2"


@pytest.mark.timeout(30)
def test_extend_keeps_the_lease_alive(make_channel):
    ch = make_channel(lease=0.5)
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(b"x", keys="k")
        h = rx.recv(timeout=5)
        h.extend(30)
        with pytest.raises(shmchan.Empty):
            rx.recv(timeout=1.5)
        h.release()


@pytest.mark.timeout(30)
def test_released_handle_is_not_redelivered_after_its_lease(make_channel):
    ch = make_channel(lease=0.2)
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(b"x", keys="k")
        rx.recv(timeout=5).release()
        with pytest.raises(shmchan.Empty):
            rx.recv(timeout=0.8)


def test_no_lease_means_no_redelivery(tx, rx):
    tx.send(b"x", keys="k")
    h = rx.recv(timeout=5)
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=0.5)
    h.release()


# --- max_attempts / dead letters ----------------------------------------------------------


def test_message_out_of_attempts_becomes_a_dead_letter(make_channel):
    ch = make_channel(max_attempts=2)
    with ch.sender() as tx, ch.receiver() as rx:
        tx.send(b"poison", keys="k")
        tx.send(b"next", keys="k")
        attempts = []
        for _ in range(2):
            h = rx.recv(timeout=5)
            assert h.payload == b"poison"
            attempts.append(h.attempt)
            h.nack()
        assert attempts == [1, 2]
        assert rx.recv(timeout=5).payload == b"next"  # keys freed, not redelivered again
        assert ch.stats().dead_letters == 1


# --- pickling in one process -------------------------------------------------------------


def test_unpickled_handle_reports_the_same_message(tx, rx):
    seq = tx.send(b"payload", keys=("k", 3))
    h = rx.recv(timeout=5)
    copy = pickle.loads(pickle.dumps(h))
    assert (copy.seq, copy.keys, copy.payload, copy.attempt) == (seq, ("k", 3), b"payload", 1)


def test_unpickled_handle_can_release(tx, rx):
    tx.send(b"1", keys="k")
    tx.send(b"2", keys="k")
    h = rx.recv(timeout=5)
    copy = pickle.loads(pickle.dumps(h))
    copy.release()
    assert rx.recv(timeout=5).payload == b"2"


def test_pickled_away_handle_is_not_released_by_garbage_collection(tx, rx):
    tx.send(b"1", keys="k")
    tx.send(b"2", keys="k")
    h = rx.recv(timeout=5)
    copy = pickle.loads(pickle.dumps(h))
    del h
    gc.collect()
    assert rx.try_recv() is None  # the unpickled copy is the holder now
    copy.release()
    assert rx.recv(timeout=5).payload == b"2"


def test_release_through_a_second_unpickled_copy_is_a_no_op(tx, rx):
    tx.send(b"1", keys="k")
    tx.send(b"2", keys="k")
    tx.send(b"3", keys="k")
    blob = pickle.dumps(rx.recv(timeout=5))
    first, second = pickle.loads(blob), pickle.loads(blob)
    first.release()
    now_holding = rx.recv(timeout=5)
    second.release()  # stale: must not free "k" from now_holding
    assert rx.try_recv() is None
    assert now_holding.payload == b"2"


def test_release_many_frees_every_key_once(ch, tx, rx):
    for i in range(6):
        tx.send(i, keys=f"k{i % 3}")
    first = rx.recv_many(16, timeout=5)
    assert sorted(h.payload for h in first) == [0, 1, 2]
    rx.release_many(first + first)  # duplicates and second releases are no-ops
    second = rx.recv_many(16, timeout=5)
    assert sorted(h.payload for h in second) == [3, 4, 5]
    rx.release_many(second)
    assert rx.try_recv() is None
    assert ch.stats().released == 6


@pytest.mark.parametrize("closed", ["receiver", "channel"])
def test_release_many_after_close_does_what_release_does(make_channel, closed):
    """Handles stay valid when their receiver (or channel object) is closed, and each
    one's release() still works; release_many through the closed receiver raised Closed
    instead, even for an empty list, leaving the handles held."""
    ch = make_channel()
    tx, rx = ch.sender(), ch.receiver()
    for i in range(4):
        tx.send(b"m%d" % i, keys=f"k{i}")
    hs = rx.recv_many(4, timeout=5)
    assert len(hs) == 4
    (rx if closed == "receiver" else ch).close()
    hs[0].release()
    rx.release_many(hs[1:3])
    rx.release_many([])
    rx.release_many(hs[1:3])  # released already: a no-op, as a second release() is
    assert [h._done for h in hs] == [True, True, True, False]
    with pytest.raises(shmchan.UnsupportedType):
        rx.release_many([object()])
    if closed == "receiver":
        assert ch.stats().released == 3
        hs[3].release()
        assert ch.stats().released == 4


@pytest.mark.parametrize("how", ["release", "nack"])
def test_a_released_handle_pickles_to_a_no_op_one(tx, rx, how):
    """Pickling a handle after its release raised Closed, where hand_over() of the same
    handle sends a no-op one (and the comment in Handle.__reduce__ promised as much):
    a second release is a no-op (the handle contract), so a released handle travels as one."""
    tx.send(b"1", keys="k")
    tx.send(b"2", keys="k")
    h = rx.recv(timeout=5)
    getattr(h, how)()
    copy = pickle.loads(pickle.dumps(h))
    assert copy._done and "released" in repr(copy)
    with pytest.raises(shmchan.Closed):
        copy.payload  # noqa: B018 - the property read is the test
    now_holding = rx.recv(timeout=5)
    copy.release()  # a no-op: must not free "k" from the handle holding it now
    copy.nack()
    assert rx.try_recv() is None
    assert now_holding.payload == (b"1" if how == "nack" else b"2")
    now_holding.release()


_ADOPT_OUT_OF_MEMORY = """
import sys
import _testcapi
import shmchan

ch = shmchan.Channel.open(sys.argv[1])
tx, rx = ch.sender(), ch.receiver()
want = [b"m%d" % i for i in range(4)]
for i, p in enumerate(want):
    tx.send(p, keys=f"k{i}")
fail_from, stop_failing, adopt = _testcapi.set_nomemory, _testcapi.remove_mem_hooks, shmchan.adopt
for start in range(400):  # the n-th allocation fails, for n = 0, 1, ... until adopt succeeds
    hs = rx.recv_many(4, timeout=5)
    if sorted(h.payload for h in hs) != want or ch.stats().released:
        print("lost at", start, sorted(h.payload for h in hs), ch.stats().released)
        sys.exit(1)
    blob = shmchan.hand_over(hs)
    del hs
    got = None
    fail_from(start, 0)
    try:
        got = adopt(blob)
    except MemoryError:
        pass
    finally:
        stop_failing()
    if got is not None:
        sys.exit(0 if len(got) == 4 and not ch.stats().released else 3)
    for h in adopt(blob):  # whatever is still in transit, and give it back too
        h.nack()
sys.exit(2)
"""


_RECV_OUT_OF_MEMORY = """
import sys
import _testcapi
import shmchan

ch = shmchan.Channel.open(sys.argv[1])
tx, rx = ch.sender(), ch.receiver()
want = [b"m%d" % i for i in range(4)]
for i, p in enumerate(want):
    tx.send(p, keys=f"k{i}")
fail_from, stop_failing = _testcapi.set_nomemory, _testcapi.remove_mem_hooks
recv = rx._recv_many_slow
for start in range(400):  # the n-th allocation fails, for n = 0, 1, ... until recv succeeds
    got = None
    fail_from(start, 0)
    try:
        got = recv(4, 5)
    except MemoryError:
        pass
    finally:
        stop_failing()
    if ch.stats().released:
        print("lost at", start, ch.stats())
        sys.exit(1)
    if got is not None:
        sys.exit(0 if sorted(h.payload for h in got) == want else 3)
sys.exit(2)
"""


@pytest.mark.timeout(120)
def test_recv_running_out_of_memory_part_way_loses_nothing(make_channel):
    """recv's waiting path (C's receive loop, entered here through _recv_many_slow) takes
    messages out with one core call and then makes a Handle for each. Out of memory
    part-way, the Handles made were dropped, releasing their messages undelivered, and
    the rest stayed held by this process. Every allocation is made to fail in turn, in a
    child process."""
    pytest.importorskip("_testcapi")
    ch = make_channel()
    out = subprocess.run(
        [sys.executable, "-c", _RECV_OUT_OF_MEMORY, ch.name],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(120)
def test_adopt_running_out_of_memory_part_way_loses_nothing(make_channel):
    """adopt() makes a Handle per message after one core call has made this process
    their holder. Out of memory part-way (for the list or a Handle), the Handles made so
    far were dropped, which releases their messages (taken out, never processed), and
    the rest stayed held by this live process. Every allocation is made to fail in turn
    (in a child process: _testcapi.set_nomemory); each time, every message must come
    back, and none may count as released."""
    pytest.importorskip("_testcapi")
    ch = make_channel()
    out = subprocess.run(
        [sys.executable, "-c", _ADOPT_OUT_OF_MEMORY, ch.name],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stdout + out.stderr


# --- threads of the receiving process --------------------------------------------------


@pytest.mark.timeout(120)
def test_threads_receiving_and_releasing_at_once_hand_out_each_message_once_in_key_order(
    make_channel,
):
    """The receiver's lock (csrc/rxlock.h) keeps one thread at a time in its tables. Four
    threads call the core's receive and release directly (cffi lets go of the GIL for
    each call, so they run at the same time): every message comes out once, in order on
    its key, and the tables check out afterwards."""
    import threading
    import time

    from shmchan._lib import ffi, lib
    from tests.procs import check_core

    ch = make_channel(capacity=8 << 20)
    rx = ch.receiver()
    n, nkeys = 20_000, 16
    with ch.sender() as tx:
        seqs = tx.send_many([(b"m", i % nkeys) for i in range(n)], timeout=20)
    index = {seq: i for i, seq in enumerate(seqs)}
    seg = rx._seg.ptr
    got: dict[int, list[int]] = {k: [] for k in range(nkeys)}
    seen = 0
    mu = threading.Lock()
    errors: list[str] = []
    deadline = time.monotonic() + 60

    def consume() -> None:
        nonlocal seen
        msgs = ffi.new("shm_msg[32]")
        count = ffi.new("uint32_t *")
        stall = ffi.new("shm_stall *")
        wake = ffi.new("uint32_t *")
        wakes = ffi.new("int *")
        slots = ffi.new("uint32_t[32]")
        gens = ffi.new("uint32_t[32]")
        while time.monotonic() < deadline:
            with mu:
                if seen >= n or errors:
                    return
            rc = lib.shm_recv(seg, msgs, 32, count, 0, stall, wake)
            if rc < 0:
                errors.append(f"recv {rc}")
                return
            k = count[0]
            with mu:  # recorded before the release: the next on its key waits for it
                for j in range(k):
                    i = index[msgs[j].seq]
                    got[i % nkeys].append(i)
                seen += k
            for j in range(k):
                slots[j], gens[j] = msgs[j].slot, msgs[j].gen
            if k and lib.shm_release_many(seg, slots, gens, k, wakes) < 0:
                errors.append("release_many")
                return

    threads = [threading.Thread(target=consume, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    assert sum(len(v) for v in got.values()) == n
    for key, seq in got.items():
        assert seq == list(range(key, n, nkeys)), key  # each once, in key order
    check_core(rx)
    st = ch.stats()
    assert (st.delivered, st.released, st.inflight, st.held_keys) == (n, n, 0, 0)


@pytest.mark.timeout(60)
def test_the_receivers_lock_keeps_threads_apart(ch):
    """The lock itself (csrc/rxlock.h), under contention: threads that count under it,
    with a pause inside, lose no round."""
    from shmchan._lib import ffi, lib

    count = ffi.new("uint64_t *")
    assert lib.shm_test_rx_lock(ch._seg.ptr, 4, 20_000, count) == 0
    assert count[0] == 4 * 20_000
