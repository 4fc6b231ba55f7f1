"""Overflow to disk (shmchan/overflow.py): a full channel created with overflow=DIR takes
sends into a file instead of making them wait, and its receiver takes them back in order."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import pickle
import random
import signal
import struct
import time
from pathlib import Path
from typing import Any

import pytest
from procs import CTX, WAIT, run_shmchan, running, take_receiver_seat

import shmchan
from shmchan import overflow
from shmchan._lib import ffi, lib

SMALL = 64 << 10


def _file(ch: shmchan.Channel, d: Path) -> Path:
    files = list(d.glob(f"shmchan.{ch.name}.*.overflow"))
    assert len(files) == 1, files
    return files[0]


def _ovf_state(ch: shmchan.Channel) -> Any:
    st = ffi.new("shm_ovf_state *")
    assert lib.shm_ovf_read(ch._live().ptr, st, ffi.NULL, 0) == 0
    return st


def _skipped(ch: shmchan.Channel) -> int:
    """Records the drain found corrupt and skipped."""
    return int(_ovf_state(ch).skipped)


def _spill_numbers(ch: shmchan.Channel, on_disk: int) -> tuple[shmchan.Sender, int]:
    """Send pickled 0, 1, ... until `on_disk` of them are in the file: (sender, count)."""
    tx = ch.sender()
    sent = 0
    while _on_disk(ch) < on_disk:
        tx.send(pickle.dumps(sent), timeout=0)
        sent += 1
    return tx, sent


def _on_disk(ch: shmchan.Channel) -> int:
    """Messages in the overflow file (what stats() says, without its producer sweep)."""
    use = overflow.usage(ch._live())
    return 0 if use is None else use.messages


def _drain(rx: shmchan.Receiver, n: int, limit: float = WAIT) -> list[Any]:
    """n payloads, each released at once (so the hand-out order is the seq order)."""
    out = []
    deadline = time.monotonic() + limit
    while len(out) < n:
        assert time.monotonic() < deadline, f"only {len(out)} of {n} messages came"
        h = rx.recv(timeout=max(0.01, deadline - time.monotonic()))
        out.append(h.payload)
        h.release()
    return out


# -- producers (children) --------------------------------------------------------------
def _stamped_producer(name: str, p: int, n: int, lock: Any, counter: Any) -> None:
    """Sends n messages, each stamped under a shared lock with a global number, so the
    test knows the order in which all sends were accepted. timeout=0: a Full fails it."""
    tx = shmchan.Sender.open(name)
    for i in range(n):
        with lock:
            stamp = counter.value
            counter.value += 1
            tx.send((p, i, stamp, b"x" * 150), keys=(f"k{(i * 7 + p) % 5}",), timeout=0)


def _free_producer(name: str, p: int, n: int) -> None:
    """Sends n messages (n a multiple of 6), in batches of 3 and one by one in turn."""
    tx = shmchan.Sender.open(name)
    for i in range(0, n, 6):
        tx.send_many([((p, j, b"y" * 100), (f"k{j % 4}",)) for j in range(i, i + 3)], 0)
        for j in range(i + 3, i + 6):
            tx.send((p, j, b"y" * 100), keys=(f"k{j % 4}",), timeout=0)


def _slow_appender(name: str, returned: Any, size: int) -> None:
    """Big messages (long writes), each one's index stored once its send returned."""
    tx = shmchan.Sender.open(name)
    i = 0
    while True:
        body = struct.pack("<Q", i) * (size // 8)
        tx.send(body, keys=("one",), timeout=0)
        returned.value = i + 1
        i += 1


def _slow_receiver(name: str, got: Any) -> None:
    """Takes messages one by one, slowly, recording each one's number."""
    ch = shmchan.Channel.open(name)
    rx = ch.receiver()
    while True:
        h = rx.recv(timeout=WAIT)
        got[h.payload[0] % len(got)] += 1
        h.release()
        time.sleep(0.002)


# -- the tests --------------------------------------------------------------------------
def test_a_burst_far_past_capacity_is_taken_without_full_and_delivered_in_order(
    chan_name: str, tmp_path: Path
) -> None:
    ch = shmchan.Channel.create(chan_name, capacity=SMALL, overflow=tmp_path)
    try:
        lock, counter = CTX.Lock(), CTX.Value("q", 0)
        n = 1500  # 3 x 1500 x ~200 bytes: about 14 times the ring
        procs = [
            CTX.Process(target=_stamped_producer, args=(chan_name, p, n, lock, counter))
            for p in range(3)
        ]
        with running(*procs):
            for p in procs:
                p.join(WAIT)
        assert [p.exitcode for p in procs] == [0, 0, 0]  # no Full: nobody waited
        st = ch.stats()
        assert st.overflow_messages > 0 and st.overflow_bytes > st.capacity
        with ch.receiver() as rx:
            got = _drain(rx, 3 * n)
            with pytest.raises(shmchan.Empty):
                rx.recv(timeout=0.2)  # exactly once: nothing more
        assert sorted((p, i) for p, i, _s, _b in got) == [
            (p, i) for p in range(3) for i in range(n)
        ]
        for p in range(3):  # each producer's order
            mine = [i for q, i, _s, _b in got if q == p]
            assert mine == sorted(mine)
        for k in range(5):  # each key's order: the order the sends were accepted
            stamps = [s for q, i, s, _b in got if (i * 7 + q) % 5 == k]
            assert stamps == sorted(stamps)
        stamps = [s for _p, _i, s, _b in got]
        assert stamps == sorted(stamps)  # sends were serialized: one global order too
        deadline = time.monotonic() + WAIT
        while ch.stats().overflow_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ch.stats().overflow_messages == 0
        assert _file(ch, tmp_path).stat().st_size == 0  # truncated once drained
        assert ch.sender().send(b"after") > 0  # back to the ring: a real seq
    finally:
        ch.close()


def test_producers_racing_a_draining_receiver_keep_their_order(
    chan_name: str, tmp_path: Path
) -> None:
    ch = shmchan.Channel.create(chan_name, capacity=SMALL, overflow=tmp_path)
    try:
        n = 3000
        procs = [CTX.Process(target=_free_producer, args=(chan_name, p, n)) for p in range(3)]
        with ch.receiver() as rx, running(*procs):
            time.sleep(0.3)  # let the ring fill and spill, then drain while they send
            got = _drain(rx, 3 * n, limit=2 * WAIT)
            for p in procs:
                p.join(WAIT)
            with pytest.raises(shmchan.Empty):
                rx.recv(timeout=0.2)
        assert [p.exitcode for p in procs] == [0, 0, 0]
        assert sorted((p, i) for p, i, _b in got) == [(p, i) for p in range(3) for i in range(n)]
        for p in range(3):
            mine = [i for q, i, _b in got if q == p]
            assert mine == sorted(mine), f"producer {p} out of order"
    finally:
        ch.close()


def test_send_many_puts_what_does_not_fit_in_the_file_after_what_did(
    ch_factory: Any, tmp_path: Path
) -> None:
    ch = ch_factory(capacity=SMALL, overflow=tmp_path)
    tx = ch.sender()
    seqs = tx.send_many([(i.to_bytes(4, "little") * 64, ("k",)) for i in range(2000)], timeout=0)
    assert 0 < seqs.count(0) < 2000  # a prefix went in the ring, the rest to the file
    assert seqs[seqs.index(0) :] == [0] * seqs.count(0)
    with ch.receiver() as rx:
        got = [int.from_bytes(p[:4], "little") for p in _drain(rx, 2000)]
    assert got == list(range(2000))


@pytest.fixture
def ch_factory(make_channel: Any) -> Any:
    return make_channel


def test_overflow_limit_reached_is_full_saying_how_to_raise_it(
    ch_factory: Any, tmp_path: Path
) -> None:
    ch = ch_factory(capacity=SMALL, overflow=tmp_path, overflow_limit=16 << 10)
    tx = ch.sender()
    with pytest.raises(shmchan.Full) as e:
        for _ in range(10_000):
            tx.send(b"z" * 1000, timeout=0)
    assert "overflow" in str(e.value) and "overflow_limit=" in str(e.value)
    assert ch.stats().overflow_bytes <= 16 << 10
    t0 = time.monotonic()
    with pytest.raises(shmchan.Full):
        tx.send(b"z" * 1000, timeout=0.2)  # waits its timeout, like a full ring
    assert time.monotonic() - t0 >= 0.15
    with ch.receiver() as rx:  # receiving makes room in the ring, the drain in the file
        _drain(rx, 40)  # of the ~75 sent
        tx.send(b"z" * 1000, timeout=WAIT)


def test_bad_overflow_arguments_are_refused_at_once(chan_name: str, tmp_path: Path) -> None:
    with pytest.raises(shmchan.InvalidArgument, match="not a directory"):
        shmchan.Channel.create(chan_name, overflow=tmp_path / "missing")
    with pytest.raises(shmchan.InvalidArgument, match="needs overflow"):
        shmchan.Channel.create(chan_name, overflow_limit=1 << 20)
    with pytest.raises(shmchan.InvalidArgument, match="overflow_limit"):
        shmchan.Channel.create(chan_name, overflow=tmp_path, overflow_limit=10)
    with pytest.raises(shmchan.ChannelNotFound):
        shmchan.Channel.open(chan_name)  # nothing was created


def _tail(ch: shmchan.Channel) -> int:
    return int(_ovf_state(ch).tail)


def test_records_an_appender_killed_before_publishing_left_are_never_delivered(
    ch_factory: Any, tmp_path: Path
) -> None:
    ch = ch_factory(capacity=SMALL, overflow=tmp_path)
    tx, sent = _spill_numbers(ch, 5)
    f = _file(ch, tmp_path)
    assert f.stat().st_size == _tail(ch)
    # What a SIGKILL after the write and before the tail moved leaves: a whole record
    # past the tail; and after it, a torn one (killed mid-write).
    ghost = b"".join(overflow.encode(1, pickle.dumps("ghost"), b"", 0))
    torn = b"".join(overflow.encode(1, pickle.dumps("torn" * 1000), b"", 0))[:3000]
    with open(f, "ab") as fh:
        fh.write(ghost + torn)
    tx.send(pickle.dumps(sent), timeout=0)  # the next appender cuts them off first
    sent += 1
    assert f.stat().st_size == _tail(ch)  # nothing past the tail: cut, then written
    with open(f, "ab") as fh:
        fh.write(ghost)  # and one more that nobody overwrites
    with ch.receiver() as rx:
        got = [pickle.loads(p) for p in _drain(rx, sent)]
        with pytest.raises(shmchan.Empty):
            rx.recv(timeout=0.2)
    assert got == list(range(sent))
    assert _skipped(ch) == 0


def test_a_corrupt_record_is_skipped_without_holding_up_the_ones_behind_it(
    ch_factory: Any, tmp_path: Path
) -> None:
    ch = ch_factory(capacity=SMALL, overflow=tmp_path)
    _tx, sent = _spill_numbers(ch, 10)
    in_ring = sent - 10
    f = _file(ch, tmp_path)
    raw = bytearray(f.read_bytes())
    total = struct.unpack_from("<Q", raw, 8)[0]
    raw[3 * total + 40] ^= 0xFF  # a bad byte in the 4th record's body
    f.write_bytes(bytes(raw))
    with ch.receiver() as rx:
        got = [pickle.loads(p) for p in _drain(rx, sent - 1)]
        with pytest.raises(shmchan.Empty):
            rx.recv(timeout=0.2)
    assert got == [i for i in range(sent) if i != in_ring + 3]
    assert _skipped(ch) == 1


def test_appenders_killed_at_random_moments_leave_nothing_torn_and_lose_nothing_returned(
    chan_name: str, tmp_path: Path
) -> None:
    size = 48 << 10
    ch = shmchan.Channel.create(chan_name, capacity=SMALL, overflow=tmp_path)
    try:
        rng = random.Random(29)
        returned_total: list[int] = []
        for _ in range(6):
            returned = CTX.Value("q", 0)
            p = CTX.Process(target=_slow_appender, args=(chan_name, returned, size))
            with running(p):
                deadline = time.monotonic() + WAIT
                while returned.value < 2 and time.monotonic() < deadline:
                    time.sleep(0.001)
                time.sleep(rng.uniform(0, 0.05))
                os.kill(p.pid, signal.SIGKILL)
                p.join(WAIT)
            returned_total.append(returned.value)
        with ch.receiver() as rx:
            bodies = []
            while True:
                try:
                    h = rx.recv(timeout=0.5)
                except shmchan.Empty:
                    break
                bodies.append(bytes(h.data))
                h.release()
        seen: list[int] = []
        for b in bodies:  # every message whole: one index repeated over the payload
            assert len(b) == size and b == b[:8] * (size // 8)
            seen.append(struct.unpack_from("<Q", b)[0])
        # each run restarted at 0: split the stream into runs at each drop back to 0
        runs: list[list[int]] = []
        for i in seen:
            if i == 0 or not runs:
                runs.append([])
            runs[-1].append(i)
        assert len(runs) == len(returned_total)
        for run, ret in zip(runs, returned_total, strict=True):
            assert run == list(range(len(run)))  # in order, none lost, none twice
            assert len(run) in (ret, ret + 1)  # returned ones all; at most the one in flight
        assert _skipped(ch) == 0
    finally:
        ch.close()


def test_a_receiver_killed_mid_drain_is_followed_by_one_that_loses_nothing(
    chan_name: str, tmp_path: Path
) -> None:
    ch = shmchan.Channel.create(chan_name, capacity=SMALL, overflow=tmp_path)
    try:
        tx = ch.sender()
        n = 3000
        for i in range(n):
            tx.send((i, b"w" * 200), keys=(i % 3,), timeout=0)
        assert ch.stats().overflow_messages > n // 2
        got = CTX.Array("i", n)
        p = CTX.Process(target=_slow_receiver, args=(chan_name, got))
        with running(p):
            deadline = time.monotonic() + WAIT
            while sum(got[:]) < n // 3 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert 0 < ch.stats().overflow_messages  # killed with the drain under way
            os.kill(p.pid, signal.SIGKILL)
            p.join(WAIT)
        first = list(got[:])
        rx = take_receiver_seat(ch)
        try:
            rest = []
            while True:
                try:
                    h = rx.recv(timeout=0.5)
                except shmchan.Empty:
                    break
                rest.append(h.payload[0])
                h.release()
        finally:
            rx.close()
        assert rest == sorted(rest)  # the new receiver hands them out in order
        counts = [first[i] + rest.count(i) for i in range(n)]
        assert min(counts) >= 1  # nothing lost
        assert sum(counts) - n <= 4  # at-least-once: only what was in flight, or mid-drain
        assert ch.stats().overflow_messages == 0
    finally:
        ch.close()


def test_shutdown_still_delivers_what_went_to_the_file(ch_factory: Any, tmp_path: Path) -> None:
    ch = ch_factory(capacity=SMALL, overflow=tmp_path)
    tx = ch.sender()
    for i in range(1000):
        tx.send(i.to_bytes(4, "little") * 50, timeout=0)
    assert ch.stats().overflow_messages > 0
    ch.shutdown()
    with pytest.raises(shmchan.Closed):
        tx.send(b"late", timeout=0)
    with ch.receiver() as rx:
        got = [int.from_bytes(h.payload[:4], "little") for h in _released(rx)]
    assert got == list(range(1000))


def _released(rx: shmchan.Receiver) -> Any:
    deadline = time.monotonic() + WAIT
    for h in rx:  # ends once shut down and drained, overflow included
        assert time.monotonic() < deadline
        with h:
            yield h


def test_send_async_goes_to_the_file_without_waiting(ch_factory: Any, tmp_path: Path) -> None:
    ch = ch_factory(capacity=SMALL, overflow=tmp_path)
    tx = ch.sender()

    async def burst() -> list[int]:
        return [await tx.send_async(b"a" * 500, timeout=0) for _ in range(500)]

    seqs = asyncio.run(asyncio.wait_for(burst(), WAIT))
    assert seqs.count(0) > 0  # timeout=0 and no Full: the rest went to the file
    with ch.receiver() as rx:
        assert len(_drain(rx, 500)) == 500


def test_stat_and_rm_show_and_remove_the_overflow(chan_name: str, tmp_path: Path) -> None:
    ch = shmchan.Channel.create(chan_name, capacity=SMALL, overflow=tmp_path)
    try:
        tx = ch.sender()
        for _ in range(500):
            tx.send(b"s" * 500, timeout=0)
        st = ch.stats()
        out = run_shmchan("stat", chan_name, "--json", timeout=WAIT)
        stats = json.loads(out.stdout)["stats"]
        assert stats["overflow_messages"] == st.overflow_messages > 0
        assert stats["overflow_bytes"] == st.overflow_bytes > 0
        text = run_shmchan("stat", chan_name, timeout=WAIT).stdout
        assert "overflow_messages" in text
        prom = run_shmchan("stat", chan_name, "--prometheus", timeout=WAIT).stdout
        assert "shmchan_overflow_messages" in prom
        assert _file(ch, tmp_path).exists()
        assert run_shmchan("rm", "--force", chan_name, timeout=WAIT).returncode == 0
        assert not list(tmp_path.glob("shmchan.*.overflow"))
    finally:
        ch.close()


def test_a_channel_without_overflow_still_waits_and_has_no_file(
    ch_factory: Any, tmp_path: Path
) -> None:
    ch = ch_factory(capacity=SMALL)
    tx = ch.sender()
    with pytest.raises(shmchan.Full):
        for _ in range(10_000):
            tx.send(b"n" * 1000, timeout=0)
    st = ch.stats()
    assert st.overflow_bytes == st.overflow_messages == 0


def test_a_file_that_never_quite_drains_gives_back_the_blocks_taken_back(
    ch_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(overflow, "PUNCH_EVERY", 64 << 10)  # the drainer runs in this process
    ch = ch_factory(capacity=SMALL, overflow=tmp_path)
    tx = ch.sender()
    for i in range(600):  # about 2.4 MiB, nearly all in the file
        tx.send(i.to_bytes(4, "little") * 1024, timeout=0)
    f = _file(ch, tmp_path)
    with ch.receiver() as rx:
        _drain(rx, 400)  # two thirds taken back; the file is not empty, so not truncated
        st = f.stat()
        assert st.st_size > 2 << 20
        assert _on_disk(ch) > 0
        assert st.st_blocks * 512 < st.st_size - (1 << 20)  # the drained part's blocks freed
        _drain(rx, 200)


def test_an_exchange_publish_to_several_channels_does_not_spill_it_waits_behind_the_file(
    ch_factory: Any, tmp_path: Path
) -> None:
    ch = ch_factory(capacity=SMALL, overflow=tmp_path)
    other = ch_factory(capacity=1 << 20)
    ex = shmchan.Exchange.create(f"t{os.getpid()}_xovf", kind="fanout")
    try:
        ex.bind(ch.name)
        tx = ch.sender()
        for i in range(200):
            tx.send(pickle.dumps((i, b"p" * 500)), timeout=0)
        assert _on_disk(ch) > 0
        assert ex.publish(pickle.dumps((-1, b"")), timeout=0) == {ch.name: 0}  # one: a send
        ex.bind(other.name)
        with pytest.raises(shmchan.Full):
            ex.publish(pickle.dumps(("published", b"")), timeout=0.2)  # two: not into a file
        assert other.stats().queued == 0  # all or nothing
        with ch.receiver() as rx:
            got = [pickle.loads(p)[0] for p in _drain(rx, 201)]
            ex.publish(pickle.dumps(("published", b"")), timeout=WAIT)  # drained: room
            got += [pickle.loads(p)[0] for p in _drain(rx, 1)]
        assert got == [*range(200), -1, "published"]  # behind everything sent before it
        assert other.stats().queued == 1
    finally:
        ex.close()
        shmchan.unlink_exchange(ex.name)


def _forked_sender(tx: shmchan.Sender, first: int, n: int) -> None:
    for i in range(first, first + n):
        tx.send(pickle.dumps((i, b"f" * 300)), timeout=0)


def test_a_forked_child_appends_with_its_own_descriptor(ch_factory: Any, tmp_path: Path) -> None:
    ch = ch_factory(capacity=SMALL, overflow=tmp_path)
    tx = ch.sender()
    _forked_sender(tx, 0, 400)  # this process has spilled: its descriptor is open
    assert _on_disk(ch) > 0
    fork = multiprocessing.get_context("fork")
    p = fork.Process(target=_forked_sender, args=(tx, 400, 400))
    with running(p):
        p.join(WAIT)
    assert p.exitcode == 0
    _forked_sender(tx, 800, 100)
    with ch.receiver() as rx:
        got = [pickle.loads(b)[0] for b in _drain(rx, 900)]
    assert got == list(range(900))


def test_a_closed_channel_that_spilled_is_unmapped(chan_name: str, tmp_path: Path) -> None:
    import gc
    import weakref

    ch = shmchan.Channel.create(chan_name, capacity=SMALL, overflow=tmp_path)
    tx = ch.sender()
    for _ in range(200):
        tx.send(b"x" * 500, timeout=0)
    assert _on_disk(ch) > 0
    seg = weakref.ref(ch._live())
    ch.unlink()
    ch.close()
    del tx, ch
    gc.collect()
    assert seg() is None  # this process's appender does not keep the mapping alive
