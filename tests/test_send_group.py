"""send_many and send_batch claim ring space for a run of small records at once (a group,
csrc/ring.c): order, seqs, keys and payloads are those of the batch; large records in
the batch go one by one; a full channel is waited on; and a producer killed inside a
group leaves every record whole or absent."""

from __future__ import annotations

import array
import contextlib
import os
import threading
import time
from typing import Any

import pytest

import shmchan
from shmchan._lib import ffi, lib
from tests.procs import child_at_pause, kill_at_pause


def _drain(rx: shmchan.Receiver) -> list[tuple[int, bytes, tuple[Any, ...]]]:
    out = []
    while (h := rx.try_recv()) is not None:
        out.append((h.seq, h.payload, h.keys))
        h.release()
    return out


def test_a_mixed_batch_arrives_in_order_with_consecutive_seqs(make_channel: Any) -> None:
    ch = make_channel(capacity=4 << 20)
    tx, rx = ch.sender(), ch.receiver()
    # small records (grouped) with large ones (sent alone) between them, keys of every kind
    items: list[tuple[bytes, Any]] = []
    for i in range(600):
        size = 3000 if i % 97 == 5 else i % 50
        keys: Any = [(), i % 7, f"k{i % 5}", (b"b", i % 3, "s"), None][i % 5]
        items.append((bytes([i & 0xFF]) * size, keys))
    seqs = tx.send_many(items, timeout=5)
    assert seqs == list(range(seqs[0], seqs[0] + len(items)))
    got = _drain(rx)
    assert [s for s, _, _ in got] == seqs
    for (_, payload, keys), (sent, sent_keys) in zip(got, items, strict=True):
        assert payload == sent
        want = () if sent_keys is None else sent_keys
        want = tuple(dict.fromkeys(want if isinstance(want, tuple) else (want,)))
        assert keys == want


def test_send_batch_groups_keep_every_message(make_channel: Any) -> None:
    ch = make_channel(capacity=4 << 20)
    tx, rx = ch.sender(), ch.receiver()
    n = 1000
    lens = array.array("Q", [(i % 9) * 8 for i in range(n)])
    data = b"".join(bytes([i & 0xFF]) * lens[i] for i in range(n))
    seqs = list(tx.send_batch(data, lens, [i % 13 for i in range(n)], timeout=5))
    got = _drain(rx)
    assert [s for s, _, _ in got] == seqs
    assert [p for _, p, _ in got] == [bytes([i & 0xFF]) * lens[i] for i in range(n)]
    assert [k for _, _, k in got] == [(i % 13,) for i in range(n)]


@pytest.mark.timeout(60)
def test_a_batch_larger_than_the_channel_waits_for_space_and_loses_nothing(
    make_channel: Any,
) -> None:
    ch = make_channel(capacity=64 << 10)
    tx, rx = ch.sender(), ch.receiver()
    n = 5000  # about 10 times the channel
    items = [(i.to_bytes(4, "little") * 16, i % 11) for i in range(n)]
    got: list[int] = []
    done = threading.Event()

    def consume() -> None:
        deadline = time.monotonic() + 30
        while len(got) < n and time.monotonic() < deadline:
            try:
                h = rx.recv(timeout=0.5)
            except shmchan.Empty:
                continue
            got.append(int.from_bytes(h.payload[:4], "little"))
            h.release()
        done.set()

    t = threading.Thread(target=consume)
    t.start()
    try:
        seqs = tx.send_many(items, timeout=20)
    finally:
        done.wait(40)
        t.join(10)
    assert len(seqs) == n
    assert got == list(range(n))  # one key order per producer: all of it, in order


_GROUP_VICTIM = """
    import sys
    import shmchan
    from shmchan._lib import lib
    name, notify, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tx = shmchan.Sender.open(name)
    tx.send(b"before", "k", timeout=5)  # registered: the batch takes the C path
    lib.shm_test_pause_at(lib.SHM_PAUSE_SEND_GROUP, notify, wait)
    tx.send_many([(bytes([i]) * 40, "k") for i in range(8)], timeout=5)
"""


@pytest.mark.timeout(120)
def test_a_producer_killed_inside_a_group_leaves_whole_records_and_stops_nobody(
    make_channel: Any,
) -> None:
    ch = make_channel(capacity=1 << 20)
    rx = ch.receiver()
    # killed with the group's first record committed and its second claimed, unwritten
    kill_at_pause(_GROUP_VICTIM, ch.name, "its send_many group")
    with ch.sender() as tx:
        after = tx.send(b"after", "k", timeout=5)
    got: list[tuple[int, bytes, tuple[Any, ...]]] = []
    deadline = time.monotonic() + 30
    while not any(s == after for s, _, _ in got) and time.monotonic() < deadline:
        try:
            h = rx.recv(timeout=0.5)
        except shmchan.Empty:
            continue
        got.append((h.seq, h.payload, h.keys))
        h.release()
    payloads = [p for _, p, _ in got]
    assert payloads == [b"before", bytes([0]) * 40, b"after"], payloads
    assert all(k == ("k",) for _, _, k in got)
    assert ch.stats().discarded >= 1  # the dead claim was repaired, not delivered
    assert rx.try_recv() is None


@pytest.mark.timeout(120)
def test_a_dead_producers_repaired_claim_at_the_end_of_the_ring_frees_its_space(
    make_channel: Any,
) -> None:
    """Nothing follows the repaired claim: no release comes after it, so the receiver's
    poll that steps over it must also move the ring's head past it."""
    ch = make_channel(capacity=1 << 20)
    rx = ch.receiver()
    kill_at_pause(_GROUP_VICTIM, ch.name, "its send_many group")
    got: list[bytes] = []
    deadline = time.monotonic() + 30
    while (len(got) < 2 or ch.stats().discarded == 0) and time.monotonic() < deadline:
        try:
            h = rx.recv(timeout=0.2)
        except shmchan.Empty:
            continue
        got.append(h.payload)
        h.release()
    assert got == [b"before", bytes([0]) * 40]
    assert ch.stats().discarded >= 1
    assert rx.try_recv() is None
    assert ch.stats().used_bytes == 0  # head passed the repaired claim too


@pytest.mark.timeout(60)
def test_recv_batch_that_waits_returns_the_messages_sent_meanwhile(make_channel: Any) -> None:
    ch = make_channel()
    tx, rx = ch.sender(), ch.receiver()
    with pytest.raises(shmchan.Empty):
        rx.recv_batch(8, timeout=0.01)
    timer = threading.Timer(0.2, lambda: tx.send_many([(b"m%d" % i, i) for i in range(5)]))
    timer.start()
    try:
        got: list[bytes] = []
        deadline = time.monotonic() + 20
        while len(got) < 5 and time.monotonic() < deadline:
            b = rx.recv_batch(8, timeout=10)  # waits: nothing is queued when it starts
            assert isinstance(b, shmchan.Batch)
            got += [b.payload(i) for i in range(len(b))]
            assert [b.keys(i) for i in range(len(b))] == [(int(p[1:]),) for p in got[-len(b) :]]
            b.release()
    finally:
        timer.join(10)
    assert got == [b"m%d" % i for i in range(5)]
    assert rx.try_recv() is None


def test_groups_step_over_islands_of_pinned_views(make_channel: Any) -> None:
    # Views held on records the ring has lapped (islands): the groups behind them claim
    # around them and never write into their bytes.
    ch = make_channel(capacity=256 << 10)
    tx, rx = ch.sender(), ch.receiver()
    pinned: list[tuple[shmchan.Handle, memoryview, bytes]] = []
    n = 0
    for round_ in range(300):
        big = bytes([round_ & 0xFF]) * 3000  # alone: larger than a group's records
        tx.send(big, f"p{round_}", timeout=5)
        batch = [(n.to_bytes(4, "little") * 8, n % 7) for n in range(n, n + 40)]
        n += len(batch)
        tx.send_many(batch, timeout=5)  # Full after 5 s fails the test
        h = rx.recv(timeout=5)
        assert h.payload == big
        if round_ % 5 == 0:
            pinned.append((h, h.data, big))  # pins the record where it lies
        else:
            h.release()
        for want, _ in batch:
            m = rx.recv(timeout=5)
            assert m.payload == want
            m.release()
        if len(pinned) > 8:
            h, view, want = pinned.pop(0)
            assert view == want  # never overwritten while it was an island
            h.release()
    for h, view, want in pinned:
        assert view == want
        h.release()
    assert rx.try_recv() is None


def test_groups_in_a_file_backed_channel_read_back_after_reopening(
    chan_name: str, tmp_path: Any
) -> None:
    path = str(tmp_path / "seg")
    items = [(bytes([i & 0xFF]) * (i % 60), (f"k{i % 9}", i % 4)) for i in range(500)]
    with shmchan.Channel.create(chan_name, path=path, capacity=1 << 20) as ch:
        seqs = ch.sender().send_many(items, timeout=5)
    with shmchan.Channel.open(chan_name, path=path) as ch:
        rx = ch.receiver()
        got = _drain(rx)
        rx.close()
    assert [s for s, _, _ in got] == seqs
    assert [(p, k) for _, p, k in got] == items


@pytest.mark.timeout(120)
def test_a_producer_frozen_inside_a_group_holds_up_only_its_keys(make_channel: Any) -> None:
    ch = make_channel(capacity=1 << 20)
    rx = ch.receiver()
    with child_at_pause(_GROUP_VICTIM, ch.name, "its send_many group") as (child, go_on):
        # stopped inside the group (alive): another producer's message on another key
        with ch.sender() as tx:
            tx.send(b"other", "other", timeout=5)
        got: list[bytes] = []
        deadline = time.monotonic() + 20
        while b"other" not in got and time.monotonic() < deadline:
            with contextlib.suppress(shmchan.Empty):
                h = rx.recv(timeout=0.5)
                got.append(h.payload)
                h.release()
        assert got == [b"before", bytes([0]) * 40, b"other"], got
        os.write(go_on, b"\0")  # let it finish: the rest of its batch arrives
        assert child.wait(30) == 0
        while len(got) < 10 and time.monotonic() < deadline + 20:
            with contextlib.suppress(shmchan.Empty):
                h = rx.recv(timeout=0.5)
                got.append(h.payload)
                h.release()
        assert got[3:] == [bytes([i]) * 40 for i in range(1, 8)]


@pytest.mark.parametrize("blob", [b"", b"\x02", b"\x02\x00i", b"\x01\x00ix", b"\x03\x00i\x01"])
def test_the_core_refuses_a_one_key_blob_whose_length_is_wrong(
    make_channel: Any, blob: bytes
) -> None:
    # The key blob comes from the producer's process: the core checks its framing (a
    # length, then that many bytes, filling the blob exactly) for one key as for many,
    # in a single send and in a batch, and sends nothing of a batch holding a bad one.
    from shmchan._lib import ffi, lib

    ch = make_channel()
    tx, rx = ch.sender(), ch.receiver()
    tx.send(b"first", keys="k")  # registers the producer
    ptr = tx._seg.ptr
    seq, stall, wake = ffi.new("uint64_t *"), ffi.new("shm_stall *"), ffi.new("int *")
    rc = lib.shm_send(ptr, lib.SHM_PAYLOAD_RAW, b"x", 1, blob, len(blob), 1, seq, stall, wake)
    assert rc == lib.SHM_E_INVALID
    good = b"\x02\x00i\x01"
    n = 3
    keys = good + blob + good
    rc = lib.shm_send_many(
        ptr, n, ffi.new("uint32_t[]", [lib.SHM_PAYLOAD_RAW] * n), b"abc", 3,
        ffi.new("uint64_t[]", [1] * n), keys, len(keys),
        ffi.new("uint32_t[]", [len(good), len(blob), len(good)]), ffi.new("uint32_t[]", [1] * n),
        ffi.new("uint64_t[]", n), ffi.new("uint32_t *"), stall, wake,
    )  # fmt: skip
    assert rc == lib.SHM_E_INVALID
    assert [p for _, p, _ in _drain(rx)] == [b"first"]


def test_groups_that_cross_the_end_of_the_ring_arrive_whole(make_channel: Any) -> None:
    # A group's records are written from its first record's address onwards, through the
    # second mapping of the ring where they pass its end. The receiver keeps one batch
    # unread, so the ring is never empty and never rewinds to its start: over many laps,
    # groups start at every offset and many cross the end.
    ch = make_channel(capacity=64 << 10)
    tx, rx = ch.sender(), ch.receiver()
    sent: list[tuple[bytes, tuple[Any, ...]]] = []
    got: list[tuple[bytes, tuple[Any, ...]]] = []
    for b in range(600):
        n = 5 + b % 23
        batch = [
            (bytes([(b + i) & 0xFF]) * ((b * 7 + i * 3) % 61), (f"k{(b + i) % 5}" * (i % 4),))
            for i in range(n)
        ]
        if b % 2:
            lens = array.array("Q", [len(p) for p, _ in batch])
            tx.send_batch(b"".join(p for p, _ in batch), lens, [k for _, k in batch], timeout=5)
        else:
            tx.send_many(batch, timeout=5)
        sent.extend(batch)
        while len(got) < len(sent) - n:  # all but the batch just sent
            h = rx.recv(timeout=5)
            got.append((h.payload, h.keys))
            h.release()
    got.extend((p, k) for _, p, k in _drain(rx))
    assert ch.stats().sent * 80 > 10 * (64 << 10)  # records of 80 bytes or more: 10 laps
    assert got == sent


@pytest.mark.timeout(120)
def test_a_producer_killed_inside_a_group_that_crosses_the_end_of_the_ring(
    make_channel: Any,
) -> None:
    # As the kill test above, with the group's records running past the ring's last byte
    # (written through its second mapping): the repaired claim and the records after it
    # are found at the same positions by everyone, and nothing is held up.
    cap = 64 << 10
    ch = make_channel(capacity=cap)
    tx, rx = ch.sender(), ch.receiver()
    # fillers up to ~300 bytes before the end, read but for the last one, so that the ring
    # is never empty (an empty ring would rewind to its start)
    record = 56 + 16 + 8  # fixed part, one hash and link, the one-key blob "k"
    fill = [1000] * 60 + [cap - 300 - 88 - 60 * (record + 1000) - record]
    for size in fill:
        tx.send(b"f" * size, "k", timeout=5)
    for _ in fill[:-1]:
        rx.recv(timeout=5).release()
    out = ffi.new("uint64_t *")
    assert lib.shm_layout_fact(b"header.tail_hint", out) == 0
    tail_at = ffi.cast("uint64_t *", lib.shm_base(rx._seg.ptr) + int(out[0]))[0]
    group_at = tail_at + 88  # after the victim's b"before"
    assert group_at < cap < group_at + 8 * (record + 40)  # the group crosses the end
    kill_at_pause(_GROUP_VICTIM, ch.name, "its send_many group")
    after = tx.send(b"after", "k", timeout=5)
    got: list[bytes] = []
    deadline = time.monotonic() + 30
    while b"after" not in got and time.monotonic() < deadline:
        try:
            h = rx.recv(timeout=0.5)
        except shmchan.Empty:
            continue
        got.append(h.payload)
        assert h.keys == ("k",)
        h.release()
        if h.seq == after:
            break
    assert got == [b"f" * fill[-1], b"before", bytes([0]) * 40, b"after"], got
    assert ch.stats().discarded >= 1
    assert rx.try_recv() is None


def test_a_groups_key_hashes_are_the_keys_own(make_channel: Any) -> None:
    # A group hashes each one-key record's copy of its key (ring.c); the hash must be the
    # one every other path computes, here pause_key's: messages on a paused key of any
    # encoded length (1 to 25 bytes: the tail of the hash is 0 to 7 bytes) are held back,
    # the rest flow.
    ch = make_channel(capacity=4 << 20)
    tx, rx = ch.sender(), ch.receiver()
    keys: list[Any] = [("x" * n) for n in range(25)] + [7, -1, 2**40, 2**63 - 1, b"", b"abcdefgh"]
    paused = keys[::2]
    for k in paused:
        ch.pause_key(k)
    items = [(bytes([i]), keys[i % len(keys)]) for i in range(3 * len(keys))]
    tx.send_many(items, timeout=5)
    assert [k for _, _, (k,) in _drain(rx)] == [k for _, k in items if k not in paused]
    for k in paused:
        ch.resume_key(k)
    assert [k for _, _, (k,) in _drain(rx)] == [k for _, k in items if k in paused]


def test_send_batch_refuses_keys_that_change_while_being_encoded(make_channel: Any) -> None:
    # An iterable key is encoded by Python code, which may change the keys list under
    # send_batch: the batch is refused whole, nothing sent, nothing read past the list.
    ch = make_channel(capacity=1 << 20)
    tx, rx = ch.sender(), ch.receiver()
    keys: list[Any] = []

    class Shrinking:
        def __iter__(self) -> Any:
            keys.clear()
            return iter(["a"])

    keys.extend([1, 2, Shrinking(), 4, 5])
    with pytest.raises(shmchan.InvalidArgument, match="changed size"):
        tx.send_batch(bytes(5), array.array("Q", [1] * 5), keys, timeout=5)
    assert rx.try_recv() is None
    assert ch.stats().sent == 0
