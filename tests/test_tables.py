"""The receiver's tables: what a channel with millions of slots costs before it is used,
and the key table's probing past its last entry (csrc/sched.c, csrc/segment.c)."""

from __future__ import annotations

import resource
from typing import Any

import pytest

import shmchan
from shmchan import codec
from shmchan._lib import ffi, lib
from tests.procs import check_core

BIG_WINDOW = 1 << 20  # max_messages: a slot table of about 100 MiB, nodes about 50 MiB


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _fact(name: str) -> int:
    out = ffi.new("uint64_t *")
    assert lib.shm_layout_fact(name.encode(), out) == 0, name
    return int(out[0])


def test_a_channel_with_a_big_window_touches_few_table_pages(make_channel: Any) -> None:
    # Before, creating the channel wrote every slot's and node's free-list link (one page
    # fault per 4 KiB of table: about 38,000 here), and stats() read every slot.
    before = _minor_faults()
    ch = make_channel(capacity=1 << 20, max_messages=BIG_WINDOW)
    tx, rx = ch.sender(), ch.receiver()
    for i in range(1000):
        tx.send(b"x", keys=i % 50)
    for _ in range(1000):
        rx.recv(timeout=5).release()
    st = ch.stats()
    faults = _minor_faults() - before
    assert st.released == 1000 and st.queued == 0
    assert faults < 4000, f"{faults} page faults to create and use a channel of {BIG_WINDOW} slots"
    tx.close()
    rx.close()


def test_a_big_window_is_used_from_its_free_list_and_past_it(make_channel: Any) -> None:
    # Slots are taken from the free list first and from the never-used part after it:
    # holding many handles at once goes past what was ever used before, and everything
    # comes back in order once released.
    ch = make_channel(capacity=4 << 20, max_messages=64)
    tx, rx = ch.sender(), ch.receiver()
    for round_ in range(3):
        n = 20 * (round_ + 1)  # more handles out at once each round
        for i in range(n):
            tx.send(i, keys=(i, f"s{i}") if i % 3 == 0 else i)  # 1 or 2 nodes each
        held = [rx.recv(timeout=5) for _ in range(n)]
        assert sorted(h.payload for h in held) == list(range(n))
        what = ffi.new("uint32_t *")
        assert lib.shm_check_scheduler(rx._seg.ptr, what) == 0, f"check {what[0]} failed"
        for h in held[::2] + held[1::2]:
            h.release()
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=0)
    assert ch.stats().released == 20 + 40 + 60
    tx.close()
    rx.close()


def test_the_key_table_is_sized_exactly_not_to_a_power_of_two() -> None:
    # A default 1 GiB channel has 4,194,304 slots and 8,388,617 nodes; rounding its key
    # table up to a power of two made it 2^25 entries (1.5 GiB) instead of 2 * nodes.
    cfg = ffi.new("shm_config *")
    cfg.capacity = 1 << 30
    cfg.max_keys = 8
    cfg.max_messages = 1 << 22
    cfg.max_producers = 1024
    cfg.handover_ns = 2_000_000_000
    total = ffi.new("uint64_t *")
    assert lib.shm_layout_size(cfg, total) == 0
    nodes = 2 * cfg.max_messages + cfg.max_keys + 1
    tables = total[0] - (1 << 30)
    per_message = (
        _fact("slot.size") + 2 * _fact("node.size") + 2 * 2 * _fact("key.size") + 16
    )  # slot, two nodes, a key entry per node at load 1/2, a heap entry
    assert nodes * 2 * _fact("key.size") < tables
    assert tables <= cfg.max_messages * per_message + (1 << 20), (
        f"{tables / 2**30:.2f} GiB of tables for {cfg.max_messages:,} slots"
    )


def _home(hash_: int, size: int) -> int:
    return ((hash_ >> 32) * size) >> 32  # csrc/core.h key_home


def _keys_homed_at(index: int, size: int, count: int) -> list[int]:
    found: list[int] = []
    k = 0
    while len(found) < count:
        enc = codec.encode_keys(k, 1)[0][2:]  # the key's encoding, without its u16 frame
        if _home(lib.shm_hash_key(enc, len(enc)), size) == index:
            found.append(k)
        k += 1
    return found


@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_keys_whose_probe_wraps_past_the_last_entry_keep_their_order(
    make_channel: Any, order: str
) -> None:
    ch = make_channel(capacity=1 << 20, max_messages=16, max_keys=2, order=order)
    tx, rx = ch.sender(), ch.receiver()
    size = int(ffi.cast("uint32_t *", lib.shm_base(rx._seg.ptr) + _fact("header.keytab_size"))[0])
    assert size == 16384  # the smallest table: 2 * nodes is less
    last = _keys_homed_at(size - 1, size, 3)  # a run from the last entry wraps to 0 and 1
    first = _keys_homed_at(0, size, 1)  # homed where the wrapped run lands
    keys = last + first
    for round_ in range(4):
        for k in keys:
            tx.send((k, round_, 0), keys=k)
            tx.send((k, round_, 1), keys=k)
        got: list[Any] = []
        for _ in range(2):
            batch = [rx.recv(timeout=5) for _ in keys]  # one per key: the others wait
            assert sorted(h.payload[0] for h in batch) == sorted(keys)
            with pytest.raises(shmchan.Empty):
                rx.recv(timeout=0)
            what = ffi.new("uint32_t *")
            assert lib.shm_check_scheduler(rx._seg.ptr, what) == 0, f"check {what[0]} failed"
            # release in an order that deletes from the middle of the wrapped run
            order_ = [2, 0, 3, 1] if round_ % 2 else [1, 3, 0, 2]
            for j in order_:
                got.append(batch[j].payload)
                batch[j].release()
        for k in keys:
            assert [p[2] for p in got if p[0] == k] == [0, 1]
    tx.close()
    rx.close()


@pytest.mark.parametrize("order", ["fifo", "eager"])
def test_a_key_left_with_nothing_leaves_the_table_at_once(make_channel: Any, order: str) -> None:
    # Keys x and y share a home entry, so y is placed just past x. A message on (a, x)
    # parks behind x; when x is released it moves on (eager: to the chain of a, which is
    # held), and x's entry then holds nothing. It must leave the table there and then:
    # left in place it hid y (lookups stop at an entry that holds nothing), and y's
    # release raised ChannelCorrupted.
    ch = make_channel(capacity=1 << 20, order=order)
    tx, rx = ch.sender(), ch.receiver()
    size = int(ffi.cast("uint32_t *", lib.shm_base(rx._seg.ptr) + _fact("header.keys_active"))[0])
    x, y = _keys_homed_at(size // 3, size, 2)
    (a,) = _keys_homed_at(2 * size // 3, size, 1)
    for payload, keys in (("m1", (x,)), ("m2", (a, x)), ("m3", (y,)), ("m4", (a,))):
        tx.send(payload, keys=keys)
    h1, h3 = rx.recv(timeout=5), rx.recv(timeout=5)
    assert (h1.payload, h3.payload) == ("m1", "m3")
    h4 = rx.recv(timeout=5) if order == "eager" else None  # fifo: m4 waits behind m2
    h1.release()
    h2 = rx.try_recv()  # the poll that moves m2 on
    assert (h2 is None) == (order == "eager")
    check_core(rx)
    h3.release()  # y: found where it is
    check_core(rx)
    if order == "eager":
        assert h4 is not None and h4.payload == "m4"
        h4.release()
        h2 = rx.recv(timeout=5)
    assert h2 is not None and h2.payload == "m2"
    h2.release()
    if order == "fifo":
        h4 = rx.recv(timeout=5)
        assert h4.payload == "m4"
        h4.release()
    with pytest.raises(shmchan.Empty):
        rx.recv(timeout=0)
    check_core(rx)
    assert ch.stats().held_keys == 0
    tx.close()
    rx.close()
