"""Rewind: an empty ring starts again at offset 0 (csrc/ring.c, ring_rewind).

A channel whose receiver keeps up must not walk through all of its capacity: a 1 GiB
ring carrying a trickle would touch a fresh page every few dozen messages, in every
process that maps it. When the receiver finds the ring empty far into its lap it claims
the tail for a skip to the lap's end, so the next message lands at the start again. These
tests look at what that must and must not change: the pages a process ends up mapping
(its resident set in the channel's mapping, from /proc/self/smaps), the room the ring
offers afterwards, and every message's delivery with producers in other processes.
"""

from __future__ import annotations

import struct
import time

from procs import CTX, WAIT, running

import shmchan

MIB = 1 << 20


def mapped_rss(name: str) -> int:
    """Bytes of this process's mappings of channel `name`'s segment that are resident
    (the ring is mapped twice in a row: both count)."""
    total, mine = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                mine = line.rstrip().endswith(name)
            elif mine and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def record(i: int, size: int) -> bytes:
    return struct.pack("<Q", i) + bytes([(i * 7 + 1) & 0xFF]) * (size - 8)


def test_a_receiver_that_keeps_up_maps_only_the_start_of_a_big_ring(make_channel):
    # 32 MiB through a 256 MiB channel, each message received before the next is sent:
    # without rewinds the process maps 32 MiB of ring pages; with them, about the 4 MiB
    # a lap goes before the receiver finds it empty and rewinds.
    ch = make_channel(capacity=256 * MIB)
    tx, rx = ch.sender(), ch.receiver()
    body = bytes(4000)
    tx.send(body, keys=(0,), timeout=WAIT)
    rx.recv(timeout=WAIT).release()
    before = mapped_rss(ch.name)  # the tables and the ring's first page
    for i in range(1, 8 * 1024):
        tx.send(body, keys=(i % 16,), timeout=WAIT)
        with rx.recv(timeout=WAIT) as h:
            assert h.seq == i + 1
    grew = mapped_rss(ch.name) - before
    assert 0 < grew < 8 * MIB, f"{grew / MIB:.1f} MiB more of the ring mapped"


def test_a_rewound_ring_still_holds_its_whole_capacity(make_channel):
    # Rewinding frees nothing and takes nothing: right after one, the channel accepts as
    # many messages as a fresh one does before it is full, and delivers them intact.
    size = 3000

    def fill(tx) -> int:
        n = 0
        while True:
            try:
                tx.send(record(n, size), keys=(n % 5,), timeout=0)
            except shmchan.Full:
                return n
            n += 1

    fresh = make_channel(capacity=16 * MIB)
    want = fill(fresh.sender())
    assert want > 5000

    ch = make_channel(capacity=16 * MIB)
    tx, rx = ch.sender(), ch.receiver()
    for i in range(2000):  # about 6 MiB: past REWIND_AT (4 MiB) of a 16 MiB ring
        tx.send(record(i, size), keys=(i % 5,), timeout=WAIT)
        rx.recv(timeout=WAIT).release()
    assert rx.try_recv() is None  # empty: the receiver rewinds here
    got = fill(tx)
    assert got == want
    for i in range(got):
        with rx.recv(timeout=WAIT) as h:
            assert h.payload == record(i, size)
    assert rx.try_recv() is None


def bursty_producer(name: str, me: int, bursts: int, per_burst: int, size: int) -> None:
    with shmchan.Channel.open(name) as ch:
        tx = ch.sender()
        i = 0
        for _ in range(bursts):
            for _ in range(per_burst):
                tx.send(record(me << 32 | i, size), keys=(f"p{me}k{i % 7}",), timeout=WAIT)
                i += 1
            time.sleep(0.005)  # the receiver catches up and finds the ring empty


def test_producers_in_other_processes_lose_nothing_across_rewinds(make_channel):
    # Three producers in bursts, so the receiver often finds the ring empty mid-lap and
    # rewinds while they claim: every message arrives once, intact, in its key's order,
    # and the receiver's mapping shows that rewinds kept it near the ring's start.
    ch = make_channel(capacity=64 * MIB)
    rx = ch.receiver()
    before = mapped_rss(ch.name)
    nprod, bursts, per_burst, size = 3, 100, 20, 4000  # about 23 MiB in all
    procs = [
        CTX.Process(target=bursty_producer, args=(ch.name, me, bursts, per_burst, size))
        for me in range(nprod)
    ]
    last: dict[tuple[int, int], int] = {}
    seen = 0
    deadline = time.monotonic() + 4 * WAIT
    with running(*procs):
        while seen < nprod * bursts * per_burst:
            assert time.monotonic() < deadline, f"only {seen} messages arrived"
            h = rx.recv(timeout=WAIT)
            (tag,) = struct.unpack_from("<Q", h.payload)
            me, i = tag >> 32, tag & 0xFFFFFFFF
            assert h.payload == record(tag, size)
            assert h.keys == (f"p{me}k{i % 7}",)
            assert last.get((me, i % 7), -1) < i  # per key, in the order sent
            last[(me, i % 7)] = i
            h.release()
            seen += 1
        for p in procs:
            p.join(WAIT)
            assert p.exitcode == 0
    assert rx.try_recv() is None
    assert len(last) == nprod * 7
    stats = ch.stats()
    assert (stats.queued, stats.inflight) == (0, 0)
    assert mapped_rss(ch.name) - before < 8 * MIB
