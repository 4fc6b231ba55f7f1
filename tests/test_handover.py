"""A pickled handle is in transit until some process unpickles it (adopts it): bounded.

Pickling marks the handle in transit with a deadline (the channel's `handover=`); the
process that unpickles it in time becomes its holder. A handle nobody adopts in time --
its worker died before unpickling, or the pickle was simply dropped -- is taken back
and redelivered with attempt + 1, keeping its place in key order; unpickling it after
that raises HandoverExpired.
"""

from __future__ import annotations

import gc
import pickle
import time

import pytest
from procs import CTX, WAIT, running

import shmchan


def keep_blob_unread(blob: bytes, results) -> None:
    """A worker that got a pickled handle and never unpickles it (then gets killed)."""
    results.put(len(blob))
    time.sleep(WAIT * 4)


def adopt_and_report(blob: bytes, results) -> None:
    h = pickle.loads(blob)
    results.put((h.seq, h.attempt, h.payload))
    h.release()
    results.put("released")


def test_handover_defaults_to_two_seconds_and_is_configurable(make_channel):
    with pytest.raises(ValueError):
        make_channel(handover=0)
    with pytest.raises(ValueError):
        make_channel(handover=-1.0)
    with pytest.raises(TypeError):
        make_channel(handover="2")
    assert make_channel().handover == 2.0
    assert make_channel(handover=0.25).handover == 0.25


@pytest.mark.timeout(60)
def test_handle_pickled_to_a_worker_killed_before_unpickling_comes_back(make_channel):
    ch = make_channel(handover=0.5)
    tx, rx = ch.sender(), ch.receiver()
    seq = tx.send(b"lost", keys="k")
    tx.send(b"next", keys="k")
    blob = pickle.dumps(rx.recv(timeout=5))
    results = CTX.Queue()
    worker = CTX.Process(target=keep_blob_unread, args=(blob, results))
    with running(worker):
        assert results.get(timeout=WAIT) == len(blob)
        worker.kill()
        worker.join(WAIT)
        h = rx.recv(timeout=WAIT)  # comes back first: it keeps its place on "k"
        assert (h.seq, h.payload, h.attempt) == (seq, b"lost", 2)
        h.release()
        assert rx.recv(timeout=WAIT).payload == b"next"
    stats = ch.stats()
    assert stats.redelivered == 1 and stats.inflight == 0


def test_handle_pickled_and_never_unpickled_comes_back(make_channel):
    ch = make_channel(handover=0.2)
    tx, rx = ch.sender(), ch.receiver()
    seq = tx.send(b"logged", keys="k")
    h = rx.recv(timeout=5)
    pickle.dumps(h)  # e.g. pickled for a log line, and dropped
    del h
    gc.collect()
    again = rx.recv(timeout=WAIT)
    assert (again.seq, again.attempt) == (seq, 2)


def test_unpickling_after_the_deadline_raises_handover_expired(make_channel):
    ch = make_channel(handover=0.2)
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"late", keys="k")
    blob = pickle.dumps(rx.recv(timeout=5))
    again = rx.recv(timeout=WAIT)  # the hand-over ran out: redelivered
    assert again.attempt == 2
    with pytest.raises(shmchan.HandoverExpired) as info:
        pickle.loads(blob)
    assert isinstance(info.value, shmchan.Error)
    again.release()  # the redelivered handle is unaffected


def test_handle_adopted_in_time_is_not_taken_back(make_channel):
    ch = make_channel(handover=0.2)
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"kept", keys="k")
    tx.send(b"next", keys="k")
    copy = pickle.loads(pickle.dumps(rx.recv(timeout=5)))
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=0.6)  # well past the deadline: still held by the adopter
    assert copy.payload == b"kept"
    copy.release()
    assert rx.recv(timeout=WAIT).payload == b"next"


@pytest.mark.timeout(60)
def test_handle_handed_to_a_worker_in_time_is_held_there(make_channel):
    ch = make_channel(handover=2.0)
    tx, rx = ch.sender(), ch.receiver()
    seq = tx.send(b"work", keys="k")
    tx.send(b"next", keys="k")
    h = rx.recv(timeout=5)
    blob = pickle.dumps(h)
    del h
    gc.collect()  # the original no longer releases on collection
    assert rx.try_recv() is None
    results = CTX.Queue()
    worker = CTX.Process(target=adopt_and_report, args=(blob, results))
    with running(worker):
        assert results.get(timeout=WAIT) == (seq, 1, b"work")
        assert results.get(timeout=WAIT) == "released"
        assert rx.recv(timeout=WAIT).payload == b"next"
        worker.join(WAIT)
        assert worker.exitcode == 0
    assert ch.stats().redelivered == 0


# -- a batch of handles: shmchan.hand_over / shmchan.adopt (one core call each) ---------


def adopt_batch_and_report(data: bytes, results) -> None:
    hs = shmchan.adopt(data)
    results.put([(h.seq, h.attempt, h.payload) for h in hs])
    for h in hs:
        h.release()
    results.put("released")


def keep_batch_unread(data: bytes, results) -> None:
    results.put(len(data))
    time.sleep(WAIT * 4)


@pytest.mark.timeout(60)
def test_batch_handed_to_a_worker_is_held_there_then_released(make_channel):
    ch = make_channel(handover=2.0)
    tx, rx = ch.sender(), ch.receiver()
    seqs = [tx.send(b"job%d" % i, keys=f"k{i}") for i in range(5)]
    tx.send(b"next", keys="k0")
    hs = rx.recv_many(5, timeout=5)
    assert [h.seq for h in hs] == seqs
    data = shmchan.hand_over(hs)
    del hs
    gc.collect()  # the originals no longer release on collection
    assert rx.try_recv() is None  # "next" waits: k0 is held by the batch in transit
    results = CTX.Queue()
    worker = CTX.Process(target=adopt_batch_and_report, args=(data, results))
    with running(worker):
        got = results.get(timeout=WAIT)
        assert got == [(s, 1, b"job%d" % i) for i, s in enumerate(seqs)]
        assert results.get(timeout=WAIT) == "released"
        assert rx.recv(timeout=WAIT).payload == b"next"
        worker.join(WAIT)
        assert worker.exitcode == 0
    st = ch.stats()
    assert st.redelivered == 0 and st.released == 6  # the five, then "next"


@pytest.mark.timeout(60)
def test_batch_whose_worker_dies_before_adopting_comes_back_in_key_order(make_channel):
    ch = make_channel(handover=0.5)
    tx, rx = ch.sender(), ch.receiver()
    seqs = [tx.send(b"lost%d" % i, keys="k") if i == 0 else tx.send(b"lost%d" % i, keys=f"j{i}")
            for i in range(3)]  # fmt: skip
    tx.send(b"next", keys="k")
    data = shmchan.hand_over(rx.recv_many(3, timeout=5))
    results = CTX.Queue()
    worker = CTX.Process(target=keep_batch_unread, args=(data, results))
    with running(worker):
        assert results.get(timeout=WAIT) == len(data)
        worker.kill()
        worker.join(WAIT)
        back = []
        while len(back) < 3:
            back += rx.recv_many(3, timeout=WAIT)
        assert sorted((h.seq, h.attempt) for h in back) == [(s, 2) for s in seqs]
        for h in back:
            h.release()
        assert rx.recv(timeout=WAIT).payload == b"next"  # only after "lost0" on "k"


def test_batch_adopted_late_comes_back_as_released_handles(make_channel):
    ch = make_channel(handover=0.2)
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"late", keys="k")
    data = shmchan.hand_over([rx.recv(timeout=5)])
    again = rx.recv(timeout=WAIT)  # the hand-over ran out: redelivered
    assert again.attempt == 2
    (h,) = shmchan.adopt(data)
    with pytest.raises(shmchan.Closed):
        _ = h.data
    h.release()  # a no-op: never a release of the redelivered message
    assert ch.stats().inflight == 1
    again.release()
    assert ch.stats().inflight == 0


def test_batch_adopted_in_time_is_not_taken_back(make_channel):
    ch = make_channel(handover=0.2)
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"kept", keys="k")
    tx.send(b"next", keys="k")
    (copy,) = shmchan.adopt(shmchan.hand_over([rx.recv(timeout=5)]))
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=0.6)  # well past the deadline: held by the adopter
    assert copy.payload == b"kept"
    copy.release()
    assert rx.recv(timeout=WAIT).payload == b"next"


def test_batch_with_a_released_handle_hands_it_over_as_a_no_op(make_channel):
    ch = make_channel()
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"a", keys="a")
    tx.send(b"b", keys="b")
    first, second = rx.recv_many(2, timeout=5)
    first.release()
    a, b = shmchan.adopt(shmchan.hand_over([first, second]))
    assert a._done and not b._done
    assert b.payload == b"b"
    b.release()
    assert ch.stats().released == 2


def test_hand_over_and_adopt_refuse_what_they_cannot_take(make_channel):
    ch, other = make_channel(), make_channel()
    ch.sender().send(b"x")
    other.sender().send(b"y")
    h, g = ch.receiver().recv(timeout=5), other.receiver().recv(timeout=5)
    with pytest.raises(shmchan.InvalidArgument):
        shmchan.hand_over([h, g])  # one channel per batch
    with pytest.raises(shmchan.UnsupportedType):
        shmchan.hand_over([b"not a handle"])
    with pytest.raises(shmchan.InvalidArgument):
        shmchan.adopt(b"junk")
    with pytest.raises(shmchan.InvalidArgument):
        shmchan.adopt(shmchan.hand_over([h])[:-3])  # truncated
    assert shmchan.adopt(shmchan.hand_over([])) == []


def adopt_each_and_report(parts: list[bytes], results) -> None:
    """Adopt each one-handle hand-over on its own; report its payload or that it was lost."""
    out = []
    for part in parts:
        (h,) = shmchan.adopt(part)
        try:
            out.append(bytes(h.data))
        except shmchan.Closed:  # a no-op handle: another process adopted it first
            out.append("taken back")
        h.release()
    results.put(out)


def test_split_hand_over_lets_the_sender_take_back_a_handle_not_yet_adopted(make_channel):
    ch = make_channel(handover=60.0)
    tx, rx = ch.sender(), ch.receiver()
    for i in range(3):
        tx.send(b"job%d" % i, keys=f"k{i}")
    data = shmchan.hand_over(rx.recv_many(3, timeout=5))
    parts = shmchan.split_hand_over(data)
    assert len(parts) == 3
    (mine,) = shmchan.adopt(parts[1])  # taken back here first: the worker loses it
    assert bytes(mine.data) == b"job1"
    results = CTX.Queue()
    worker = CTX.Process(target=adopt_each_and_report, args=(parts, results))
    with running(worker):
        assert results.get(timeout=WAIT) == [b"job0", "taken back", b"job2"]
        worker.join(WAIT)
    mine.release()
    assert ch.stats().released == 3 and ch.stats().inflight == 0
    with pytest.raises(shmchan.InvalidArgument):
        shmchan.split_hand_over(data[:-3])
