"""The receiver's release of many messages at once (Batch.release, Receiver.release_many)
finishes them as one run (csrc/handles.c release_many_rx): a receiver killed in the middle
of the run loses nothing, redelivers only what it had not released, and leaves tables the
next receiver can rebuild."""

from __future__ import annotations

import pytest
from procs import check_core, drain_checked, kill_at_pause, receiver_after_kill, take_receiver_seat

import shmchan

_RELEASE_VICTIM = """
    import sys
    import shmchan
    from shmchan._lib import lib
    name, notify, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rx = shmchan.Channel.open(name).receiver()
    if "{how}" == "batch":
        held = rx.recv_batch({n}, timeout=10)
    else:  # a receive takes in at most a window's step: gather them for one release
        held = []
        while len(held) < {n}:
            held += rx.recv_many({n} - len(held), timeout=10)
    assert len(held) == {n}
    lib.shm_test_pause_at(lib.{point}, notify, wait)
    if "{how}" == "batch":
        held.release()
    else:
        rx.release_many(held)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("how", "n"), [("batch", 20), ("many", 20), ("many", 300)])
@pytest.mark.parametrize("order", ["fifo", "eager"])
@pytest.mark.parametrize(
    "point", ["SHM_PAUSE_RELEASE_RUN", "SHM_PAUSE_RELEASE_KEYS", "SHM_PAUSE_RELEASE_DONE"]
)
def test_a_receiver_killed_in_the_middle_of_a_release_run_loses_nothing(
    chan_name: str, point: str, order: str, how: str, n: int
) -> None:
    # The run's chunks are 256 messages, each finished in passes. Killed at RELEASE_RUN,
    # in the first chunk's CAS pass: its messages up to the middle one are RELEASED, the
    # rest still INFLIGHT. At RELEASE_KEYS, after the pass that gives the keys on: the
    # whole chunk RELEASED, keys passed on, every record still COMMITTED. At RELEASE_DONE,
    # in the middle of the finish pass: the chunk's first half FREE but off the free list,
    # one record DONE with its slot still RELEASED, the rest as at RELEASE_KEYS, head not
    # moved. What was marked released is gone for good and counted, its keys free for the
    # next messages; the rest (a second chunk's too) was still the dead receiver's and
    # comes back with its second attempt, before every later message on its keys.
    ch = shmchan.Channel.create(chan_name, capacity=1 << 20, order=order)
    try:
        tx = ch.sender()
        keys = [f"k{i}" for i in range(n)]
        first = list(tx.send_batch(bytes(n), [1] * n, keys))
        script = _RELEASE_VICTIM.format(how=how, n=n, point=point)
        kill_at_pause(script, chan_name, f"{point} in a release run")
        gone = n // 2 + 1 if point == "SHM_PAUSE_RELEASE_RUN" else min(n, 256)
        rx = take_receiver_seat(ch)
        check_core(rx)
        stats = ch.stats()
        # the dead receiver's unreleased handles are back in the queue; the rest counted
        assert (stats.inflight, stats.queued, stats.released) == (0, n - gone, gone)
        later = list(tx.send_batch(bytes(n), [1] * n, keys))
        got: list[tuple[int, int]] = []
        while len(got) < n + n - gone:
            b = rx.recv_batch(100, timeout=10)
            got.extend(zip((int(s) for s in b.seqs), (int(a) for a in b.attempts), strict=True))
            check_core(rx)
            b.release()
            check_core(rx)
        assert rx.try_recv() is None
        back = first[gone:]
        assert sorted(s for s, _ in got) == sorted(back + later)  # each once, none lost
        assert all(a == 2 for s, a in got if s in back)
        assert all(a == 1 for s, a in got if s in later)
        if order == "fifo":  # per key: the redelivered one before the later one
            place = {s: i for i, (s, _) in enumerate(got)}
            assert all(place[first[i]] < place[later[i]] for i in range(gone, n))
        stats = ch.stats()
        assert (stats.inflight, stats.queued, stats.held_keys, stats.window) == (0, 0, 0, 0)
        assert stats.used_bytes == 0  # head moved over every record, the dead run's too
        assert (stats.sent, stats.released) == (2 * n, 2 * n)
        rx.close()
    finally:
        ch.close()
        shmchan.unlink(chan_name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_release_runs_out_of_ring_order_free_only_what_they_finished(
    chan_name: str, order: str
) -> None:
    # The run moves head straight over the records it finished one after another from
    # head, and no further: a later batch released first leaves the earlier one's records
    # in place (new sends must not overwrite them), and once both are released the ring
    # is empty again.
    n, size = 40, 200
    ch = shmchan.Channel.create(chan_name, capacity=1 << 16, order=order)
    try:
        tx, rx = ch.sender(), ch.receiver()
        for r in range(4):
            data = b"".join(bytes([r * n + i]) * size for i in range(n))
            tx.send_batch(data, [size] * n, [f"k{i}" for i in range(n)], timeout=5)
            first = rx.recv_batch(n // 2, timeout=5)
            later = rx.recv_batch(n // 2, timeout=5)
            assert (len(first), len(later)) == (n // 2, n // 2)
            later.release()
            check_core(rx)
            # as much as the ring takes now: written over `first` only if head passed it
            filler = bytes([255]) * size
            for j in range(1 << 16):
                try:
                    tx.send(filler, f"f{j}", timeout=0)
                except shmchan.Full:
                    break
            else:
                raise AssertionError("the ring never filled")
            assert first.joined() == data[: n // 2 * size]
            first.release()
            check_core(rx)
            while (h := rx.try_recv()) is not None:  # the fillers
                h.release()
            check_core(rx)
            stats = ch.stats()
            assert (stats.inflight, stats.window, stats.used_bytes) == (0, 0, 0)
        rx.close()
    finally:
        ch.close()
        shmchan.unlink(chan_name)


_RELEASE_ONE_VICTIM = """
    import sys
    import shmchan
    from shmchan._lib import lib
    name, notify, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rx = shmchan.Channel.open(name).receiver()
    held = [rx.recv(timeout=10) for _ in range(3)]
    held[0].release()
    lib.shm_test_pause_at(lib.SHM_PAUSE_RELEASE_ONE, notify, wait)
    held[1].release()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_a_receiver_killed_in_the_middle_of_a_single_release_loses_nothing(
    chan_name: str, order: str
) -> None:
    # Killed in Handle.release() after the record is marked done and before its slot is
    # free: that release counts (its keys went on, its record is finished), the handle
    # still out comes back with its second attempt, and head passes every finished record.
    ch = shmchan.Channel.create(chan_name, capacity=1 << 20, order=order)
    try:
        tx = ch.sender()
        first = [tx.send(bytes([i]), keys=f"k{i}") for i in range(3)]
        rx = receiver_after_kill(ch, _RELEASE_ONE_VICTIM, chan_name, "SHM_PAUSE_RELEASE_ONE")
        stats = ch.stats()
        assert (stats.inflight, stats.queued, stats.released) == (0, 1, 2)
        later = [tx.send(bytes([3 + i]), keys=f"k{i}") for i in range(3)]
        got = [(s, a) for s, a, _ in drain_checked(rx)]
        assert sorted(s for s, _ in got) == sorted([first[2], *later])  # each once
        assert dict(got)[first[2]] == 2
        assert all(a == 1 for s, a in got if s != first[2])
        if order == "fifo":  # k2: the redelivered one before the later one
            assert [s for s, _ in got].index(first[2]) < [s for s, _ in got].index(later[2])
        stats = ch.stats()
        assert (stats.inflight, stats.queued, stats.window, stats.used_bytes) == (0, 0, 0, 0)
        assert (stats.sent, stats.released) == (6, 6)
        rx.close()
    finally:
        ch.close()
        shmchan.unlink(chan_name)
