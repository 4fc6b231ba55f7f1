"""Ring space: long-lived records keep only their own space (csrc/compact.c).

Dead letters and held handles stay in the ring for as long as they live. Scattered
among released messages they must not pin the space around them: the channel keeps
accepting messages while the bytes it holds fit, whatever is pinned where.
"""

from __future__ import annotations

import random
import struct
import time

import pytest
from procs import CTX, WAIT, running

import shmchan


def payload(i: int, size: int) -> bytes:
    head = struct.pack("<Q", i)
    return head + bytes((i + j) & 0xFF for j in range(size - len(head)))


def test_scattered_dead_letters_do_not_fill_a_small_channel(make_channel):
    # The reproduction of issue #8 item 2: 64 KiB, max_attempts=1, every 10th message
    # nacked. It used to raise Full after 7-8 dead letters (8 KB of 64 KB) with nothing
    # queued or in flight.
    ch = make_channel(capacity=64 << 10, max_attempts=1)
    tx, rx = ch.sender(), ch.receiver()
    dead = []
    for i in range(400):  # 40 dead letters: about 41 KB of the 64 KB
        tx.send(payload(i, 1000), keys=(f"k{i % 7}",), timeout=2)
        h = rx.recv(timeout=2)
        assert h.seq == i + 1 and h.payload == payload(i, 1000)
        if i % 10 == 9:
            h.nack()
            dead.append(i)
        else:
            h.release()
    stats = ch.stats()
    assert (stats.queued, stats.inflight, stats.dead_letters) == (0, 0, len(dead))
    letters = ch.dead_letters()
    assert [d.payload for d in letters] == [payload(i, 1000) for i in dead]
    assert [d.seq for d in letters] == [i + 1 for i in dead]
    for d in letters:
        assert d.discard()
    rx.try_recv()  # let the receiver take the discards in
    assert ch.stats().dead_letters == 0


def chaos_producer(name: str, me: int, count: int, seed: int) -> None:
    rng = random.Random(seed)
    with shmchan.Channel.open(name) as ch:
        tx = ch.sender()
        for i in range(count):
            size = rng.randrange(64, 6000)
            tx.send(payload(me << 32 | i, size), keys=(f"k{rng.randrange(20)}",), timeout=WAIT)


@pytest.mark.timeout(120)
def test_dead_letters_under_chaos_keep_only_their_own_space(make_channel):
    # Variant of the 1 MiB chaos run that stayed full with 15-18 dead letters (40 KB):
    # two producers, random sizes and keys, random nacks, some handles held a while.
    ch = make_channel(capacity=1 << 20, max_attempts=1)
    rx = ch.receiver()
    per = 2500
    procs = [CTX.Process(target=chaos_producer, args=(ch.name, p, per, 1000 + p)) for p in range(2)]
    rng = random.Random(7)
    seen: set[int] = set()
    nacked: set[int] = set()
    held: list[shmchan.Handle] = []
    with running(*procs):
        last = time.monotonic()
        while len(seen) < 2 * per:
            try:
                h = rx.recv(timeout=1.0)
            except shmchan.Empty:
                # Whatever waits behind the held handles' keys may go on once they are
                # released; a channel that stays stuck after that is the bug.
                assert time.monotonic() - last < WAIT, f"stuck at {len(seen)}: {ch.stats()}"
                for h in held:
                    h.release()
                held.clear()
                continue
            last = time.monotonic()
            ident = struct.unpack_from("<Q", h.payload)[0]  # a copy: nothing pinned
            assert ident not in seen
            seen.add(ident)
            roll = rng.random()
            if roll < 0.04 and len(nacked) < 120:  # ~120 dead letters, ~360 KB at most
                nacked.add(ident)
                h.nack()
            elif roll < 0.10:
                held.append(h)  # released a little later, out of order
            else:
                h.release()
            if len(held) > 8:
                held.pop(rng.randrange(len(held))).release()
        for h in held:
            h.release()
        for p in procs:
            p.join(WAIT)
            assert p.exitcode == 0  # no send stayed Full for WAIT seconds
    assert {struct.unpack_from("<Q", d.payload)[0] for d in ch.dead_letters()} == nacked
    assert ch.stats().dead_letters == len(nacked)
