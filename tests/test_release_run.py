"""The receiver's release of many messages at once (Batch.release, Receiver.release_many)
finishes them as one run (csrc/handles.c release_many_rx): a receiver killed in the middle
of the run loses nothing, redelivers only what it had not released, and leaves tables the
next receiver can rebuild."""

from __future__ import annotations

import pytest
from procs import check_core, kill_at_pause, take_receiver_seat

import shmchan

N = 20  # messages the victim holds; the pause is after the CAS of the 11th (N // 2)

_RELEASE_VICTIM = """
    import sys
    import shmchan
    from shmchan._lib import lib
    name, notify, wait, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), "{how}"
    rx = shmchan.Channel.open(name).receiver()
    if how == "batch":
        b = rx.recv_batch({n}, timeout=10)
        assert len(b) == {n}
        lib.shm_test_pause_at(lib.SHM_PAUSE_RELEASE_RUN, notify, wait)
        b.release()
    else:
        hs = rx.recv_many({n}, timeout=10)
        assert len(hs) == {n}
        lib.shm_test_pause_at(lib.SHM_PAUSE_RELEASE_RUN, notify, wait)
        rx.release_many(hs)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["batch", "many"])
@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_a_receiver_killed_in_the_middle_of_a_release_run_loses_nothing(
    chan_name: str, order: str, how: str
) -> None:
    # Killed with the first half and the 11th marked released (the run finishes them
    # after every CAS of its chunk; the next receiver finishes what it left): those are
    # gone for good; the rest were still the dead receiver's and come back, before every later
    # message on their keys, with their second attempt.
    ch = shmchan.Channel.create(chan_name, capacity=1 << 20, order=order)
    try:
        tx = ch.sender()
        keys = [f"k{i}" for i in range(N)]
        first = list(tx.send_batch(bytes(N), [1] * N, keys))
        kill_at_pause(_RELEASE_VICTIM.format(how=how, n=N), chan_name, "a release run's middle")
        rx = take_receiver_seat(ch)
        check_core(rx)
        later = list(tx.send_batch(bytes(N), [1] * N, keys))
        got: list[tuple[int, int]] = []
        while len(got) < N + N - (N // 2 + 1):
            b = rx.recv_batch(100, timeout=10)
            got.extend(zip((int(s) for s in b.seqs), (int(a) for a in b.attempts), strict=True))
            check_core(rx)
            b.release()
            check_core(rx)
        assert rx.try_recv() is None
        back = first[N // 2 + 1 :]
        assert sorted(s for s, _ in got) == sorted(back + later)  # each once, none lost
        assert all(a == 2 for s, a in got if s in back)
        assert all(a == 1 for s, a in got if s in later)
        if order == "fifo":  # per key: the redelivered one before the later one
            place = {s: i for i, (s, _) in enumerate(got)}
            assert all(place[first[i]] < place[later[i]] for i in range(N // 2 + 1, N))
        stats = ch.stats()
        assert (stats.inflight, stats.queued) == (0, 0)
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


_PASS_VICTIM = """
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
@pytest.mark.parametrize("point", ["SHM_PAUSE_RELEASE_KEYS", "SHM_PAUSE_RELEASE_DONE"])
def test_a_receiver_killed_in_a_release_runs_later_passes_loses_nothing(
    chan_name: str, point: str, order: str, how: str, n: int
) -> None:
    # Killed after its first chunk's CAS pass (the run's chunks are 256 messages): at
    # RELEASE_KEYS every message of the chunk is RELEASED and its keys passed on while
    # its record is still COMMITTED; at RELEASE_DONE, in the middle of the finish pass,
    # the chunk's first half is FREE but off the free list, one record is DONE with its
    # slot still RELEASED, the rest as at RELEASE_KEYS, and head has not moved. The whole
    # first chunk counts as released (gone for good, its keys free for the next
    # messages); a second chunk's messages were never touched, still the dead
    # receiver's, and come back with their second attempt.
    ch = shmchan.Channel.create(chan_name, capacity=1 << 20, order=order)
    try:
        tx = ch.sender()
        keys = [f"k{i}" for i in range(n)]
        first = list(tx.send_batch(bytes(n), [1] * n, keys))
        script = _PASS_VICTIM.format(how=how, n=n, point=point)
        kill_at_pause(script, chan_name, f"{point} in a release run")
        gone = min(n, 256)  # the first chunk
        rx = take_receiver_seat(ch)
        check_core(rx)
        stats = ch.stats()
        # the dead receiver's untouched handles are back in the queue; the chunk counted
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
