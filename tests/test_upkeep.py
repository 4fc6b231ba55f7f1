"""The receiver's upkeep walks the handed-out list (csrc/handles.c), not the message table:
the list must hold exactly the handles out of the receiver's hands through every kind of
step, and upkeep must still find what it exists to find (forgotten releases, expired
leases) on a table far larger than what is in flight."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from shmchan._lib import ffi, lib


def _check(rx: Any) -> None:
    what = ffi.new("uint32_t *")
    assert lib.shm_check_scheduler(rx._seg.ptr, what) == 0, f"check {what[0]} failed"


def _fact(name: str) -> int:
    out = ffi.new("uint64_t *")
    assert lib.shm_layout_fact(name.encode(), out) == 0, name
    return int(out[0])


def test_handed_out_list_is_exact_after_every_kind_of_step(
    make_channel: Callable[..., Any],
) -> None:
    ch = make_channel(max_attempts=2, max_messages=64)
    tx, rx = ch.sender(), ch.receiver()
    for i in range(12):
        tx.send(b"m%d" % i, keys=i % 5)
    _check(rx)
    hs = rx.recv_many(5, timeout=1)
    _check(rx)
    hs[0].release()
    hs[1].nack()  # attempt 1 of 2: back in line
    _check(rx)
    rx.release_many(hs[2:])
    _check(rx)
    again = rx.recv(timeout=1)
    while again.seq != hs[1].seq:
        again.release()
        again = rx.recv(timeout=1)
    again.nack()  # attempt 2 of 2: a dead letter, still out of the receiver's hands
    _check(rx)
    assert [d.seq for d in ch.dead_letters()] == [hs[1].seq]
    assert ch.dead_letters()[0].discard()
    _check(rx)
    while (h := rx.try_recv()) is not None:
        h.release()
    _check(rx)
    assert ch.stats().inflight == 0 and ch.stats().dead_letters == 0


def test_a_release_whose_releaser_died_before_telling_is_finished_by_upkeep(
    make_channel: Callable[..., Any],
) -> None:
    """The releaser's CAS happened, its push did not (it was killed in between): two sweeps
    later the receiver finishes the release and the key is free again. A table of 2^20
    slots with one handle out: upkeep finds it on the handed-out list."""
    ch = make_channel(max_messages=1 << 20)
    tx, rx = ch.sender(), ch.receiver()
    seq = tx.send(b"held", keys="k")
    tx.send(b"next", keys="k")
    h = rx.recv(timeout=1)
    assert h.seq == seq
    fd = os.open(f"/dev/shm/shmchan.{ch.name}", os.O_RDWR)
    try:
        slots_off = int.from_bytes(os.pread(fd, 8, _fact("header.slots_off")), "little")
        slot = slots_off + h._slot * _fact("slot.size")
        word = int.from_bytes(os.pread(fd, 8, slot), "little")
        assert word & 0xFF == 3  # INFLIGHT (csrc/core.h)
        os.pwrite(fd, ((word & ~0xFF) | 4).to_bytes(8, "little"), slot)  # RELEASED, not pushed
    finally:
        os.close(fd)
    assert rx.try_recv() is None  # "k" is still held: nobody told the receiver
    for _ in range(2):  # seen on two consecutive sweeps with an empty release stack
        rx._next_sweep = 0.0
        rx.maintain()
    nxt = rx.recv(timeout=1)
    assert nxt.payload == b"next"
    nxt.release()
    _check(rx)
    h._finish(0)  # the original handle's late release is a no-op


def test_an_expired_lease_is_found_among_a_few_handles_in_a_large_table(
    make_channel: Callable[..., Any],
) -> None:
    ch = make_channel(max_messages=1 << 20, lease=0.05)
    tx, rx = ch.sender(), ch.receiver()
    for i in range(3):
        tx.send(b"x", keys=i)
    hs = rx.recv_many(3, timeout=1)
    hs[0].extend(60)
    hs[1].release()
    time.sleep(0.1)
    assert rx.maintain() == 1  # hs[2] ran out; hs[0] was extended
    back = rx.recv(timeout=1)
    assert (back.seq, back.attempt) == (hs[2].seq, 2)
    back.release()
    hs[0].release()
    _check(rx)
