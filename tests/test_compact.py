"""Compaction of a long parked run keeps the channel whole when memory is short.

A slide moves parked records and then points their keys' chains at the copies. Whatever
that needs is had before the first record moves: if it cannot be had, the run stays where
it is this time; if the chains still cannot be repaired after a slide, the receiver rebuilds
its state from the ring at once. Either way no parked message is lost.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from procs import WAIT

from shmchan._lib import lib

N, CAPACITY, SIZE = 70_000, 16 << 20, 4096


def park_run_and_lap(ch, rx, laps: int):
    """Hold "hot", park N messages behind it, then send, receive and release `laps`
    free-key messages of SIZE bytes each, one at a time: the ring wraps only if the
    parked run at its head is slid out of the way. Returns the held handle and the
    parked messages' seqs."""
    parked = []
    with ch.sender() as tx:
        tx.send(b"held", keys="hot")
        held = rx.recv(timeout=WAIT)
        for _ in range(N // 1000):
            parked += tx.send_many([(b"h", ("hot",))] * 1000, timeout=WAIT)
        assert rx.try_recv() is None
        for i in range(laps):
            tx.send(bytes([i & 0xFF]) * SIZE, keys=i, timeout=2.0)
            with rx.recv(timeout=WAIT) as h:
                assert h.keys == (i,)
    return held, parked


def release_and_receive(held, rx) -> list:
    """Release the held handle; the seqs of everything then ready, each released."""
    held.release()
    seqs = []
    while (h := rx.try_recv()) is not None:
        seqs.append(h.seq)
        h.release()
    return seqs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["fifo", "eager"])
@pytest.mark.parametrize(
    "fail",
    [
        # the memory for the chains' repair is refused before anything moves: that slide
        # does not happen, a later one does
        "SHM_TEST_COMPACT_RESERVE",
        # the chains' repair fails after the slide: the receiver rebuilds its state from
        # the ring at once, and nothing is reported corrupt
        "SHM_TEST_COMPACT_CHAINS",
    ],
    ids=["reserve_refused", "repair_failed"],
)
def test_a_slide_that_fails_keeps_every_parked_message_in_order(make_channel, order, fail):
    """Whichever way a slide of a parked run fails, the free keys keep flowing past the
    run and every parked message comes out, in order, once its key is released."""
    ch = make_channel(capacity=CAPACITY, order=order, max_keys=lib.SHM_MAX_KEYS_LIMIT)
    rx = ch.receiver()
    lib.shm_test_compact_fail(getattr(lib, fail))
    try:
        held, parked = park_run_and_lap(ch, rx, 2 * CAPACITY // SIZE)
    finally:
        armed = lib.shm_test_compact_fail(0)
    assert armed == 0, "no slide of parked records was tried"
    assert ch.stats().queued == N
    assert release_and_receive(held, rx) == parked
    rx.close()


CHILD = """
import resource, sys
import shmchan
sys.path.insert(0, sys.argv[2])
from test_compact import N, CAPACITY, SIZE, park_run_and_lap, release_and_receive

ch = shmchan.Channel.open(sys.argv[1])
rx = ch.receiver()
with ch.sender() as tx:  # warm up: the allocations a send and a receive make, made once
    tx.send(b"w", keys="warm")
rx.recv(timeout=5).release()
vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
# Room for what the run's compaction needs (its entries: ~40 bytes a record, twice while
# growing), not for 8 bytes x max_keys a record.
resource.setrlimit(resource.RLIMIT_AS, (vm + (24 << 20), resource.RLIM_INFINITY))
held, parked = park_run_and_lap(ch, rx, 2 * CAPACITY // SIZE)
print(release_and_receive(held, rx) == parked)
"""


@pytest.mark.timeout(120)
def test_a_parked_run_slides_under_a_memory_limit(make_channel, chan_name):
    """A receiver under an address-space limit slides a run of parked records on a
    channel with 64 keys a message: the memory a slide needs follows the keys the records
    carry, not the most they could, and none of it is asked for after records moved."""
    ch = make_channel(chan_name, capacity=CAPACITY, max_keys=lib.SHM_MAX_KEYS_LIMIT)
    here = str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, chan_name, here],
        cwd=str(Path(__file__).parent.parent),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True"]
    assert ch.stats().queued == 0
